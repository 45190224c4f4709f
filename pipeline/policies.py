"""Training policies applied to a built model from pipeline/, never inside a model file.

Order, as torchtitan: activation checkpointing → per-block compile → FSDP (pipeline/distributed.py).

    blocks = model_blocks(model)                      # designer: model.model.layers; imagegen: transformer_blocks
    apply_activation_checkpointing(model, "selective")
    compile_blocks(model)
    with cpu_offload(enabled=long_sequences):         # around forward + backward of one step
        loss = ...; loss.backward()

Activation checkpointing modes, per block:
- "none": keep every activation.
- "full": keep only the block's inputs; recompute the whole block in backward.
- "selective": keep the outputs of the matmuls and of attention (expensive to recompute), recompute the
  pointwise and norm ops (cheap, memory-bound) — torch.utils.checkpoint with a selective-checkpoint
  policy (`create_selective_checkpoint_contexts`), as torchtitan's "op" SAC.
Recomputation never changes values: outputs and gradients equal the plain model's (tests/pipeline/test_policies.py).

Each policy wraps the block INSTANCE's forward or compiles the instance in place, so parameter names
(state dicts, checkpoints, PEFT exports) keep the stock keys — no `_checkpoint_wrapped_module.` or
`_orig_mod.` prefixes.

FP8 (`train.precision = "fp8"`, pipeline/float8.py apply_fp8) comes before all of these, right after the model is
loaded (and LoRA applied): it swaps modules for FP8 ones that keep the same Parameters and state-dict keys.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

AC_MODES = ("none", "full", "selective")

# Ops whose outputs selective AC keeps: the matmuls and the attention kernels (FLOP-heavy). Everything else
# (norms, RoPE, SwiGLU, casts, adds) is recomputed in backward. Looked up by name so that ops missing in a
# given torch build are simply absent.
_SAVE_OP_NAMES = (
    "mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_grouped_mm",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward",
)
# Atelier's own ops that hold matmuls (the forward GEMMs of kernels/fp8_linear.py, kernels/fp8_group.py and
# kernels/nf4_linear.py), saved by selective AC likewise.
_SAVE_ATELIER_OP_NAMES = ("fp8_linear_fwd", "fp8_frozen_fwd", "fp8_lora_fwd", "fp8_group_fwd", "fp8_frozen_group_fwd",
                          "nf4_linear_fwd", "nf4_lora_fwd")


def _save_ops() -> frozenset:
    import atelier_studio.kernels.fp8_group  # noqa: F401  (registers the atelier:: fp8 ops)
    import atelier_studio.kernels.nf4_linear  # noqa: F401  (registers the atelier:: nf4 ops)

    ops = []
    for namespace, names in ((torch.ops.aten, _SAVE_OP_NAMES), (torch.ops.atelier, _SAVE_ATELIER_OP_NAMES)):
        for name in names:
            packet = getattr(namespace, name, None)
            if packet is not None:
                ops.append(packet.default)
    return frozenset(ops)


def model_blocks(model: nn.Module) -> nn.ModuleList:
    """The repeated transformer blocks of a designer Qwen3, a transformers Qwen3ForCausalLM (also under PEFT)
    or an imagegen MMDiT. Raises naming the model type when none is found."""
    # The shallowest ModuleList named `model.layers` or `transformer_blocks` (PEFT nests the HF model deeper).
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and (name in ("model.layers", "transformer_blocks")
                                                  or name.endswith((".model.layers", ".transformer_blocks"))):
            return module
    raise TypeError(f"model_blocks: {type(model).__name__} has no `model.layers` or `transformer_blocks` ModuleList")


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """SAC policy: save matmul and attention outputs, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


_SAVE_OPS = _save_ops()
_HAS_RESPECT_HOOKS = "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters


def _checkpoint_forward(block: nn.Module, selective: bool) -> None:
    inner = block.forward
    context_fn = functools.partial(create_selective_checkpoint_contexts, selective_policy) if selective else None

    # Tensors SAC keeps must still go through saved-tensor hooks (cpu_offload's save_on_cpu), where the
    # installed torch lets us say so.
    extra = {"respect_saved_tensors_hooks": True} if selective and _HAS_RESPECT_HOOKS else {}

    def forward(*args: Any, **kwargs: Any) -> Any:
        if context_fn is None:
            return checkpoint(inner, *args, use_reentrant=False, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, context_fn=context_fn, **extra, **kwargs)

    block.forward = forward  # type: ignore[method-assign]
    block._atelier_ac = "selective" if selective else "full"  # type: ignore[attr-defined]


def apply_activation_checkpointing(model: nn.Module, mode: str) -> nn.Module:
    """Checkpoint every block of `model` ("none" | "full" | "selective"), in place; returns `model`."""
    checkpoint_blocks(model_blocks(model), mode)
    return model


def checkpoint_blocks(blocks: Sequence[nn.Module], mode: str) -> None:
    """apply_activation_checkpointing over an explicit list of blocks (pipeline/distributed.parallelize's)."""
    if mode not in AC_MODES:
        raise ValueError(f"activation checkpointing: mode must be one of {AC_MODES}, got {mode!r}")
    if mode == "none":
        return
    for i, block in enumerate(blocks):
        if getattr(block, "_atelier_ac", None):
            raise ValueError(f"apply_activation_checkpointing: block {i} is already checkpointed "
                             f"({block._atelier_ac}); apply a policy once")
        if getattr(block, "_compiled_call_impl", None) is not None:
            raise ValueError(f"apply_activation_checkpointing: block {i} is already compiled; the order is "
                             "activation checkpointing → compile → FSDP")
        _checkpoint_forward(block, selective=(mode == "selective"))


def compile_blocks(model: nn.Module, fullgraph: bool = False, dynamic: bool | None = False,
                   mode: str | None = None) -> nn.Module:
    """torch.compile each block separately, in place (`nn.Module.compile`: names keep no `_orig_mod.`).

    dynamic=False: packed rows have one fixed shape, so one graph per block; the caller keeps every
    input shape (and Python int, e.g. max_seqlen) fixed or each new value recompiles.
    fullgraph=True fails loudly on a graph break; leave it False where a block calls host-syncing code
    (kernels' CPU reference paths do `.tolist()`).
    """
    compile_block_list(model_blocks(model), fullgraph, dynamic, mode)
    return model


def compile_block_list(blocks: Sequence[nn.Module], fullgraph: bool = False, dynamic: bool | None = False,
                       mode: str | None = None) -> None:
    """compile_blocks over an explicit list of blocks (pipeline/distributed.parallelize's)."""
    import torch._dynamo

    # Blocks share one code object; guards that differ between blocks (a block's input requiring grad or not,
    # a layer kind) each add a cache entry: allow one per block rather than falling back to eager after 8.
    limit = max(torch._dynamo.config.recompile_limit, 2 * len(blocks) + 8)
    torch._dynamo.config.recompile_limit = limit
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit,
                                                           4 * limit)
    for block in blocks:
        block.compile(fullgraph=fullgraph, dynamic=dynamic, mode=mode)


@contextlib.contextmanager
def cpu_offload(enabled: bool = True, pin_memory: bool = True) -> Iterator[None]:
    """Keep saved activations in (pinned) host memory during forward, bring them back in backward.

    For long sequences (one 65,536-token document) where activations, not weights, fill the GPU. Enter it
    around forward AND backward of a step. No-op when `enabled` is False; pinning is skipped off CUDA.
    """
    if not enabled:
        yield
        return
    pin = pin_memory and torch.cuda.is_available()
    with torch.autograd.graph.save_on_cpu(pin_memory=pin):
        yield
