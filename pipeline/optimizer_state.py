"""Optimizer state by parameter name, as safetensors tensors plus JSON: what a one-process checkpoint stores.

Keys use parameter names rather than positions, so a checkpoint survives a change of parameter order (and says
which parameter is missing when it does not fit). Several optimizers over disjoint parameters (Muon + AdamW,
pipeline/optimizers.py) share one namespace: a parameter belongs to one of them.

Two kinds of value need more than `torch.save` would give them, and neither may be pickled:
- torchao's low-bit states (OptimState8bit / OptimState4bit) are tensor subclasses, which safetensors cannot hold:
  each is stored as its inner tensors (`<param>.<key>:codes`, `:scale`, `:qmap`) plus its flatten context in the
  JSON, and rebuilt by the class's own `__tensor_unflatten__` (only torchao's optimizer-state classes are rebuilt);
- a tensor-valued hyper-parameter (torchao keeps `lr` as a tensor) goes into the JSON as its float.
"""

from __future__ import annotations

from typing import Any

import torch

from atelier_studio.pipeline.checkpoint_files import CheckpointError


def _packable_classes() -> dict[str, type]:
    """The tensor subclasses a checkpoint may rebuild, by class name: torchao's optimizer states only."""
    try:
        from torchao.optim.subclass_4bit import OptimState4bit
        from torchao.optim.subclass_8bit import OptimState8bit
    except ImportError:
        return {}
    return {c.__name__: c for c in (OptimState8bit, OptimState4bit)}


def _is_subclass(t: torch.Tensor) -> bool:
    return type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter and hasattr(t, "__tensor_flatten__")


def _ctx_to_json(v: Any) -> Any:
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).removeprefix("torch.")}
    if isinstance(v, torch.Size):
        return {"size": list(v)}
    if isinstance(v, (list, tuple)):
        return [_ctx_to_json(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise TypeError(f"{type(v).__name__} {v!r} in a tensor subclass's flatten context cannot go into JSON")


def _ctx_from_json(v: Any) -> Any:
    if isinstance(v, dict) and "dtype" in v:
        return getattr(torch, v["dtype"])
    if isinstance(v, dict) and "size" in v:
        return torch.Size(v["size"])
    if isinstance(v, list):
        return [_ctx_from_json(x) for x in v]
    return v


def optimizer_state_to_tensors(parts: list[torch.optim.Optimizer], names: dict[int, str]
                               ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Flatten the optimizers' state into named tensors plus JSON (hyper-parameters, non-tensor state, how each
    tensor subclass is rebuilt)."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    packed: dict[str, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    for optimizer in parts:
        sd = optimizer.state_dict()
        index_to_name = {}
        for group, live_group in zip(sd["param_groups"], optimizer.param_groups):
            for idx, p in zip(group["params"], live_group["params"]):
                index_to_name[idx] = names[id(p)]
        for idx, st in sd["state"].items():
            name = index_to_name[idx]
            for k, v in st.items():
                if torch.is_tensor(v) and _is_subclass(v):
                    inner, ctx = v.__tensor_flatten__()
                    for i in inner:
                        tensors[f"{name}.{k}:{i}"] = getattr(v, i)
                    packed.setdefault(name, {})[k] = {"class": type(v).__name__, "inner": list(inner),
                                                      "ctx": _ctx_to_json(ctx), "size": list(v.shape),
                                                      "stride": list(v.stride())}
                elif torch.is_tensor(v):
                    tensors[f"{name}.{k}"] = v
                else:
                    scalars.setdefault(name, {})[k] = v
        groups += [{k: (v.item() if torch.is_tensor(v) else v) for k, v in g.items() if k != "params"}
                   | {"params": [index_to_name[i] for i in g["params"]]} for g in sd["param_groups"]]
    return tensors, {"param_groups": groups, "scalar_state": scalars, "packed_state": packed}


def optimizer_state_from_tensors(parts: list[torch.optim.Optimizer], names: dict[int, str],
                                 tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """Load what `optimizer_state_to_tensors` saved into optimizers built over the same named parameters."""
    live = [names[id(p)] for opt in parts for g in opt.param_groups for p in g["params"]]
    saved = [n for g in meta["param_groups"] for n in g["params"]]
    live_groups = [len(opt.param_groups) for opt in parts]
    if sorted(live) != sorted(saved) or len(meta["param_groups"]) != sum(live_groups):
        missing = sorted(set(live) - set(saved))[:5]
        unexpected = sorted(set(saved) - set(live))[:5]
        raise CheckpointError(
            f"optimizer state does not match the model's trainable parameters and optimizer (missing: {missing}, "
            f"unexpected: {unexpected}, {len(meta['param_groups'])} parameter groups saved, {sum(live_groups)} "
            f"now) — was the checkpoint made with another lora/model config or train.optimizer?")
    per_name: dict[str, dict[str, Any]] = {}
    inner: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for key, value in tensors.items():
        name, k = key.rsplit(".", 1)
        if ":" in k:
            k, part = k.split(":", 1)
            inner.setdefault(name, {}).setdefault(k, {})[part] = value
        else:
            per_name.setdefault(name, {})[k] = value
    classes = _packable_classes()
    for name, entries in meta.get("packed_state", {}).items():
        for k, spec in entries.items():
            cls = classes.get(spec["class"])
            if cls is None:
                raise CheckpointError(f"optimizer state {name}.{k} is a {spec['class']}, which this install cannot "
                                          f"rebuild (torchao's low-bit optimizers need torchao)")
            per_name.setdefault(name, {})[k] = cls.__tensor_unflatten__(
                inner[name][k], _ctx_from_json(spec["ctx"]), torch.Size(spec["size"]), tuple(spec["stride"]))
    for name, st in meta.get("scalar_state", {}).items():
        per_name.setdefault(name, {}).update(st)
    saved_groups = iter(meta["param_groups"])
    for optimizer in parts:
        state: dict[int, dict[str, Any]] = {}
        groups = []
        offset = 0
        for live_group in optimizer.param_groups:
            saved_group = next(saved_groups)
            params = list(range(offset, offset + len(live_group["params"])))
            for i, p in zip(params, live_group["params"]):
                if names[id(p)] in per_name:
                    state[i] = per_name[names[id(p)]]
            groups.append({k: v for k, v in saved_group.items() if k != "params"} | {"params": params})
            offset += len(params)
        optimizer.load_state_dict({"state": state, "param_groups": groups})


__all__ = ["optimizer_state_to_tensors", "optimizer_state_from_tensors"]
