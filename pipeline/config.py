"""Typed configs: frozen dataclasses loaded from TOML, with `--set a.b=c` overrides.

A config is a tree of frozen dataclasses. `load_config(Cls, path, overrides)` reads the TOML file,
applies the overrides and builds the tree, checking every key and value on the way in. Every error is
a `ConfigError` that names the dotted key and says what is allowed, e.g.

    train.lr: expected a float, got 'fast' (from --set train.lr=fast)
    data.sequence_len: unknown key; allowed keys in [data]: eval, overflow, seq_len, train

Supported field types: bool, int, float, str, `Literal[...]`, `X | None`, `tuple[T, ...]`,
`tuple[T1, T2]` and nested dataclasses. A dataclass may define `validate(self) -> None` that raises
`ConfigError` (or ValueError, re-raised with the section name) for values that are well typed but
out of range.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal, Sequence, TypeVar

from atelier_studio.pipeline.errors import AtelierError, decode_utf8
from atelier_studio.pipeline.hub import resolve_model_path
from atelier_studio.pipeline.optimizer_config import (
    AdafactorConfig,
    LowBitConfig,
    MuonConfig,
    OptimizerName,
    ProdigyConfig,
    ScheduleFreeConfig,
    check_optimizer_sections,
)

T = TypeVar("T")

# A str field that names a model (a local directory, or a Hugging Face hub id resolved from the local cache when it is
# loaded: pipeline/hub.py): `path: str = field(default="", metadata=MODEL_PATH)`
MODEL_PATH = {"model_path": True}


class ConfigError(AtelierError, ValueError):
    """A config key or value that cannot be used; the message names the key."""


# ----------------------------------------------------------------------------- shared sections


@dataclass(frozen=True)
class DistributedConfig:
    """`[train.distributed]`: how the model is spread over processes under torchrun (pipeline/distributed.py).

    Activation checkpointing and compile also apply to a single process; FSDP only under torchrun.
    """

    backend: Literal["auto", "nccl", "gloo"] = "auto"  # auto: NCCL on CUDA, gloo on CPU
    # FSDP2 all-gather dtype. "auto" lets the task choose: bf16 for bf16 full fine-tuning, fp32 for exact
    # runs, each parameter's own dtype for LoRA (a bf16 frozen base with fp32 adapters).
    param_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"  # gradient reduce-scatter dtype
    # "default": reshard every block after forward except the last (backward needs it first) — torchtitan's
    # policy; "always": every block (least memory); "never": keep blocks unsharded until backward (ZeRO-2-like).
    # The root (embeddings, final norm, LM head) is never resharded after forward: the loss reads the LM head
    # weight outside the model's forward.
    reshard_after_forward: Literal["default", "always", "never"] = "default"
    # recompute in backward (pipeline/policies.py): "full" keeps only each block's input; "selective" keeps the
    # matmul and attention outputs and recomputes norms, RoPE, SwiGLU and casts (long sequences)
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    compile: bool = False  # torch.compile each block (after activation checkpointing, before FSDP)
    # keep saved activations in pinned host memory between forward and backward (one 64k-token document)
    cpu_offload: bool = False
    # "sharded": build on the meta device and read each rank's rows of every tensor from the safetensors
    # files; "full": every rank loads the whole model on the CPU first, then shards it (small models only).
    init: Literal["sharded", "full"] = "sharded"
    async_checkpoint: bool = False  # write checkpoints in a background thread; finalised at the next save
    balance: bool = True  # balance packed rows across ranks by attention cost (sum of len^2 per row)
    # mixture-of-experts models: shard every MoE layer's experts over this many processes and send tokens to them by
    # all-to-all (pipeline/expert_parallel.py); 1 = FSDP2 all-gathers the experts like any weight. Either 1 or the
    # number of processes
    expert_parallel: int = 1

    def validate(self) -> None:
        _positive(self, "expert_parallel")


@dataclass(frozen=True)
class TrainConfig:
    """The training loop's settings, shared by both trainers."""

    max_steps: int = 100
    micro_batch: int = 4
    grad_accum: int = 1
    lr: float = 1e-4
    # the optimizer (pipeline/optimizers.py; docs/training.md#optimizers): its own keys in its section below
    optimizer: OptimizerName = "adamw"
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1  # the schedule decays to lr * min_lr_ratio
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    adam_eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    seed: int = 0
    log_every: int = 1
    eval_every: int = 0  # 0: evaluate only at the end
    save_every: int = 100  # 0: save only at the end (and on SIGTERM/SIGINT)
    keep_checkpoints: int = 2  # newest N kept; 0 keeps all
    resume: str = "auto"  # "auto" (newest checkpoint in output.dir), "never", or a checkpoint path
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:1"
    peak_tflops: float = 0.0  # override the detected device peak for MFU; 0 = detect
    # the linears' matmuls: "bf16" computes them in model.dtype as nn.Linear does; "fp8" swaps them for FP8 ones
    # (kernels/fp8_linear.py: CUDA compute capability >= 8.9; on a CPU the fp32 fake-quantised reference), except
    # the LM head, norms and what each trainer keeps (its task's docstring says which)
    precision: Literal["bf16", "fp8"] = "bf16"
    # with precision "fp8": "rowwise" (E4M3 everywhere, a scale per row of each GEMM operand) or "tensorwise"
    # (E4M3 forward, E5M2 gradients, one scale per tensor); torchtitan's float8 recipes
    fp8_recipe: Literal["rowwise", "tensorwise"] = "rowwise"
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    lowbit: LowBitConfig = field(default_factory=LowBitConfig)  # optimizer "adamw8bit" / "adamw4bit"
    adafactor: AdafactorConfig = field(default_factory=AdafactorConfig)
    schedulefree: ScheduleFreeConfig = field(default_factory=ScheduleFreeConfig)  # optimizer "schedulefree_adamw"
    prodigy: ProdigyConfig = field(default_factory=ProdigyConfig)
    muon: MuonConfig = field(default_factory=MuonConfig)

    def validate(self) -> None:
        _positive(self, "max_steps", "micro_batch", "grad_accum", "log_every")
        check_optimizer_sections(self)
        if self.optimizer == "schedulefree_adamw" and self.schedule != "constant":
            # schedule-free replaces the decay: its average of the iterates is the schedule (warmup still applies)
            raise ConfigError(f"schedule: {self.schedule!r} decays the learning rate, which schedule-free AdamW "
                              f"replaces with its average of the iterates; set train.schedule = \"constant\" "
                              f"(train.warmup_steps still warms up)")
        if self.optimizer == "prodigy" and not 0.1 <= self.lr <= 10.0:
            raise ConfigError(f"lr: {self.lr} multiplies the step size Prodigy estimates itself; its authors use 1.0 "
                              f"(set train.lr = 1.0, or prodigy.d_coef to scale it)")
        _non_negative(self, "warmup_steps", "weight_decay", "grad_clip", "eval_every", "save_every",
                      "keep_checkpoints", "adam_eps", "peak_tflops")
        if not self.lr > 0:
            raise ConfigError(f"lr: must be > 0, got {self.lr}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"min_lr_ratio: must be in [0, 1], got {self.min_lr_ratio}")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"betas: each must be in [0, 1), got {self.betas}")
        if self.warmup_steps > self.max_steps:
            # an error, not a clamp: the run would never reach its lr (warmup 20 over 5 steps peaks at 25% of
            # it), and a silently changed schedule hides the mistake; the fix is one --set
            raise ConfigError(f"warmup_steps: {self.warmup_steps} is more than max_steps {self.max_steps}, so the "
                              f"learning rate would never reach train.lr; set train.warmup_steps <= "
                              f"{self.max_steps} (0 disables warmup)")


@dataclass(frozen=True)
class OutputConfig:
    """`[output]`: where a run writes, and which experiment trackers it reports to (pipeline/trackers.py)."""

    dir: str = "runs/default"
    # any subset; W&B and MLflow are extras (`pip install 'atelier-studio[wandb]'`, `[mlflow]`). metrics.jsonl is
    # always written
    trackers: tuple[Literal["tensorboard", "wandb", "mlflow"], ...] = ("tensorboard",)
    # the switch before output.trackers, kept for existing configs: false drops TensorBoard whatever trackers says
    tensorboard: bool = True
    run_name: str = ""  # the trackers' run name; empty: output.dir's folder name
    group: str = ""  # the trackers' group (W&B group, an MLflow tag)
    project: str = "atelier"  # the W&B project and the MLflow experiment

    def validate(self) -> None:
        if not self.dir:
            raise ConfigError("dir: must not be empty")
        repeated = sorted({t for t in self.trackers if self.trackers.count(t) > 1})
        if repeated:
            raise ConfigError(f"trackers: {', '.join(repeated)} listed twice; name each tracker once")
        if not self.project.strip():
            raise ConfigError("project: must not be empty (the W&B project and the MLflow experiment)")

    def active_trackers(self) -> tuple[str, ...]:
        """The trackers this run starts: output.trackers, less TensorBoard when output.tensorboard is false."""
        return tuple(t for t in self.trackers if self.tensorboard or t != "tensorboard")


def check_full_finetuning(lora: Any) -> None:
    """A `[lora]` section with rank 0 (full fine-tuning: every weight trains, no adapters) must set no adapter key
    (targets, dropout, rslora, init_adapter): they would be ignored, and a run that trains every weight instead of
    the adapters asked for is found out only from its size. Both trainers' LoRA sections call this."""
    if lora.rank != 0:
        return
    defaults = {"targets": (), "dropout": 0.0, "rslora": False, "init_adapter": ""}
    given = [f"{k} = {getattr(lora, k)!r}" for k, default in defaults.items() if getattr(lora, k) != default]
    if given:
        raise ConfigError(f"rank: 0 is full fine-tuning (every weight trains, no adapters), but {', '.join(given)} "
                          f"configures adapters; set lora.rank > 0 to train adapters, or leave "
                          f"{', '.join('lora.' + g.split(' = ')[0] for g in given)} unset for full fine-tuning")


@dataclass(frozen=True)
class LoraConfig:
    """`[lora]`: LoRA adapters on a frozen base (pipeline/lora.py), as both trainers read it; rank 0 is full
    fine-tuning. A trainer extends it with its own keys or defaults (designer/config.py, imagegen/config.py)."""

    rank: int = 16  # 0 = full fine-tuning; > 0 trains adapters of this rank on a frozen base
    alpha: float = 32.0  # the scale is alpha / rank; 0 = the rank (scale 1)
    dropout: float = 0.0
    # the model family's linears to wrap, as the trainer names them (its family resolves and checks them when the
    # run starts); empty = the family's default
    targets: tuple[str, ...] = ()
    rslora: bool = False  # scale alpha / sqrt(rank) instead of alpha / rank
    dtype: Literal["float32", "bfloat16"] = "float32"  # the adapter weights' dtype
    # an adapter to continue training from, in the trainer's format; its rank must equal lora.rank
    init_adapter: str = field(default="", metadata=MODEL_PATH)

    def validate(self) -> None:
        if self.rank < 0:
            raise ConfigError(f"rank: must be >= 0 (0 = full fine-tuning), got {self.rank}")
        if self.alpha < 0:
            raise ConfigError(f"alpha: must be >= 0 (0 = the rank), got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout: must be in [0, 1), got {self.dropout}")
        if any(not t.strip() for t in self.targets):
            raise ConfigError(f"targets: {list(self.targets)} holds an empty name")
        check_full_finetuning(self)

    def args(self, targets: tuple[str, ...] | None = None):  # -> pipeline.lora.LoraArgs
        """The LoRA layers' settings: alpha 0 taken as the rank; `targets` as the model side resolved them (default:
        lora.targets as written)."""
        from atelier_studio.pipeline.lora import LoraArgs

        return LoraArgs(rank=self.rank, alpha=self.alpha or float(self.rank), dropout=self.dropout,
                        targets=self.targets if targets is None else targets, rslora=self.rslora, dtype=self.dtype)


def _positive(cfg: Any, *names: str) -> None:
    for name in names:
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{name}: must be > 0, got {getattr(cfg, name)}")


def _non_negative(cfg: Any, *names: str) -> None:
    for name in names:
        if getattr(cfg, name) < 0:
            raise ConfigError(f"{name}: must be >= 0, got {getattr(cfg, name)}")


# ----------------------------------------------------------------------------- loading


def load_config(cls: type[T], path: str | Path | None = None, overrides: Sequence[str] = ()) -> T:
    """Build `cls` from a TOML file (optional) and `a.b=c` overrides, validating everything."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        text = decode_utf8(path.read_bytes(), path, ConfigError)  # a non-UTF-8 byte is named path:line
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from None
    for item in overrides:
        _apply_override(cls, data, item)
    return config_from_dict(cls, data)


def config_from_dict(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or '<root>'}: expected a table, got {_show(data)}")
    known = {f.name: f for f in fields(cls)}
    for key in data:
        if key not in known:
            section = f"[{prefix.rstrip('.')}]" if prefix else "the top level"
            raise ConfigError(f"{prefix}{key}: unknown key{did_you_mean(key, known, prefix)}; allowed keys in "
                              f"{section}: {', '.join(sorted(known))}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, f in known.items():
        if name in data:
            kwargs[name] = _coerce(hints[name], data[name], prefix + name)
            if f.metadata.get("model_path"):  # a cached hub id becomes its snapshot folder (pipeline/hub.py)
                kwargs[name] = resolve_model_path(kwargs[name], prefix + name, strict=False)
        elif is_dataclass(hints[name]):
            kwargs[name] = config_from_dict(hints[name], {}, prefix + name + ".")
    try:
        cfg = cls(**kwargs)
    except TypeError as e:  # a required field with no default
        raise ConfigError(f"{prefix.rstrip('.') or '<root>'}: {e}") from None
    validate = getattr(cfg, "validate", None)
    if validate is not None:
        try:
            validate()
        except (ConfigError, ValueError) as e:
            raise ConfigError(f"{prefix}{e}") from None
    return cfg


def did_you_mean(key: str, known: Any, prefix: str = "") -> str:
    """", did you mean train.lr?" for the closest known key (a typo), or "" when none is close."""
    import difflib

    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    return f", did you mean {prefix}{close[0]}?" if close else ""


def _comma_item(raw: str) -> Any:
    """One item of a comma list given to --set, as TOML reads it (512 -> int, 0.5 -> float, true -> bool); a word
    TOML cannot read stays a string (a Literal's value, or what _coerce reports with the key)."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if is_dataclass(tp):
        return config_from_dict(tp, value, key + ".")
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        errors = []
        for a in inner:
            try:
                return _coerce(a, value, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: no allowed type matches {_show(value)}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: must be one of {', '.join(repr(a) for a in args)}; got {_show(value)}")
        return value
    if origin is tuple:
        if isinstance(value, str):  # a --set comma list: items of a non-string type are read as TOML values
            items = [v.strip() for v in value.split(",") if v.strip()]
            kinds = [args[0]] * len(items) if len(args) == 2 and args[1] is Ellipsis else list(args)
            value = [_comma_item(v) if kind is not str else v for v, kind in zip(items, kinds)] + items[len(kinds):]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {_show(value)}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"{key}: expected {len(args)} items, got {len(value)}")
        return tuple(_coerce(a, v, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {_show(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {_show(value)}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key}: expected a number, got {_show(value)}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {_show(value)}")
    raise ConfigError(f"{key}: unsupported field type {tp!r}")  # a bug in the config class


def _show(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def _apply_override(cls: type, data: dict[str, Any], item: str) -> None:
    """Apply one `a.b=c` override to the raw dict, parsing c against the field's declared type."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. train.lr=3e-4")
    key, raw = item.split("=", 1)
    key = key.strip()
    parts = key.split(".")
    node_cls: Any = cls
    node = data
    for i, part in enumerate(parts):
        hints = _field_types(node_cls) if is_dataclass(node_cls) else {}
        if part not in hints:
            where = ".".join(parts[:i]) or "the top level"
            allowed = ", ".join(sorted(hints)) if hints else "none (not a section)"
            hint = did_you_mean(part, hints, ".".join(parts[:i]) + "." if i else "")
            raise ConfigError(f"{'.'.join(parts[: i + 1])}: unknown key{hint} (--set {item}); "
                              f"allowed keys under {where}: {allowed}")
        tp = hints[part]
        if i < len(parts) - 1:
            if not is_dataclass(tp):
                raise ConfigError(f"{key}: {'.'.join(parts[: i + 1])} is a value, not a section (--set {item})")
            node = node.setdefault(part, {})
            node_cls = tp
        else:
            if is_dataclass(tp):
                raise ConfigError(f"{key}: is a section; set one of its keys (--set {item})")
            node[part] = _parse_override_value(tp, raw.strip())


def _field_types(cls: type) -> dict[str, Any]:
    """A config dataclass's fields and their types (class-level settings, a ClassVar, are not keys)."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in typing.get_type_hints(cls).items() if k in names}


def _parse_override_value(tp: Any, raw: str) -> Any:
    """Strings stay strings (no quoting needed); everything else is read as a TOML value."""
    wants_str = tp is str or (typing.get_origin(tp) is Literal and all(isinstance(a, str) for a in typing.get_args(tp)))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        wants_str = str in typing.get_args(tp) and raw.lower() not in ("none", "null")
        if not wants_str and raw.lower() in ("none", "null"):
            return None
    if wants_str:
        if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
            return raw[1:-1]
        return raw
    if typing.get_origin(tp) is tuple and not raw.startswith("["):
        return raw  # comma-separated list, split by _coerce
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw  # _coerce reports it with the key and the expected type


# ----------------------------------------------------------------------------- writing


def config_to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 1e-3}} -> {"train.lr": 1e-3}: a config's dict (config_to_dict) by dotted key."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_to_toml(cfg: Any) -> str:
    """Serialise a config tree to TOML (round-trips through load_config)."""
    top = config_to_dict(cfg)
    lines: list[str] = []
    scalars = {k: v for k, v in top.items() if not isinstance(v, dict) and v is not None}
    for k, v in scalars.items():
        lines.append(f"{k} = {_toml_value(v)}")
    _emit_tables(top, "", lines)
    return "\n".join(lines).strip() + "\n"


def _emit_tables(d: dict[str, Any], prefix: str, lines: list[str]) -> None:
    for k, v in d.items():
        if isinstance(v, dict):
            lines.append(f"\n[{prefix}{k}]")
            for kk, vv in v.items():
                if not isinstance(vv, dict) and vv is not None:
                    lines.append(f"{kk} = {_toml_value(vv)}")
            _emit_tables(v, f"{prefix}{k}.", lines)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def save_config(cfg: Any, path: str | Path) -> None:
    """Write the resolved config as TOML, atomically (pipeline/atomic.py)."""
    from atelier_studio.pipeline.atomic import atomic_write_text

    atomic_write_text(path, config_to_toml(cfg), what="resolved config")


__all__ = [
    "ConfigError", "DistributedConfig", "TrainConfig", "OutputConfig", "load_config", "config_from_dict",
    "check_full_finetuning",
    "config_to_dict", "flatten",
    "config_to_toml", "save_config", "field",
]
