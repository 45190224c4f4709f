"""One MoE layer's experts on NF4 weights against the same experts in bf16, on one GPU: what QLoRA on the experts
costs in time and transient memory (kernels/nf4_moe.py).

    python3 -m atelier_studio.bench.nf4_moe [--micro-batches 1,2,4] [--repeats 20] [--out bench/results] [--tiny]

Shapes: Qwen3-30B-A3B's sparse layer (E = 128 experts, D = 2048, F = 768, top-8) with per-expert LoRA r16 on gate,
up and down in bf16, and S = micro-batch · 2048 · 8 routed slots spread over the experts at random (sorted by
expert, as kernels/moe.py's dispatch leaves them). Per S, kernels/moe.py's experts_ffn forward + backward (dx and
every adapter's gradient) over:
  bf16    the stacks as bf16 tensors (Ŵ itself: the same values), torch._grouped_mm;
  nf4     the NF4 stacks: each projection dequantised into a transient buffer, grouped GEMM, re-dequantised in the
          backward;
and the dequantiser alone (both stacks once). Timed with CUDA events: median ms of `repeats` calls after 3 warm-ups
(bench/nf4_linear.py's time_ms); peak memory of one step above what was allocated before it. The output of both
must agree (the same grouped GEMMs on the same values): the largest relative difference is reported.
--tiny: a small layer on the CPU through Triton's interpreter, fp32 (the same code, for tests).
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from atelier_studio.bench.harness import kernel_bench_args, kernel_bench_parser, parse_ints, run_layer_bench
from atelier_studio.bench.nf4_linear import time_ms
from atelier_studio.kernels.moe import ExpertLoRA, experts_ffn
from atelier_studio.kernels.nf4_moe import quantize_experts

LAYER = dict(experts=128, dim=2048, ffn=768, top_k=8, rank=16, seq=2048)  # Qwen3-30B-A3B, LoRA r16, rows of 2048
TINY_LAYER = dict(experts=4, dim=64, ffn=32, top_k=2, rank=4, seq=8)


def bench_layer(layer: dict[str, int], micro_batches: list[int], repeats: int, device: torch.device,
                dtype: torch.dtype) -> dict[str, Any]:
    """{micro-batch: {bf16, nf4: {ms, peak_mb}, dequantise_ms, nf4_over_bf16, max_rel_diff}} for one layer."""
    e, d, f, r = layer["experts"], layer["dim"], layer["ffn"], layer["rank"]
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s, scale: (torch.randn(*s, generator=g) * scale).to(device, dtype)  # noqa: E731
    kernels = "triton" if device.type == "cpu" else "auto"  # the Triton dequantiser on both
    nf4 = (quantize_experts(rnd(e, 2 * f, d, scale=d ** -0.5), kernels),
           quantize_experts(rnd(e, d, f, scale=f ** -0.5), kernels))
    plain = tuple(w.dequantize() for w in nf4)
    adapters = [rnd(e, r, d, scale=d ** -0.5), rnd(e, f, r, scale=0.02), rnd(e, r, d, scale=d ** -0.5),
                rnd(e, f, r, scale=0.02), rnd(e, r, f, scale=f ** -0.5), rnd(e, d, r, scale=0.02)]
    adapters = [t.requires_grad_() for t in adapters]
    lora = ExpertLoRA(2.0, (adapters[0], adapters[1]), (adapters[2], adapters[3]), (adapters[4], adapters[5]))
    cuda = device.type == "cuda"
    out: dict[str, Any] = {}
    for mb in micro_batches:
        slots = mb * layer["seq"] * layer["top_k"]
        chosen = torch.randint(0, e, (slots,), generator=g).sort().values
        offs = torch.cumsum(torch.bincount(chosen, minlength=e), 0).to(device, torch.int32)
        xs = rnd(slots, d, scale=1.0).requires_grad_()
        dy = rnd(slots, d, scale=1.0)

        def step(gate_up, down) -> torch.Tensor:
            ys = experts_ffn(xs, gate_up, down, offs, lora, "auto")
            torch.autograd.grad(ys, [xs, *adapters], dy)
            return ys.detach()

        row: dict[str, Any] = {"slots": slots}
        for name, (gate_up, down) in (("bf16", plain), ("nf4", nf4)):
            ms = time_ms(lambda: step(gate_up, down), repeats, cuda)
            peak = None
            if cuda:
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                step(gate_up, down)
                peak = (torch.cuda.max_memory_allocated() - before) / 2 ** 20
            row[name] = {"ms": ms, "peak_mb": peak}
        row["dequantise_ms"] = time_ms(lambda: [w.dequantize() for w in nf4], repeats, cuda)
        row["nf4_over_bf16"] = row["nf4"]["ms"] / row["bf16"]["ms"]
        want, got = step(*plain).float(), step(*nf4).float()
        row["max_rel_diff"] = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
        out[str(mb)] = row
    stack_mb = sum(w.numel() * w.element_size() for w in plain) / 2 ** 20
    nf4_mb = sum(t.numel() * t.element_size() for w in nf4
                 for t in (w.data, w.scalers, w.factor, w.mean, w.code)) / 2 ** 20
    return {"by_micro_batch": out, "bf16_stacks_mb": stack_mb, "nf4_stacks_mb": nf4_mb}


def markdown(report: dict[str, Any]) -> str:
    lay, res = report["layer"], report["result"]
    lines = [f"## NF4 experts — {report['gpu'].get('name', 'CPU')}: one MoE layer (E {lay['experts']}, "
             f"D {lay['dim']}, F {lay['ffn']}, top-{lay['top_k']}, LoRA r{lay['rank']}), forward + backward", "",
             f"stacks: {res['bf16_stacks_mb']:.0f} MB in bf16, {res['nf4_stacks_mb']:.0f} MB in NF4", "",
             "| micro-batch | slots | bf16 ms | NF4 ms | NF4 / bf16 | dequantise ms | bf16 peak MB | NF4 peak MB | "
             "max rel diff |", "|---|---|---|---|---|---|---|---|---|"]
    for mb, r in res["by_micro_batch"].items():
        peak = lambda x: "—" if x is None else f"{x:.0f}"  # noqa: E731
        lines.append(f"| {mb} | {r['slots']} | {r['bf16']['ms']:.2f} | {r['nf4']['ms']:.2f} | "
                     f"{r['nf4_over_bf16']:.2f}× | {r['dequantise_ms']:.2f} | {peak(r['bf16']['peak_mb'])} | "
                     f"{peak(r['nf4']['peak_mb'])} | "
                     f"{r['max_rel_diff']:.1e} |")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    """The bench's command line (bench/session.py's plan is checked against it)."""
    p = kernel_bench_parser("python3 -m atelier_studio.bench.nf4_moe", __doc__.split("\n")[0],
                            "a small layer on the CPU (tests)")
    p.add_argument("--micro-batches", type=parse_ints, default=None, help="rows of 2048 tokens (default 1,2,4)")
    return p


def main(argv: list[str] | None = None) -> int:
    a, device, dtype = kernel_bench_args(parser(), argv)
    return run_layer_bench(a, device, dtype, TINY_LAYER if a.tiny else LAYER, bench_layer, "nf4-moe", markdown,
                           lambda res: [f"micro-batch {mb}: bf16 {r['bf16']['ms']:.2f} ms, nf4 {r['nf4']['ms']:.2f} ms "
                                        f"({r['nf4_over_bf16']:.2f}×), dequantise {r['dequantise_ms']:.2f} ms"
                                        for mb, r in res["by_micro_batch"].items()])


if __name__ == "__main__":
    sys.exit(main())
