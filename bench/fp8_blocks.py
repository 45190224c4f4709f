"""Whole blocks in FP8 against bf16, for bench/fp8_linear.py: one Qwen3-8B decoder block and one SD3-medium MMDiT
joint block, forward + backward, built from the project's own modules with random weights.

Only a block shows what the linears cost inside a step: the shared-input groups (q/k/v, gate/up, the MMDiT's
to_q/k/v and add_q/k/v quantise x once), the norms and attention between the GEMMs, and whether the host keeps the
GPU fed. Variants:
  qwen3-8b (x [8, 2048, 4096], one document per row, causal attention):
    bf16-full, fp8-{rowwise,tensorwise}-full, fp8-rowwise-full-ungrouped      (every linear trained)
    bf16-lora, fp8-{rowwise,tensorwise}-lora, fp8-rowwise-lora-ungrouped      (frozen bases, rank-16 fp32 adapters
                                                                                on every linear, as PEFT)
  sd3-medium (x [8, 4096, 1536] image, ctx [8, 333, 1536] text tokens, c [8, 1536]):
    bf16, fp8-{rowwise,tensorwise}, fp8-rowwise-ungrouped                     (the per-image modulation linears
                                                                                stay bf16: the family's fp8_skip)
"-ungrouped": the same FP8 layers with shared-input grouping off (each projection quantises x itself): the
difference is what grouping buys. Weights and activations bf16; the FP8 layers quantise from them.
Per variant: median fwd+bwd ms (CUDA events), the host's issue ms, peak memory, and on a GPU the profiler's device
time by kernel category (bench/fp8_parts.profile).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import torch
from torch import nn

from atelier_studio.bench.fp8_parts import median, profile, sync

QWEN_VARIANTS = ("bf16-full", "fp8-rowwise-full", "fp8-tensorwise-full", "fp8-rowwise-full-ungrouped",
                 "bf16-lora", "fp8-rowwise-lora", "fp8-tensorwise-lora", "fp8-rowwise-lora-ungrouped")
SD3_VARIANTS = ("bf16", "fp8-rowwise", "fp8-tensorwise", "fp8-rowwise-ungrouped")
# (rows, tokens per row) of the real and the CPU-test sizes
QWEN_SHAPES = {"real": ("8b", 8, 2048), "tiny": ("tiny", 2, 24)}
SD3_SHAPES = {"real": (dict(num_heads=24, head_dim=64, joint_attention_dim=4096, caption_projection_dim=1536,
                            pooled_projection_dim=2048), 8, 4096, 333),
              "tiny": (dict(), 2, 16, 5)}
MMDIT_FP8_SKIP = ("norm1.linear", "norm1_context.linear")  # the MMDiT family's fp8_skip, relative to one block


def _init_(module: nn.Module, seed: int) -> None:
    """Every parameter random (normal, std 0.02; norms' weights 1): no zero-initialised path is skipped. Drawn on
    the parameters' device (an 8B block's 190M values would take seconds on the host)."""
    gens: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            g = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
            p.copy_(torch.randn(p.shape, generator=g, device=p.device) * 0.02)


def _ungroup(module: nn.Module) -> None:
    for m in module.modules():
        if hasattr(m, "shared_input"):
            m.shared_input = False


def _fp8(module: nn.Module, variant: str, skip: tuple[str, ...] = ()) -> None:
    from atelier_studio.pipeline.float8 import apply_fp8
    from atelier_studio.pipeline.lora_fp8 import FP8_CONVERSIONS

    if variant.startswith("fp8-"):
        apply_fp8(module, variant.split("-")[1], skip, conversions=FP8_CONVERSIONS)
        if variant.endswith("-ungrouped"):
            _ungroup(module)


def qwen3_block(variant: str, size: str, rows: int, tokens: int, device: torch.device
                ) -> tuple[Callable[[], None], list[torch.Tensor]]:
    """(run: one forward + backward of the block, its trained parameters)."""
    from atelier_studio.designer.decoder import PackedAttention
    from atelier_studio.designer.lora import LoraArgs, LoRALinear
    from atelier_studio.designer.qwen3 import Block, Qwen3Args
    from atelier_studio.kernels.rope import rope_cos_sin

    args = Qwen3Args.from_size(size, vocab_size=256)
    with torch.device(device):  # made where it runs: no host-side init of an 8B block's weights
        block = Block(args).to(torch.bfloat16)
    _init_(block, 0)
    if "-lora" in variant:
        block.requires_grad_(False)
        lora_args = LoraArgs(rank=16, alpha=32.0)
        for parent in (block.self_attn, block.mlp):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    layer = LoRALinear(child, lora_args, "auto")
                    nn.init.normal_(layer.lora_B.weight, std=0.02)  # a trained adapter, not the zero init
                    setattr(parent, name, layer)
    _fp8(block, variant)
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(rows, tokens, args.dim, generator=g, device=device).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(rows, tokens, args.dim, generator=g, device=device).to(torch.bfloat16)
    pos = torch.arange(tokens, device=device).repeat(rows, 1)
    cos, sin = rope_cos_sin(pos, args.head_dim, args.rope_theta, args.rope_scaling)
    cu = torch.arange(0, (rows + 1) * tokens, tokens, device=device, dtype=torch.int32)
    attend = PackedAttention(cu, tokens, args.attention_impl)
    params = [p for p in block.parameters() if p.requires_grad]

    def run() -> None:
        x.grad = None
        for p in params:
            p.grad = None
        block(x, cos, sin, attend).backward(dy)

    return run, params


def sd3_block(variant: str, overrides: dict[str, Any], batch: int, image: int, text: int, device: torch.device
              ) -> tuple[Callable[[], None], list[torch.Tensor]]:
    from atelier_studio.imagegen.model import JointBlock, MMDiTArgs

    args = dataclasses.replace(MMDiTArgs(), **overrides)
    with torch.device(device):
        block = JointBlock(args, context_pre_only=False, dual_attention=False).to(torch.bfloat16)
    _init_(block, 2)
    _fp8(block, variant, MMDIT_FP8_SKIP)
    g = torch.Generator(device=device).manual_seed(3)

    def rand(*shape: int, grad: bool = False) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device).to(torch.bfloat16).requires_grad_(grad)

    x, ctx, c = rand(batch, image, args.dim, grad=True), rand(batch, text, args.dim, grad=True), rand(batch, args.dim)
    dx, dctx = rand(batch, image, args.dim), rand(batch, text, args.dim)
    params = [p for p in block.parameters() if p.requires_grad]

    def run() -> None:
        x.grad = ctx.grad = None
        for p in params:
            p.grad = None
        ctx_out, x_out = block(x, ctx, c)
        torch.autograd.backward([ctx_out, x_out], [dctx, dx])

    return run, params


def time_block(run: Callable[[], None], device: torch.device, repeats: int, warmup: int) -> dict[str, Any]:
    cuda = device.type == "cuda"
    for _ in range(warmup):
        run()
    sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    ms, host = [], []
    for _ in range(repeats):
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
        t0 = time.perf_counter()
        run()
        host.append((time.perf_counter() - t0) * 1e3)
        if cuda:
            e.record()
            e.synchronize()
            ms.append(s.elapsed_time(e))
        else:
            ms.append(host[-1])
    out = {"ms": median(ms), "ms_min": min(ms), "host_ms": median(host)}
    if cuda:
        out["peak_gib"] = (torch.cuda.max_memory_allocated(device) - base) / 2**30
    return out


def bench_blocks(device: torch.device, tiny: bool, repeats: int, warmup: int, deadline: float) -> dict[str, Any]:
    """{"qwen3-8b": {variant: result}, "sd3-medium": {...}}; a variant past the deadline or failing is recorded
    as skipped with the reason."""
    size, rows, tokens = QWEN_SHAPES["tiny" if tiny else "real"]
    overrides, batch, image, text = SD3_SHAPES["tiny" if tiny else "real"]
    plans = {"qwen3-8b": [(v, lambda v=v: qwen3_block(v, size, rows, tokens, device)) for v in QWEN_VARIANTS],
             "sd3-medium": [(v, lambda v=v: sd3_block(v, overrides, batch, image, text, device)) for v in SD3_VARIANTS]}
    out: dict[str, Any] = {"shapes": {"qwen3-8b": {"size": size, "rows": rows, "tokens": tokens},
                                      "sd3-medium": {"batch": batch, "image": image, "text": text}}}
    for model, plan in plans.items():
        res: dict[str, Any] = {}
        for variant, make in plan:
            if time.monotonic() > deadline:
                res[variant] = {"skipped": "time budget (--budget-s) spent"}
                continue
            try:
                run, params = make()
                r = time_block(run, device, repeats, warmup)
                r["profile"] = profile(run, device, iters=1)
            except Exception as e:  # a variant that cannot run here is a result, recorded with its reason
                msg = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
                res[variant] = {"skipped": f"failed: {type(e).__name__}: {msg}"}
                continue
            finally:
                run = params = None  # noqa: F841  (drop both references before emptying the cache)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            res[variant] = r
            print(f"block {model} {variant}: {r['ms']:.2f} ms (host {r['host_ms']:.2f} ms)", flush=True)
        base = {v: res.get(v, {}).get("ms") for v in ("bf16-full", "bf16-lora", "bf16")}
        for v, r in res.items():
            ref = base["bf16-lora"] if "-lora" in v else (base["bf16-full"] or base["bf16"])
            if "ms" in r and ref:
                r["speedup_vs_bf16"] = ref / r["ms"]
        out[model] = res
    return out
