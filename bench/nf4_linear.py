"""NF4 matmuls on one GPU: where the fused dequantising kernels stop paying and the transient-Ŵ path takes over.

    python3 -m atelier_studio.bench.nf4_linear [--rows 16,64,128,256,512,1024,2048,4096,8192] [--repeats 20]
                                [--out bench/results] [--tiny]

For each Qwen3-8B projection shape (K in → N out: q/o 4096→4096, k/v 4096→1024, gate/up 4096→12288, down
12288→4096) and each row count M, the two products a QLoRA linear runs, y = x Ŵᵀ (forward) and dX = dY Ŵ
(backward), through each path of kernels/nf4_linear.py:
  fused   the Triton kernels that dequantise each W tile inside the matmul (autotuned on first use, untimed);
  dense   Ŵ written once into a transient bf16 buffer by _nf4_dequant_kernel, then cuBLAS (the buffer's write is
          timed with it);
  bf16    F.linear / matmul with the bf16 weight itself: the ceiling the NF4 paths are measured against.
Timed with CUDA events: median ms of `repeats` calls after 3 warm-ups; TFLOP/s = 2·M·K·N / time. The report gives,
per shape and direction, the smallest M from which dense is faster than fused: what DENSE_MIN_M is set from.
--tiny: small shapes on the CPU through Triton's interpreter (the same code, for tests).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from atelier_studio.bench.env import clocks, environment
from atelier_studio.bench.harness import kernel_bench_args, kernel_bench_parser, parse_ints, write_report
from atelier_studio.kernels.nf4 import dequantize_nf4, quantize_nf4
from atelier_studio.kernels.nf4_linear import DENSE_MIN_M, nf4_matmul, nf4_matmul_t

SHAPES = {"q-o": (4096, 4096), "k-v": (4096, 1024), "gate-up": (4096, 12288), "down": (12288, 4096)}
TINY_SHAPES = {"q-o": (128, 64), "down": (192, 64)}
PATHS = ("fused", "dense", "bf16")


def time_ms(fn: Callable[[], Any], repeats: int, cuda: bool) -> float:
    """Median milliseconds of fn() after 3 untimed calls (the first autotunes and compiles)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench_shape(k: int, n: int, rows: list[int], repeats: int, device: torch.device,
                dtype: torch.dtype) -> dict[str, Any]:
    """{direction: {M: {path: {ms, tflops}}}} for one projection shape, plus the largest error of each NF4 path
    against the bf16 product over the dequantised weight."""
    g = torch.Generator().manual_seed(k + n)
    w = quantize_nf4((torch.randn(n, k, generator=g) * k ** -0.5).to(device, dtype))
    parts = (w.data, w.scalers, w.factor, w.mean, w.code)
    w_hat = dequantize_nf4(w)
    out: dict[str, Any] = {"forward": {}, "backward": {}}
    for m in rows:
        x = torch.randn(m, k, generator=g).to(device, dtype)
        dy = torch.randn(m, n, generator=g).to(device, dtype)
        runs = {"forward": {"fused": lambda: nf4_matmul(x, *parts, None, dtype, path="fused"),
                            "dense": lambda: nf4_matmul(x, *parts, None, dtype, path="dense"),
                            "bf16": lambda: F.linear(x, w_hat)},
                "backward": {"fused": lambda: nf4_matmul_t(dy, *parts, dtype, path="fused"),
                             "dense": lambda: nf4_matmul_t(dy, *parts, dtype, path="dense"),
                             "bf16": lambda: dy @ w_hat}}
        for direction, fns in runs.items():
            ref = fns["bf16"]().float()
            row = {}
            for path, fn in fns.items():
                ms = time_ms(fn, repeats, device.type == "cuda")
                err = (fn().float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
                row[path] = {"ms": ms, "tflops": 2 * m * k * n / ms / 1e9, "max_rel_err_vs_bf16": err}
            out[direction][str(m)] = row
    for direction in ("forward", "backward"):
        faster = [int(m) for m, r in out[direction].items() if r["dense"]["ms"] < r["fused"]["ms"]]
        out[f"{direction}_dense_faster_from_m"] = min(faster) if faster else None
    return out


def markdown(report: dict[str, Any]) -> str:
    lines = [f"## NF4 matmuls — {report['gpu'].get('name', 'CPU')}: fused dequantising kernels vs transient Ŵ + "
             f"cuBLAS vs the bf16 weight (TFLOP/s)", "",
             f"DENSE_MIN_M in the code: {report['dense_min_m']}", ""]
    for name, shape in report["shapes"].items():
        k, n = shape["k"], shape["n"]
        for direction in ("forward", "backward"):
            lines += [f"### {name} ({k}→{n}), {direction}; dense faster from M = "
                      f"{shape[f'{direction}_dense_faster_from_m']}", "",
                      "| M | fused | dense | bf16 | dense / fused |", "|---|---|---|---|---|"]
            for m, r in shape[direction].items():
                lines.append(f"| {m} | {r['fused']['tflops']:.0f} | {r['dense']['tflops']:.0f} | "
                             f"{r['bf16']['tflops']:.0f} | {r['fused']['ms'] / r['dense']['ms']:.2f}× |")
            lines.append("")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """The bench's command line (bench/session.py's plan is checked against it)."""
    p = kernel_bench_parser("python3 -m atelier_studio.bench.nf4_linear", __doc__.split("\n")[0],
                            "small shapes on the CPU (tests)")
    p.add_argument("--rows", type=parse_ints, default=None, help="row counts M (default 16 … 8192)")
    return p


def main(argv: list[str] | None = None) -> int:
    a, device, dtype = kernel_bench_args(parser(), argv)
    shapes = TINY_SHAPES if a.tiny else SHAPES
    rows = a.rows or ([3, 40] if a.tiny else [16, 64, 128, 256, 512, 1024, 2048, 4096, 8192])
    report: dict[str, Any] = {**environment(), "clocks": {"before": clocks()}, "dense_min_m": DENSE_MIN_M,
                              "rows": rows, "repeats": a.repeats, "dtype": str(dtype), "shapes": {}}
    for name, (k, n) in shapes.items():
        report["shapes"][name] = {"k": k, "n": n, **bench_shape(k, n, rows, a.repeats, device, dtype)}
        print(f"{name}: dense faster from M = {report['shapes'][name]['forward_dense_faster_from_m']} (forward), "
              f"{report['shapes'][name]['backward_dense_faster_from_m']} (backward)", flush=True)
    report["clocks"]["after"] = clocks()
    path = write_report(report, Path(a.out), "nf4-linear", markdown(report), lambda _: None)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
