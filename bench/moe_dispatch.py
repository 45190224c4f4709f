"""The MoE block's token movement on one GPU: kernels/moe.py's dispatch and combine, forward and backward, against
plain PyTorch doing the same, and every launch candidate of the gather's autotuner.

    python3 -m atelier_studio.bench.moe_dispatch [--micro-batches 1,2,4] [--repeats 50] [--out bench/results] [--tiny]

Shapes: Qwen3-30B-A3B's sparse layer (D = 2048, top-8, 128 experts) on micro-batch · 2048 tokens, routed at random
(kernels/moe.py's dispatch_plan of random top-k choices). The four moves of one layer's step, each with its bytes:
  dispatch      xs[pos[n, j]] = x[n]                       scatter   reads N·D, writes S·D
  dispatch dx   dx[n] = Σ_j dxs[pos[n, j]]                 gather    reads S·D, writes N·D
  combine       out[n] = Σ_j w[n, j] · ys[pos[n, j]]       gather    reads S·D, writes N·D
  combine bwd   dys[pos[n, j]] = w[n, j] · dout[n], dw     scatter   reads N·D + S·D (ys for dw), writes S·D
(S = N·k, in bf16), each called as training calls it (kernels/custom_op.py's call_op). Each is timed with CUDA
events (median of `repeats` after 3 warm-ups, the first of which autotunes) beside its plain-PyTorch twin
(index_copy, an indexed gather with a float32 sum, a batched matmul, an indexed product), and reported as ms and GB/s
of the bytes above; the report gives the card's copy rate measured in the same run (a device-to-device copy of S·D
elements) as the ceiling. The autotuner's own timing of each gather candidate (BLOCK, CHUNKS, warps) comes from its
first call. Every Triton result must equal its twin up to bf16
rounding of the same fp32 sums: the largest difference is reported.
--tiny: a small layer on the CPU through Triton's interpreter, fp32 (the same code, for tests).
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

import torch

from atelier_studio.bench.harness import kernel_bench_args, kernel_bench_parser, parse_ints, run_layer_bench
from atelier_studio.bench.nf4_linear import time_ms
from atelier_studio.kernels.custom_op import call_op
from atelier_studio.kernels.moe import _gather_sum_kernel, dispatch_plan, moe_gather_sum, moe_scatter

LAYER = dict(experts=128, dim=2048, top_k=8, seq=2048)  # Qwen3-30B-A3B's sparse layer, rows of 2048
TINY_LAYER = dict(experts=4, dim=96, top_k=3, seq=8)
MOVES = ("dispatch", "dispatch_dx", "combine", "combine_bwd")


def _inputs(layer: dict[str, int], mb: int, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(mb)
    n, d, k, e = mb * layer["seq"], layer["dim"], layer["top_k"], layer["experts"]
    chosen = torch.rand(n, e, generator=g).topk(k, dim=-1).indices.to(device)  # k distinct experts per token
    pos, _ = dispatch_plan(chosen, e)
    rnd = lambda *s: torch.randn(*s, generator=g).to(device, dtype)  # noqa: E731
    return dict(pos=pos, x=rnd(n, d), rows=rnd(n * k, d), w=torch.rand(n, k, generator=g).to(device, dtype),
                dout=rnd(n, d))


def _moves(t: dict[str, torch.Tensor]) -> dict[str, tuple[Callable[[], Any], Callable[[], Any], int]]:
    """move → (Triton, plain PyTorch, bytes moved)."""
    pos, x, rows, w, dout = t["pos"], t["x"], t["rows"], t["w"], t["dout"]
    (n, k), d, size = pos.shape, x.shape[1], x.element_size()
    s = n * k
    none = x.new_empty(0)
    flat = pos.reshape(-1)

    def plain_dispatch():
        return x.new_empty(s, d).index_copy_(0, flat, x.repeat_interleave(k, 0))

    def plain_combine_bwd():
        dys = (w[..., None] * dout[:, None, :]).reshape(s, d)
        return x.new_empty(s, d).index_copy_(0, flat, dys), (dout[:, None, :].float() * rows[pos].float()).sum(-1)

    return {
        "dispatch": (lambda: call_op(moe_scatter, x, pos, none, none, s)[0], plain_dispatch, (n + s) * d * size),
        "dispatch_dx": (lambda: call_op(moe_gather_sum, rows, pos, none),
                        lambda: rows[pos].sum(1, dtype=torch.float32).to(x.dtype), (s + n) * d * size),
        "combine": (lambda: call_op(moe_gather_sum, rows, pos, w), lambda: torch.bmm(w[:, None, :], rows[pos])[:, 0],
                    (s + n) * d * size),
        "combine_bwd": (lambda: call_op(moe_scatter, dout, pos, w, rows, s), plain_combine_bwd, (n + 2 * s) * d * size),
    }


def _outputs(out: Any) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def bench_layer(layer: dict[str, int], micro_batches: list[int], repeats: int, device: torch.device,
                dtype: torch.dtype) -> dict[str, Any]:
    cuda = device.type == "cuda"
    out: dict[str, Any] = {}
    for mb in micro_batches:
        t = _inputs(layer, mb, device, dtype)
        row: dict[str, Any] = {"tokens": t["pos"].shape[0], "slots": t["pos"].numel()}
        copy_src = t["rows"]
        copy_ms = time_ms(lambda: copy_src.clone(), repeats, cuda)
        row["copy"] = {"ms": copy_ms, "gb_s": 2 * copy_src.numel() * copy_src.element_size() / copy_ms / 1e6}
        candidates, chosen = {}, {}
        for move, (triton_fn, plain_fn, nbytes) in _moves(t).items():
            if move in ("dispatch_dx", "combine"):  # tuned afresh for this N: every candidate's time, the choice
                _gather_sum_kernel.cache.clear()
                _gather_sum_kernel.configs_timings = {}
                triton_fn()
                candidates[move] = [{"config": str(c), "ms": ms[0] if isinstance(ms, list) else ms}
                                    for c, ms in getattr(_gather_sum_kernel, "configs_timings", {}).items()]
                chosen[move] = str(getattr(_gather_sum_kernel, "best_config", None))
            diff = 0.0
            for got, want in zip(_outputs(triton_fn()), _outputs(plain_fn())):  # the output, and dw
                got, want = got.float(), want.float()
                diff = max(diff, ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item())
            ms = {"triton": time_ms(triton_fn, repeats, cuda), "torch": time_ms(plain_fn, repeats, cuda)}
            row[move] = {**{f"{k}_ms": v for k, v in ms.items()},
                         **{f"{k}_gb_s": nbytes / v / 1e6 for k, v in ms.items()}, "bytes": nbytes,
                         "max_rel_diff": diff}
        row["gather_candidates"], row["gather_chosen"] = candidates, chosen
        out[str(mb)] = row
    return out


def markdown(report: dict[str, Any]) -> str:
    lay = report["layer"]
    lines = [f"## MoE dispatch / combine — {report['gpu'].get('name') or 'CPU'}: D {lay['dim']}, top-{lay['top_k']}, "
             f"{lay['experts']} experts", "",
             "| micro-batch | move | Triton ms | GB/s | PyTorch ms | GB/s | "
             "Triton / PyTorch | copy GB/s | max rel diff |",
             "|---|---|---|---|---|---|---|---|---|"]
    for mb, r in report["result"].items():
        for move in MOVES:
            m = r[move]
            lines.append(f"| {mb} | {move} | {m['triton_ms']:.3f} | {m['triton_gb_s']:.0f} | {m['torch_ms']:.3f} | "
                         f"{m['torch_gb_s']:.0f} | {m['triton_ms'] / m['torch_ms']:.2f}× | {r['copy']['gb_s']:.0f} | "
                         f"{m['max_rel_diff']:.1e} |")
    lines += ["", "Gather candidates (the autotuner's median ms, first call):", ""]
    for mb, r in report["result"].items():
        for move, cands in r["gather_candidates"].items():
            timed = ", ".join(f"{c['config']}: {c['ms']:.3f}" for c in cands) or "one candidate, not timed"
            lines.append(f"- micro-batch {mb}, {move}: chosen {r['gather_chosen'][move]}; {timed}")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    """The bench's command line (bench/session.py's plan is checked against it)."""
    p = kernel_bench_parser("python3 -m atelier_studio.bench.moe_dispatch", __doc__.split("\n")[0],
                            "a small layer on the CPU (tests)")
    p.add_argument("--micro-batches", type=parse_ints, default=None, help="rows of 2048 tokens (default 1,2,4)")
    return p


def main(argv: list[str] | None = None) -> int:
    a, device, dtype = kernel_bench_args(parser(), argv)
    return run_layer_bench(a, device, dtype, TINY_LAYER if a.tiny else LAYER, bench_layer, "moe-dispatch", markdown,
                           lambda res: [f"micro-batch {mb}: " + ", ".join(
                               f"{m} {r[m]['triton_ms']:.3f} ms (torch {r[m]['torch_ms']:.3f})" for m in MOVES)
                               for mb, r in res.items()])


if __name__ == "__main__":
    sys.exit(main())
