"""Why an FP8 run's loss falls faster than bf16's in the first steps of full fine-tuning from bf16 weights: one
optimizer step, then the next batch's loss under each forward, with each side's gradients, from weights on bf16's
grid (as a bf16 checkpoint loads) and off it.

    python3 -m atelier_studio.bench.fp8_first_step [--size 1.7b] [--layers 4] [--tokens 256] [--lr 1e-5]
        [--out bench/results] [--tiny]

The designer at `--size`'s widths with `--layers` blocks, fp32 master weights computed under bf16 autocast (as the
trainer and bench/designer.py run full fine-tuning), AdamW at `--lr`, one row of `--tokens` tokens drawn from a Zipf
law over 64 ids. For each init (the weights drawn in fp32 and rounded to bf16, or kept in fp32) and each gradient
(the bf16 forward's, or train.precision = "fp8" rowwise's): one AdamW step from the same weights on batch 0, then the
loss of batch 1 under the bf16 and the FP8 forward of the stepped weights (2 × 2 × 2 losses), and how much of the
step on the block linears each forward's view of the weights carries (its bf16 rounding, its rowwise E4M3
quantisation: <ΔV, Δw> / <Δw, Δw>, 1 for a view that sees all of it). Adam's first step moves every element by
about lr; a weight on bf16's grid whose half-ulp is larger than that rounds back to itself, so the bf16 forward
sees none of the step, while the FP8 grid (a scale per row) is not aligned with bf16's. On a CPU the FP8 forward
is the fake-quantised reference (kernels/fp8_linear.py's "ref").
--tiny: the tiny Qwen3 model, 32 tokens (the same code, for tests).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from atelier_studio.bench.designer import random_state_dict
from atelier_studio.bench.harness import write_report
from atelier_studio.designer.hf import args_from_size, build_model
from atelier_studio.designer.registry import family_of_size
from atelier_studio.kernels.cross_entropy import linear_cross_entropy
from atelier_studio.kernels.fp8_linear import E4M3
from atelier_studio.kernels.fp8_quant import fake_quantize
from atelier_studio.pipeline.float8 import apply_fp8

VOCAB = 151936  # Qwen3's
INITS = ("bf16-grid", "fp32")
PRECISIONS = ("bf16", "fp8")


def batches(n: int, tokens: int, vocab: int, seed: int = 1) -> list[torch.Tensor]:
    """n rows of `tokens` ids from a Zipf law over 64 ids spread across the vocabulary: learnable in a few steps."""
    g = torch.Generator().manual_seed(seed)
    probs = 1.0 / torch.arange(1, 65, dtype=torch.float32)
    return [(torch.multinomial(probs, tokens, replacement=True, generator=g) * (vocab // 64))[None] for _ in range(n)]


def build(args: Any, weights: dict[str, torch.Tensor], precision: str, device: torch.device) -> nn.Module:
    with torch.device("meta"):
        model = build_model(args)
    model.load_state_dict({k: v.to(device, copy=True) for k, v in weights.items()}, assign=True)
    model.requires_grad_(True)
    if precision == "fp8":
        apply_fp8(model, "rowwise")
    return model


def loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss of one row under bf16 autocast."""
    ids = ids.to(next(model.parameters()).device)
    t = ids.shape[1]
    pos = torch.arange(t, device=ids.device)[None]
    cu = torch.tensor([0, t], dtype=torch.int32, device=ids.device)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16):
        hidden = model(ids, pos, cu, t).reshape(t, -1)
        total = linear_cross_entropy(hidden[:-1], model.lm_head_weight, ids[0, 1:])  # a sum over the t - 1 tokens
    return total / (t - 1)


def linear_weights(weights: dict[str, torch.Tensor]) -> list[str]:
    """The block linears' weight names (what train.precision = "fp8" computes in FP8)."""
    return [k for k, v in weights.items() if v.dim() == 2 and ".layers." in k]


def seen(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], names: list[str]) -> dict[str, float]:
    """How much of the step on the weights `names` each forward's view of them carries: <ΔV, Δw> / <Δw, Δw> for
    the view V = bf16 rounding and V = rowwise E4M3 quantisation (per output row, as the FP8 forward quantises W),
    1 for fp32 itself; and the share of elements whose bf16 value changed at all."""
    dot_bf16 = dot_fp8 = norm = 0.0
    changed = count = 0
    for k in names:
        b = before[k].float()
        a = after[k].float().to(b.device)
        step = a - b
        norm += float((step * step).sum())
        dot_bf16 += float(((a.bfloat16().float() - b.bfloat16().float()) * step).sum())
        dot_fp8 += float(((fake_quantize(a, E4M3, True) - fake_quantize(b, E4M3, True)) * step).sum())
        changed += int((a.bfloat16() != b.bfloat16()).sum())
        count += b.numel()
    return {"bf16": dot_bf16 / norm, "fp8_rowwise": dot_fp8 / norm, "bf16_elements_changed": changed / count}


def measure(args: Any, tokens: int, lr: float, device: torch.device) -> dict[str, Any]:
    rows = batches(2, tokens, args.vocab_size)
    drawn = random_state_dict(args, torch.float32, torch.device("cpu"), 0)
    inits = {"bf16-grid": {k: v.bfloat16().float() for k, v in drawn.items()}, "fp32": drawn}
    names = linear_weights(drawn)
    out: dict[str, Any] = {}
    for init, weights in inits.items():
        evals = {p: build(args, weights, p, device) for p in PRECISIONS}
        with torch.no_grad():
            before = {p: loss_of(m, rows[1]).item() for p, m in evals.items()}
        res: dict[str, Any] = {"loss_before_step": before, "after_step": {}}
        for grads in PRECISIONS:
            model = build(args, weights, grads, device)
            opt = torch.optim.AdamW(list(model.parameters()), lr=lr, weight_decay=0.0)
            loss_of(model, rows[0]).backward()
            opt.step()
            stepped = {k: v.detach() for k, v in model.state_dict().items()}
            del opt, model
            after = {}
            for fwd, m in evals.items():
                m.load_state_dict(stepped)
                with torch.no_grad():
                    after[fwd] = loss_of(m, rows[1]).item()
            res["after_step"][grads] = {"loss": after, "update_seen": seen(weights, stepped, names)}
        out[init] = res
        del evals
    return out


def markdown(report: dict[str, Any]) -> str:
    c = report["config"]
    lines = [f"## FP8 vs bf16 after one AdamW step (lr {c['lr']:g}) — {c['size']} widths, {c['layers']} blocks, "
             f"{c['tokens']} tokens, {report['device']}", "",
             "| init | gradients | loss before, bf16 / fp8 forward | loss after, bf16 forward "
             "| loss after, fp8 forward | share of the step seen: bf16 / fp8 forward | bf16 elements changed |",
             "|---|---|---|---|---|---|---|"]
    for init, res in report["result"].items():
        b = res["loss_before_step"]
        for grads, r in res["after_step"].items():
            sn = r["update_seen"]
            lines.append(f"| {init} | {grads} | {b['bf16']:.4f} / {b['fp8']:.4f} | {r['loss']['bf16']:.4f} | "
                         f"{r['loss']['fp8']:.4f} | {sn['bf16']:.2f} / {sn['fp8_rowwise']:.2f} | "
                         f"{sn['bf16_elements_changed']:.1%} |")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m atelier_studio.bench.fp8_first_step",
                                description=__doc__.split("\n")[0])
    p.add_argument("--size", default="1.7b", help="a Qwen3 size whose widths the model takes (default 1.7b)")
    p.add_argument("--layers", type=int, default=4, help="blocks (default 4: CPU-sized)")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW's (default bench/designer.py's full-FT 1e-5)")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--tiny", action="store_true", help="the tiny model, 32 tokens (tests)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    a = p.parse_args(argv)
    if a.layers < 1 or a.tokens < 2 or a.lr <= 0:
        p.error(f"--layers ≥ 1, --tokens ≥ 2 and --lr > 0; got {a.layers}, {a.tokens}, {a.lr}")
    size = family_of_size(a.size).tiny_size if a.tiny else a.size
    tokens = 32 if a.tiny else a.tokens
    overrides = {} if a.tiny else {"num_layers": a.layers}
    args = args_from_size(size, 512 if a.tiny else VOCAB, **overrides)
    device = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    from atelier_studio.bench.env import environment

    report: dict[str, Any] = {**environment(), "device": str(device),
                              "config": {"size": size, "layers": args.num_layers, "tokens": tokens, "lr": a.lr}}
    report["result"] = measure(args, tokens, a.lr, device)
    md = markdown(report)
    print(md, flush=True)
    print(f"wrote {write_report(report, Path(a.out), 'fp8-first-step', md, lambda _: None)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
