"""Imagegen's joint attention (non-causal, head dim 64) on one GPU: which kernel, by measurement.

    python3 -m atelier_studio.bench.joint_attention --out DIR [--shapes sd3-1024,sd3-512] [--paths ...]
        [--repeats 10] [--tiny]

Shapes: B images, H heads, T = image + text tokens (one joint sequence per image, every token sees every
other), Dh head dim. SD3-medium: H 24, Dh 64, 333 text tokens.
  sd3-1024: B 8,  T 4096 + 333 = 4429   (the 1024 px training batch of bench/imagegen.py)
  sd3-512:  B 32, T 1024 + 333 = 1357
Every image of a micro-batch has the same bucket (data/buckets.py), so rows need no mask and no varlen.

Paths (each skipped, with the reason, where this machine lacks it):
  sdpa_cudnn, sdpa_flash, sdpa_efficient, sdpa_math   SDPA pinned to one backend (imagegen's
                                                     `[model] attention`, MMDiTArgs.attention);
  flex                                               FlexAttention (compiled), no block mask;
  fa4                                                FlashAttention-4 (`flash-attn-4`, CuTe DSL: flash_attn.cute
                                                     flash_attn_func; its Hopper forward and backward), on the
                                                     same q, k, v seen as [B, T, H, Dh] (a transpose, no copy).
Exactness on the first image of the batch: output and dq/dk/dv against fp32 attention (the ground truth) as
the max abs error; "exact" when at most 2× the error of eager attention in the same dtype (bf16 matmuls, fp32
softmax) + 1e-5, FlashAttention's rule, as bench/attention.py. Timing: forward + backward, CUDA events,
median of `repeats` after 3 warm-up calls (compile in the warm-up). FLOPs: 4·B·T²·H·Dh forward (QKᵀ and PV),
×3.5 for forward + backward.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F

from atelier_studio.bench.attention import cli, grads, judge_paths

SHAPES = {"sd3-1024": dict(batch=8, tokens=4096 + 333, heads=24, head_dim=64),
          "sd3-512": dict(batch=32, tokens=1024 + 333, heads=24, head_dim=64)}
TINY = {"sd3-1024": dict(batch=2, tokens=48, heads=2, head_dim=16),
        "sd3-512": dict(batch=3, tokens=20, heads=2, head_dim=16)}
SDPA = ("cudnn", "flash", "efficient", "math")
PATHS = (*(f"sdpa_{b}" for b in SDPA), "flex", "fa4")


def path_fn(name: str, compile_flex: bool) -> Callable:
    """q, k, v [B, H, T, Dh] → o [B, H, T, Dh] through one kernel."""
    if name.startswith("sdpa_"):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                   "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name.removeprefix("sdpa_")]

        def sdpa(q, k, v):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v)

        return sdpa
    if name == "flex":
        from torch.nn.attention.flex_attention import flex_attention

        return torch.compile(flex_attention, dynamic=False) if compile_flex else flex_attention
    if name == "fa4":
        from flash_attn.cute import flash_attn_func  # ImportError → recorded as skipped, with the reason

        def fa4(q, k, v):
            o = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # [B, T, H, Dh]
            return (o[0] if isinstance(o, tuple) else o).transpose(1, 2)  # (out, lse) in some versions

        return fa4
    raise ValueError(f"unknown path {name!r}; known: {PATHS}")


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The exactness baseline: matmuls in q's dtype, softmax in fp32 rounded back (transformers' eager)."""
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


def attention_flops(shape: dict) -> float:
    return 3.5 * 4 * shape["batch"] * shape["tokens"] ** 2 * shape["heads"] * shape["head_dim"]


def bench_shape(name: str, shape: dict, device: torch.device, dtype: torch.dtype, paths: list[str], repeats: int,
                compile_flex: bool) -> dict[str, Any]:
    g = torch.Generator(device=device).manual_seed(0)
    dims = (shape["batch"], shape["heads"], shape["tokens"], shape["head_dim"])
    q, k, v, do = (torch.randn(dims, generator=g, device=device, dtype=dtype) for _ in range(4))
    first = [x[:1] for x in (q, k, v, do)]
    truth = grads(lambda a, b, c: eager_attention(a.float(), b.float(), c.float()), *first[:3], first[3].float())
    eager = grads(eager_attention, *first)
    base = {w: (e.float() - t).abs().max().item() for w, e, t in zip(("o", "dq", "dk", "dv"), eager, truth)}
    flops = attention_flops(shape)
    result: dict[str, Any] = {"shape": shape, "flops": flops, "eager_max_abs_err": base}
    result.update(judge_paths(name, paths, lambda p: path_fn(p, compile_flex), tuple(first), (q, k, v, do),
                              truth, base, flops, repeats))
    return result


def main(argv: list[str] | None = None) -> int:
    """Flex runs uncompiled with --tiny (CPU tests)."""
    return cli(argv, "python3 -m atelier_studio.bench.joint_attention", __doc__, SHAPES, TINY, PATHS, "joint-attention",
               "joint attention (non-causal)",
               lambda name, shape, device, dtype, paths, repeats, tiny: bench_shape(name, shape, device, dtype,
                                                                                    paths, repeats, not tiny))


if __name__ == "__main__":
    sys.exit(main())
