"""Several processes, one model: torchrun's environment, the process group, FSDP2 and its policies.

Shape legend: W world size (processes), r rank, R rows of a tensor (its dim 0, the one FSDP2 shards),
c = ceil(R / W) rows per shard (torch.chunk's split: the last shards may be short or empty).

One process per GPU under `torchrun` (or several on a CPU, with gloo: how CI tests it). The pieces,
in the order a task applies them after building its model:

    ctx = init_distributed(train_cfg)           # reads RANK/WORLD_SIZE/LOCAL_RANK — the only place that does
    model = <built on the meta device>          # no storage anywhere yet
    parallelize(model, blocks, ctx, cfg, dtype) # activation checkpointing → per-block compile → FSDP2
    materialize_(model, ctx.device, read)       # each rank fills only its shard of every tensor, read(name, rows)

Without torchrun (WORLD_SIZE unset) `init_distributed` returns a context with `enabled = False`: no
process group, no FSDP; activation checkpointing and compile still apply (the single-process path).

FSDP2 (`fully_shard`) shards every parameter by rows over the W ranks: one unit per block plus a root unit
(embeddings, final norm, LM head). `MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32)`: blocks are
all-gathered in the compute dtype, gradients reduce-scattered and accumulated in fp32. Gradients are
SUMMED across ranks (divide factor 1): each rank's loss is already divided by the GLOBAL loss weight
(pipeline/trainer.py), so the sum is the gradient of the mean over the global batch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from atelier_studio.pipeline.config import DistributedConfig, TrainConfig
from atelier_studio.pipeline.errors import AtelierError
from atelier_studio.pipeline.policies import checkpoint_blocks, compile_block_list


class DistributedError(AtelierError, RuntimeError):
    """torchrun's environment or a sharding request that cannot work; the message names the variable."""


@dataclass(frozen=True)
class DistContext:
    """Where this process stands. `enabled`: a process group exists (launched by torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    is_main: bool = True
    enabled: bool = False
    owns_group: bool = False  # this context created the process group (and `shutdown` destroys it)


# ----------------------------------------------------------------------------- environment and process group

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def torchrun_env() -> dict[str, int] | None:
    """RANK, WORLD_SIZE, LOCAL_RANK as ints when launched by torchrun; None when WORLD_SIZE is unset.

    The one place in Atelier that reads the launcher's environment.
    MASTER_ADDR / MASTER_PORT are read by `init_process_group("env://")` itself.
    """
    if "WORLD_SIZE" not in os.environ:
        return None
    out = {}
    for name in _TORCHRUN_VARS:
        raw = os.environ.get(name)
        if raw is None:
            raise DistributedError(f"WORLD_SIZE is set but {name} is not: launch through torchrun "
                                   f"(`atelier ... --nproc N` does), or unset WORLD_SIZE for one process")
        try:
            out[name] = int(raw)
        except ValueError:
            raise DistributedError(f"environment variable {name}={raw!r} is not an integer") from None
    if out["WORLD_SIZE"] < 1 or not 0 <= out["RANK"] < out["WORLD_SIZE"]:
        raise DistributedError(f"need 0 <= RANK < WORLD_SIZE, got RANK={out['RANK']} WORLD_SIZE={out['WORLD_SIZE']}")
    return out


def resolve_device(spec: str) -> torch.device:
    """`train.device` on one process: "auto" is CUDA where there is one, else the CPU."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DistributedError(f"train.device = {spec!r} but CUDA is not available on this machine")
    return device


def launched_by_torchrun() -> bool:
    return torchrun_env() is not None


def init_distributed(train: TrainConfig) -> DistContext:
    """The process group from torchrun's environment (NCCL on CUDA, gloo on CPU), or a one-process context."""
    env = torchrun_env()
    if env is None:
        return DistContext(device=resolve_device(train.device))
    rank, world, local = env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]
    spec = train.device
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DistributedError(f"train.device = {train.device!r} but CUDA is not available on this machine")
        if device.index is None:  # one GPU per process: LOCAL_RANK picks it
            if local >= torch.cuda.device_count():
                raise DistributedError(f"LOCAL_RANK={local} but this node has {torch.cuda.device_count()} GPUs "
                                       f"(--nproc must not exceed the GPUs per node)")
            device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    backend = train.distributed.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise DistributedError("train.distributed.backend = 'nccl' needs train.device on CUDA; use gloo on CPU")
    owns = not dist.is_initialized()  # a caller (a test worker running several trainings) may own it
    if owns:
        dist.init_process_group(backend, rank=rank, world_size=world,
                                device_id=device if device.type == "cuda" else None)
    return DistContext(rank=rank, world_size=world, local_rank=local, device=device, is_main=rank == 0, enabled=True,
                       owns_group=owns)


def shutdown(ctx: DistContext) -> None:
    """Destroy the process group if `ctx` created it."""
    if ctx.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def barrier(ctx: DistContext) -> None:
    if ctx.enabled:
        dist.barrier()


def all_reduce_sum(ctx: DistContext, values: Sequence[float]) -> list[float]:
    """Sum host numbers over ranks (fp64: exact for integer counts below 2^53); identity for one process."""
    if not ctx.enabled:
        return [float(v) for v in values]
    t = torch.tensor(list(values), dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t)
    return t.tolist()


def all_gather_objects(ctx: DistContext, obj: object) -> list:
    """Every rank's `obj`, in rank order, on every rank (small picklable values: data positions); [obj] alone."""
    if not ctx.enabled:
        return [obj]
    out: list = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(ctx: DistContext, obj: object) -> object:
    """Rank 0's `obj` on every rank (small picklable values only: paths, flags)."""
    if not ctx.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ----------------------------------------------------------------------------- AC → compile → FSDP


def _reshard_policy(policy: str, index: int, num_blocks: int) -> bool:
    if policy == "always":
        return True
    if policy == "never":
        return False
    return index < num_blocks - 1  # "default": backward starts with the last block, keep it gathered


def parallelize(model: nn.Module, blocks: Sequence[nn.Module], ctx: DistContext, cfg: DistributedConfig,
                param_dtype: torch.dtype | None) -> nn.Module:
    """Apply, in place and in this order: expert parallelism → activation checkpointing → per-block compile → FSDP2
    (under torchrun).

    blocks: the repeated layers (each becomes its own FSDP unit); the rest of `model` is the root unit.
    cfg.expert_parallel > 1 shards the experts of MoE layers by expert over the ranks (pipeline/expert_parallel.py);
    FSDP2 leaves those alone.
    param_dtype: FSDP2's all-gather/compute dtype; None keeps each parameter's own dtype (LoRA: a bf16 frozen
    base with fp32 adapters). Gradients are reduced in `cfg.reduce_dtype` and summed over ranks.
    Works on a meta-device model (then call `materialize_`) or on a loaded one.
    """
    experts: set[nn.Parameter] = set()
    if cfg.expert_parallel > 1:
        from atelier_studio.pipeline.expert_parallel import apply_expert_parallel

        experts = apply_expert_parallel(blocks, ctx, cfg.expert_parallel)
    checkpoint_blocks(blocks, cfg.activation_checkpointing)  # pipeline/policies.py: none | full | selective
    if cfg.compile:
        compile_block_list(blocks)  # in place: parameter names keep no `_orig_mod.` prefix
    if not ctx.enabled:
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    reduce_dtype = torch.float32 if cfg.reduce_dtype == "float32" else torch.bfloat16
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=mesh, mp_policy=mp, ignored_params=experts or None,
                    reshard_after_forward=_reshard_policy(cfg.reshard_after_forward, i, len(blocks)))
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False, ignored_params=experts or None)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # sum, not mean: losses are pre-divided by the global weight
            m.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM, NCCL needs no scaling
    return model


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Reduce-scatter gradients in this backward (True) or keep accumulating them unsharded in fp32 (False).

    The trainer turns sync off for all but the last micro-batch of a step, so an accumulated step
    reduces once, not once per micro-batch. No-op without FSDP.
    """
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)  # recurses into every block's unit


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


# ----------------------------------------------------------------------------- materialising a meta model

Reader = Callable[[str, slice], torch.Tensor]


def local_rows(t: torch.Tensor) -> slice:
    """The rows (dim 0) of the full tensor that this rank holds: all of them for a plain tensor."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, DTensor):
        return slice(0, t.shape[0]) if t.ndim else slice(None)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for p in t.placements:
        if isinstance(p, Shard) and p.dim != 0:
            raise DistributedError(f"only row (dim 0) sharding is supported, got placement {p}")
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return slice(offset[0], offset[0] + shape[0]) if t.ndim else slice(None)


def materialize_(model: nn.Module, device: torch.device, read: Reader) -> nn.Module:
    """Give a meta-device model storage on `device` and fill each rank's shard of every tensor, in place.

    read(name, rows) returns rows `rows` of the full tensor `name` (a state-dict name), on any device and dtype;
    for a sharded parameter only this rank's rows [r·c, (r+1)·c) are asked for, so no rank reads or holds
    the whole model. The values are cast to each tensor's dtype.
    """
    from torch.distributed.tensor import DTensor

    model.to_empty(device=device)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            rows = local_rows(t)
            local = t.to_local() if isinstance(t, DTensor) else t
            if local.numel() == 0:
                continue
            src = read(name, rows)
            if tuple(src.shape) != tuple(local.shape):
                raise DistributedError(f"materialize_: {name} rows {rows.start}:{rows.stop} have shape "
                                       f"{tuple(src.shape)}, this rank's shard is {tuple(local.shape)}")
            local.copy_(src)
    return model


def full_state_dict(model: nn.Module, ctx: DistContext, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of `model` as full CPU tensors on rank 0 (others get {}); a collective.
    `trainable_only`: the parameters that train, and nothing frozen (a LoRA run's adapters, not its base)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not is_sharded(model):
        if trainable_only:
            return {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
        return {k: v.detach() for k, v in model.state_dict().items()}
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                ignore_frozen_params=trainable_only))


class consolidated:
    """Context manager: on rank 0, temporarily put full tensors in place of the sharded parameters.

    Lets a task's single-process export (HF model, PEFT adapter, diffusers transformer) run unchanged on the
    consolidated weights, so a W-process export equals a one-process one byte for byte. Every rank must
    enter it (the gather is a collective); only rank 0 sees the swapped parameters. `trainable_only`: gather and
    swap the trainable parameters alone, for an export that writes nothing else (a LoRA adapter): the frozen base,
    which can be hundreds of GB, is never gathered to rank 0's host.
    """

    def __init__(self, model: nn.Module, ctx: DistContext, trainable_only: bool = False):
        self.model, self.ctx, self.trainable_only = model, ctx, trainable_only
        self._saved: list[tuple[nn.Module, str, object]] = []

    def __enter__(self) -> nn.Module:
        if not is_sharded(self.model):
            return self.model
        full = full_state_dict(self.model, self.ctx, self.trainable_only)
        if not self.ctx.is_main:
            return self.model
        for name, p in list(self.model.named_parameters()):
            if self.trainable_only and not p.requires_grad:
                continue
            module_name, _, leaf = name.rpartition(".")
            module = self.model.get_submodule(module_name)
            self._saved.append((module, leaf, module._parameters[leaf]))
            module._parameters[leaf] = nn.Parameter(full[name], requires_grad=p.requires_grad)
        return self.model

    def __exit__(self, *exc) -> None:
        for module, leaf, p in reversed(self._saved):
            module._parameters[leaf] = p  # type: ignore[assignment]
        self._saved.clear()


__all__ = [
    "DistContext", "DistributedError", "torchrun_env", "launched_by_torchrun", "init_distributed", "shutdown",
    "barrier", "all_reduce_sum", "all_gather_objects", "broadcast_object", "parallelize", "set_gradient_sync",
    "is_sharded", "local_rows", "materialize_", "full_state_dict", "consolidated",
]
