"""Whose bf16 rounding is it: Atelier's and diffusers' FLUX.1 / Qwen-Image losses under bf16 autocast, each against
the fp32 loss of the same weights and batch.

    python3 -m atelier_studio.bench.bf16_drift --out DIR [--configs flux-dev-1024,qwen-image-1024] [--seeds 3]
        [--width-heads 4] [--tiny]

A GPU report's "loss difference vs the peer" (bench/imagegen.py) is the sum of both sides' bf16 errors; this bench
splits it. The real model's depth (FLUX.1-dev: 19 double + 38 single blocks; Qwen-Image: 60) at a CPU-sized width
(heads of 64), its weights drawn as bench/imagegen.py draws them (random_state_dict: every matrix N(0, 0.02²)) and
then every matrix scaled by sqrt(real width / width), so that each linear has the real model's gain
(0.02 · sqrt(width)) and the activations grow through the depth as they do at the real size (at the small width's own
gain they shrink, and neither side drifts); LoRA r4 on the family's default targets, as the LoRA bench trains. One
batch of 2 images of 256 image tokens and 32 text tokens per seed, no update, attention on SDPA's math backend for
both sides: the losses of Atelier in fp32 (exact), diffusers in fp32, Atelier under bf16 autocast and diffusers
under bf16 autocast (bench/imagegen.py's builds and loss, reference kernels). drift = |loss_bf16 − loss_fp32| /
loss_fp32, each side against its own fp32 loss (the two fp32 losses agree to rounding: the parity tests).
Report: OUT/bf16-drift-<date>.json and .md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from atelier_studio.bench.env import environment
from atelier_studio.bench.harness import fmt
from atelier_studio.bench.imagegen import (
    CONFIGS,
    Variant,
    build_atelier,
    build_peer,
    make_batches,
    make_lora,
    model_args,
    random_state_dict,
    tiny_config,
)
from atelier_studio.pipeline.atomic import atomic_write_text

FAMILIES = ("flux-dev-1024", "qwen-image-1024")  # the RoPE families: the narrowing below knows their fields
HEAD_DIM, AXES = 64, (8, 28, 28)  # a 64-wide head, RoPE axes summing to it


def narrow(name: str, heads: int, tiny: bool) -> tuple[Any, Any, float]:
    """(bench config, model args, matrix gain) for `name` at `heads` heads of 64 and its real depth (tiny: 2 blocks
    of each kind)."""
    real = model_args(CONFIGS[name])
    cfg = tiny_config(CONFIGS[name])
    width = heads * HEAD_DIM
    depth = {"num_layers": 2 if tiny else real.num_layers}
    if hasattr(real, "num_single_layers"):
        depth["num_single_layers"] = 2 if tiny else real.num_single_layers
    if hasattr(real, "pooled_projection_dim"):
        depth["pooled_projection_dim"] = 64
    args = dataclasses.replace(cfg.model, num_heads=heads, head_dim=HEAD_DIM, in_channels=16, out_channels=16,
                               joint_attention_dim=width, axes_dims_rope=AXES, kernels="ref", **depth)
    cfg = dataclasses.replace(cfg, model=args, resolution=256, text_tokens=32)
    return cfg, args, (real.dim / width) ** 0.5


def measure(name: str, heads: int, seed: int, tiny: bool) -> dict[str, float]:
    """One seed's four losses and the two drifts."""
    cfg, args, gain = narrow(name, heads, tiny)
    cpu = torch.device("cpu")
    sd = {k: (v * gain if v.dim() == 2 else v).to(torch.bfloat16)
          for k, v in random_state_dict(args, torch.float32, cpu, seed).items()}
    sd32 = {k: v.float() for k, v in sd.items()}  # the same (bf16-representable) weights, in fp32
    lora = make_lora(args, 4, cpu, seed + 1)
    (batch,) = make_batches(cfg, args, 2, 1, cpu, torch.float32, seed + 2)
    ref = Variant(compile=False, kernels="ref")

    def loss(run: Any) -> float:
        # both sides' attention on SDPA's math backend: the same kernel for both, on any CPU (the CPU flash kernel's
        # bf16 path needs AVX-512)
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
            return run.loss(batch).item()

    out = {"atelier_fp32": loss(build_atelier(args, sd32, ref, True, lora)),
           "diffusers_fp32": loss(build_peer("diffusers", args, sd32, True, lora)),
           "atelier_bf16": loss(build_atelier(args, sd, ref, False, lora)),
           "diffusers_bf16": loss(build_peer("diffusers", args, sd, False, lora))}
    for side in ("atelier", "diffusers"):
        out[f"{side}_drift"] = abs(out[f"{side}_bf16"] - out[f"{side}_fp32"]) / out[f"{side}_fp32"]
    out["gain"] = gain
    return out


def markdown(report: dict[str, Any]) -> str:
    lines = [f"## bf16 drift of the loss, Atelier and diffusers, against fp32 (CPU, {report['host']})",
             "", f"{report['heads']} heads of {HEAD_DIM} ({report['heads'] * HEAD_DIM} wide), the blocks below, every "
             "matrix scaled to the real width's gain; one batch per seed, no update; attention on SDPA's math "
             "backend.", "",
             "| config | blocks | gain | seeds | fp32 loss (Atelier / diffusers, seed 0) "
             "| Atelier bf16 drift (mean, max) | diffusers bf16 drift (mean, max) |", "|---|---|---|---|---|---|---|"]
    for name, r in report["configs"].items():
        runs = r["seeds"]
        a = [s["atelier_drift"] for s in runs]
        d = [s["diffusers_drift"] for s in runs]
        lines.append(f"| {name} | {r['blocks']} | {runs[0]['gain']:.2f} | {len(runs)} | "
                     f"{runs[0]['atelier_fp32']:.5f} / {runs[0]['diffusers_fp32']:.5f} | "
                     f"{fmt(statistics.fmean(a), '.3%')}, {fmt(max(a), '.3%')} | "
                     f"{fmt(statistics.fmean(d), '.3%')}, {fmt(max(d), '.3%')} |")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    from atelier_studio.flows.cli_args import Bounds, OneLineParser, number

    p = OneLineParser(prog="python3 -m atelier_studio.bench.bf16_drift", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--configs", default=",".join(FAMILIES))
    number(p, "--seeds", type=int, bounds=Bounds(1, 1000, meaning="batches and weight draws"), default=3)
    number(p, "--width-heads", type=int, bounds=Bounds(1, 64, meaning="heads of 64: the small width"), default=4)
    p.add_argument("--tiny", action="store_true", help="2 blocks of each kind, 1 seed: the same path for tests")
    return p


def main(argv: list[str] | None = None) -> int:
    from atelier_studio.flows.cli_args import check_numbers
    from atelier_studio.pipeline.errors import UsageError

    p = parser()
    a = p.parse_args(argv)
    names = [x for x in a.configs.split(",") if x]
    try:  # one line naming the option, before anything runs
        check_numbers(p, a)
        if not names or [x for x in names if x not in FAMILIES]:
            raise UsageError(f"--configs {a.configs!r}: one or more of {list(FAMILIES)}")
    except UsageError as e:
        sys.stderr.write(f"atelier: error: {e}\n")
        return 2
    seeds = 1 if a.tiny else a.seeds
    start = time.time()
    report: dict[str, Any] = {**environment(), "command": " ".join([sys.executable, "-m", "bench.bf16_drift",
                                                                     *(argv if argv is not None else sys.argv[1:])]),
                              "heads": a.width_heads, "configs": {}}
    for name in names:
        _, args, _ = narrow(name, a.width_heads, a.tiny)
        blocks = args.num_layers + getattr(args, "num_single_layers", 0)
        report["configs"][name] = {"blocks": blocks, "seeds": []}
        for seed in range(seeds):
            r = measure(name, a.width_heads, seed, a.tiny)
            report["configs"][name]["seeds"].append(r)
            print(f"{name} seed {seed}: Atelier drift {r['atelier_drift']:.3%}, diffusers {r['diffusers_drift']:.3%}",
                  flush=True)
    report["seconds"] = time.time() - start
    out = Path(a.out)
    stem = f"bf16-drift{'-tiny' if a.tiny else ''}-{time.strftime('%Y-%m-%d')}"
    path = atomic_write_text(out / f"{stem}.json", json.dumps(report, indent=1), what="benchmark report")
    atomic_write_text(out / f"{stem}.md", markdown(report), what="benchmark report")
    print(markdown(report))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
