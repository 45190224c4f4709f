"""The Gated DeltaNet short conv (kernels/causal_conv1d.py) at Qwen3.5-9B's shapes: forward and backward time,
the backward with a frozen weight (dx only: what a LoRA run calls), and the trained-weight backward's first pass
by sweep (programs per SM; dw reduced per token block or once at the end).

    python3 -m atelier_studio.bench.causal_conv1d [--programs 4,8,16,32,64] [--repeats 20] [--out DIR] [--tiny]

Shape: one packed micro-batch of 8 rows of 2048 tokens (N 16,384, documents of 20–599 tokens, the last one
filling the row set), C 8,192 channels (2 · 16 · 128 key + 32 · 128 value), K 4 taps, bf16 — what the 9B
profile (bench/results/designer-qwen3.5-9b-lora-2026-12-03-profile.txt) timed at 2.31 ms per backward call
before the backward became two passes. Each backward is checked against causal_conv1d_ref's fp32 gradients
(max error over max magnitude: dx carries bf16 rounding, dw is accumulated in fp32). Timing: CUDA events,
the mean of `repeats` calls after one warm-up. --tiny: a small fp32 shape on the CPU (Triton's interpreter),
for the tests; there the program count is fixed (kernels.causal_conv1d._bwd_programs), so only exactness varies.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

import atelier_studio.kernels.causal_conv1d as cc
from atelier_studio.bench.env import environment
from atelier_studio.bench.harness import parse_ints
from atelier_studio.pipeline.atomic import atomic_write_text

SHAPE = dict(tokens=16384, channels=8192, taps=4, min_doc=20, max_doc=600)
TINY = dict(tokens=40, channels=12, taps=4, min_doc=1, max_doc=9)


def packed_inputs(shape: dict[str, int], device: torch.device, dtype: torch.dtype, seed: int = 0):
    """x, w, dy and cu_seqlens of one packed micro-batch: documents of min_doc..max_doc−1 tokens, the last one
    filling the remaining tokens."""
    g = torch.Generator().manual_seed(seed)
    n, c, k = shape["tokens"], shape["channels"], shape["taps"]
    lens = torch.randint(shape["min_doc"], shape["max_doc"], (n,), generator=g)
    lens = lens[lens.cumsum(0) < n]
    lens = torch.cat([lens, torch.tensor([n - int(lens.sum())])])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(torch.int32)
    x = torch.randn(n, c, generator=g).to(device, dtype)
    w = (torch.randn(c, k, generator=g) * 0.5).to(device, dtype)
    dy = torch.randn(n, c, generator=g).to(device, dtype)
    return x, w, dy, cu.to(device)


def mean_ms(fn: Callable[[], Any], repeats: int, cuda: bool) -> float:
    fn()
    if not cuda:
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - t0) / repeats * 1e3
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def bench(shape: dict[str, int], programs: list[int], repeats: int, device: torch.device) -> dict[str, Any]:
    cuda = device.type == "cuda"
    x, w, dy, cu = packed_inputs(shape, device, torch.bfloat16 if cuda else torch.float32)
    xr, wr = x.float().requires_grad_(), w.float().requires_grad_()
    cc.causal_conv1d_ref(xr, wr, cu).backward(dy.float())
    starts = cc.doc_starts(cu, x.shape[0])
    report: dict[str, Any] = {"shape": shape, "documents": cu.numel() - 1, "dtype": str(x.dtype),
                              "forward_ms": mean_ms(lambda: cc.conv_fwd(x, w, starts), repeats, cuda),
                              "backward": {}}
    # A LoRA run freezes the conv weight: the backward computes dx only (one token block per program).
    dx, _ = cc.conv_bwd(dy, x, w, starts, False)
    report["backward_frozen_weight"] = {"ms": mean_ms(lambda: cc.conv_bwd(dy, x, w, starts, False), repeats, cuda),
                                        "dx_err": float((dx.float() - xr.grad).abs().max() / xr.grad.abs().max())}
    default = cc._BWD_PROGRAMS_PER_SM, cc._BWD_DEFER_DW
    try:
        for defer in (False, True):
            for p in programs:
                cc._BWD_PROGRAMS_PER_SM, cc._BWD_DEFER_DW = p, defer
                dx, dw = cc.conv_bwd(dy, x, w, starts, True)
                report["backward"][f"{p}{' deferred dw' if defer else ''}"] = {
                    "programs_per_sm": p, "defer_dw": defer,
                    "ms": mean_ms(lambda: cc.conv_bwd(dy, x, w, starts, True), repeats, cuda),
                    "dx_err": float((dx.float() - xr.grad).abs().max() / xr.grad.abs().max()),
                    "dw_err": float((dw - wr.grad).abs().max() / wr.grad.abs().max())}
    finally:
        cc._BWD_PROGRAMS_PER_SM, cc._BWD_DEFER_DW = default
    report["default"] = {"programs_per_sm": default[0], "defer_dw": default[1]}
    return report


def lines(report: dict[str, Any]) -> list[str]:
    out = [f"fwd {report['forward_ms']:.3f} ms"]
    f = report["backward_frozen_weight"]
    out.append(f"bwd frozen weight (dx only, LoRA): {f['ms']:.3f} ms  dx rel {f['dx_err']:.1e}")
    for p, r in report["backward"].items():
        out.append(f"bwd programs/SM {p}: {r['ms']:.3f} ms  dx rel {r['dx_err']:.1e} dw rel {r['dw_err']:.1e}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--programs", type=parse_ints, default=[4, 8, 16, 32, 64],
                   help="backward first-pass programs per SM to sweep (comma-separated)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default="bench/results")
    p.add_argument("--tiny", action="store_true", help="a small fp32 shape on the CPU (Triton's interpreter)")
    a = p.parse_args(argv)
    if a.repeats < 1:
        p.error(f"--repeats must be >= 1, got {a.repeats}")
    if not a.tiny and not torch.cuda.is_available():
        p.error("the 9B shape needs a CUDA GPU; use --tiny on a CPU")
    device = torch.device("cpu") if a.tiny else torch.device("cuda")
    report = bench(TINY if a.tiny else SHAPE, a.programs, a.repeats, device)
    report.update(environment())
    path = Path(a.out) / f"causal-conv1d-{time.strftime('%Y-%m-%d')}.json"
    atomic_write_text(path, json.dumps(report, indent=1), what="benchmark report")
    print("\n".join(lines(report)))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
