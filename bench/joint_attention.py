"""Imagegen's joint attention (non-causal, head dim 64) on one GPU: which kernel, by measurement (issue 8, item 2).

    python3 -m bench.joint_attention --out DIR [--shapes sd3-1024,sd3-512] [--repeats 10] [--tiny]

Shapes: B images, H heads, T = image + text tokens (one joint sequence per image, every token sees every
other), Dh head dim. SD3-medium: H 24, Dh 64, 333 text tokens.
  sd3-1024: B 8,  T 4096 + 333 = 4429   (the 1024 px training batch of bench/imagegen.py)
  sd3-512:  B 32, T 1024 + 333 = 1357
Every image of a micro-batch has the same bucket (data/buckets.py), so rows need no mask and no varlen.

Paths (each skipped, with the reason, where this machine lacks it):
  sdpa_cudnn, sdpa_flash, sdpa_efficient, sdpa_math   SDPA pinned to one backend (imagegen's
                                                     `[model] attention`, MMDiTArgs.attention);
  flex                                               FlexAttention (compiled), no block mask.
Exactness on the first image of the batch: output and dq/dk/dv against fp32 attention (the ground truth) as
the max abs error; "exact" when at most 2× the error of eager attention in the same dtype (bf16 matmuls, fp32
softmax) + 1e-5, FlashAttention's rule, as bench/attention.py. Timing: forward + backward, CUDA events,
median of `repeats` after 3 warm-up calls (compile in the warm-up). FLOPs: 4·B·T²·H·Dh forward (QKᵀ and PV),
×3.5 for forward + backward.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from bench.attention import grads, timed
from bench.env import clocks, environment

SHAPES = {"sd3-1024": dict(batch=8, tokens=4096 + 333, heads=24, head_dim=64),
          "sd3-512": dict(batch=32, tokens=1024 + 333, heads=24, head_dim=64)}
TINY = {"sd3-1024": dict(batch=2, tokens=48, heads=2, head_dim=16),
        "sd3-512": dict(batch=3, tokens=20, heads=2, head_dim=16)}
SDPA = ("cudnn", "flash", "efficient", "math")
PATHS = (*(f"sdpa_{b}" for b in SDPA), "flex")


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
    result: dict[str, Any] = {"shape": shape, "flops": flops, "eager_max_abs_err": base, "paths": {}}
    for p in paths:
        try:
            fn = path_fn(p, compile_flex)
            got = grads(fn, *first)
            errs = {w: (x.float() - t).abs().max().item() for w, x, t in zip(("o", "dq", "dk", "dv"), got, truth)}
            ts = timed(fn, q, k, v, do, repeats)
        except (RuntimeError, ImportError, torch.OutOfMemoryError) as e:
            result["paths"][p] = {"skipped": str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__}
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        med = statistics.median(ts)
        result["paths"][p] = {"ms": med * 1e3, "ms_min": min(ts) * 1e3, "tflops": flops / med / 1e12,
                              "max_abs_err": errs, "exact": all(errs[w] <= 2 * base[w] + 1e-5 for w in base)}
        print(f"{name} {p}: {med * 1e3:.2f} ms, {flops / med / 1e12:.0f} TFLOP/s, err {errs}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    ok = {p: r for p, r in result["paths"].items() if r.get("exact")}
    result["fastest_exact"] = min(ok, key=lambda p: ok[p]["ms"]) if ok else None
    return result


def markdown(report: dict[str, Any]) -> str:
    lines = [f"## joint attention (non-causal), forward + backward — {report['gpu'].get('name') or 'cpu'}, "
             f"{report['dtype']}", "", "| shape | path | ms | TFLOP/s | max abs err (o, dq, dk, dv) | exact |",
             "|---|---|---|---|---|---|"]
    for name, r in report["shapes"].items():
        for p, x in r["paths"].items():
            if "skipped" in x:
                lines.append(f"| {name} | {p} | skipped: {x['skipped'][:80]} | | | |")
                continue
            e = x["max_abs_err"]
            lines.append(f"| {name} | {p} | {x['ms']:.2f} | {x['tflops']:.0f} | "
                         f"{e['o']:.1e}, {e['dq']:.1e}, {e['dk']:.1e}, {e['dv']:.1e} | {x['exact']} |")
        lines.append(f"| {name} | **fastest exact** | {r['fastest_exact']} | | | |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m bench.joint_attention", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU in fp32, flex uncompiled (tests)")
    a = p.parse_args(argv)
    shapes = [x for x in a.shapes.split(",") if x]
    paths = [x for x in a.paths.split(",") if x]
    bad = [x for x in shapes if x not in SHAPES] + [x for x in paths if x not in PATHS]
    if bad:
        p.error(f"unknown shapes/paths {bad}; shapes {list(SHAPES)}, paths {list(PATHS)}")
    device = torch.device("cpu") if a.tiny or not torch.cuda.is_available() else torch.device("cuda")
    if device.type != "cuda" and not a.tiny:
        p.error("real shapes need a CUDA GPU; use --tiny on a CPU")
    dtype = torch.float32 if a.tiny else torch.bfloat16
    table = TINY if a.tiny else SHAPES
    report: dict[str, Any] = {**environment(), "dtype": str(dtype).removeprefix("torch."),
                              "clocks": {"before": clocks()}, "shapes": {}}
    for name in shapes:
        report["shapes"][name] = bench_shape(name, table[name], device, dtype, paths, a.repeats, not a.tiny)
    report["clocks"]["after"] = clocks()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"joint-attention-{time.strftime('%Y-%m-%d')}"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    (out / f"{stem}.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
