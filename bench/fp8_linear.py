"""FP8 linears on one GPU at the real projection shapes: bf16 vs Atelier's FP8 vs torchao's Float8Linear (issue 19).

    python3 -m bench.fp8_linear [--out bench/results] [--models qwen3-8b,qwen3-1.7b,sd3-medium-1024]
                                [--repeats 10] [--budget-s 200] [--compile-all] [--tiny]

Shapes (M tokens × K in → N out), one block's linears of each model; a projection with the shape of another
is timed once and listed under both names:
  qwen3-8b          M = 16,384 (micro-batch 8 × 2048): q, o 4096→4096; k, v 4096→1024; gate, up 4096→12288;
                    down 12288→4096
  qwen3-1.7b        M = 16,384: q, o 2048→2048; k, v 2048→1024; gate, up 2048→6144; down 6144→2048
  sd3-medium-1024   batch 8 at 1024 px, 4096 image + 333 text tokens per image, the two streams' own linears:
                    image M = 32,768: to_q/k/v, to_out 1536→1536; ff 1536→6144→1536; text M = 2,664: add_q/k/v,
                    to_add_out, ff_context, and the caption projection context_embedder 4096→1536
Variants, forward + backward of y = x Wᵀ (bf16 x and W, dy bf16; quantisation included in every fp8 time):
  bf16, bf16-frozen                                 F.linear (trainable: dX and dW; frozen: dX only)
  fp8-tensorwise, fp8-rowwise                       kernels.fp8_linear.fp8_linear (trainable)
  fp8-tensorwise-frozen, fp8-rowwise-frozen         fp8_frozen_linear over the weight quantised once (the one-off
                                                    weight quantisation is timed apart: weight_quant_ms)
  torchao-tensorwise, torchao-rowwise               torchao.float8.convert_to_float8_training's Float8Linear,
  torchao-{tensorwise,rowwise}-compiled             eager and torch.compile'd (compiled only at each model's
                                                    largest shape unless --compile-all: each shape compiles anew)
A peer that does not import or fails is recorded as skipped with the reason; so is any optional variant once the
run has spent --budget-s seconds (the bench is meant to finish in under 4 minutes on an H200).
Judged: the relative RMS error ‖out − ref‖ / ‖ref‖ of y, dX and dW against fp32 matmuls of the same bf16 inputs.
Timed: CUDA events, median of `repeats` after 3 warm-up calls (gradients set to None between calls, as
zero_grad does). TFLOP/s: 6·M·K·N for trainable (3 GEMMs), 4·M·K·N for frozen. The report also holds the card's
measured bf16 matmul rate (bench/env.py) and the FP8 `_scaled_mm` rate at 8192³, clocks before and after.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from atelier_studio.bench.env import clocks, environment, matmul_tflops
from atelier_studio.kernels.fp8_linear import E4M3, fp8_frozen_linear, fp8_linear, quantize_frozen_weight


def _qwen(tokens: int, dim: int, q: int, kv: int, ffn: int) -> list[tuple[str, int, int, int]]:
    return [("q", tokens, dim, q), ("k", tokens, dim, kv), ("v", tokens, dim, kv), ("o", tokens, q, dim),
            ("gate", tokens, dim, ffn), ("up", tokens, dim, ffn), ("down", tokens, ffn, dim)]


def _sd3(batch: int, image: int, text: int, dim: int, joint: int) -> list[tuple[str, int, int, int]]:
    mi, mt = batch * image, batch * text
    return [*((p, mi, dim, dim) for p in ("to_q", "to_k", "to_v", "to_out")), ("ff.up", mi, dim, 4 * dim),
            ("ff.down", mi, 4 * dim, dim), *((p, mt, dim, dim) for p in ("add_q", "add_k", "add_v", "to_add_out")),
            ("ff_context.up", mt, dim, 4 * dim), ("ff_context.down", mt, 4 * dim, dim),
            ("context_embedder", mt, joint, dim)]


MODELS = {"qwen3-8b": _qwen(16384, 4096, 4096, 1024, 12288),
          "qwen3-1.7b": _qwen(16384, 2048, 2048, 1024, 6144),
          "sd3-medium-1024": _sd3(8, 4096, 333, 1536, 4096)}
# CPU test sizes: token counts off 16 (dW's padded copies), every K and N a multiple of 16
TINY = {"qwen3-8b": _qwen(40, 64, 64, 32, 96), "qwen3-1.7b": _qwen(24, 32, 32, 16, 64),
        "sd3-medium-1024": _sd3(2, 16, 5, 32, 48)}
RECIPES = ("tensorwise", "rowwise")
VARIANTS = ("bf16", "bf16-frozen", *(f"fp8-{r}" for r in RECIPES), *(f"fp8-{r}-frozen" for r in RECIPES),
            *(f"torchao-{r}" for r in RECIPES), *(f"torchao-{r}-compiled" for r in RECIPES))
REQUIRED = ("bf16", "bf16-frozen", *(f"fp8-{r}" for r in RECIPES), *(f"fp8-{r}-frozen" for r in RECIPES))


def torchao_status() -> tuple[str | None, str | None]:
    """(torchao's version, None) when its float8 training API imports, else (None, the reason)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: F401
    except Exception as e:  # any import-time failure of the peer is a reason to skip it, recorded as such
        return None, f"torchao.float8 does not import: {type(e).__name__}: {str(e).strip()[:200]}"
    return importlib.metadata.version("torchao"), None


def _torchao_linear(w: torch.Tensor, recipe: str, compiled: bool) -> torch.nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
    model = convert_to_float8_training(torch.nn.Sequential(lin), config=Float8LinearConfig.from_recipe_name(recipe))
    return torch.compile(model, dynamic=False) if compiled else model


def make_variant(variant: str, w: torch.Tensor) -> tuple[Callable[[torch.Tensor], torch.Tensor], list[torch.Tensor]]:
    """variant → (fn(x) → y, the weight tensors whose .grad it fills). W [N, K] bf16."""
    if variant in ("bf16", "bf16-frozen"):
        wt = w.detach().clone().requires_grad_(variant == "bf16")
        return (lambda x: F.linear(x, wt)), [wt]
    if variant.startswith("fp8-"):
        recipe = variant.split("-")[1]
        if variant.endswith("-frozen"):
            wf = w.detach().clone()
            frozen = quantize_frozen_weight(wf, recipe)
            return (lambda x: fp8_frozen_linear(x, wf, None, frozen, recipe, impl="scaled_mm")), [wf]
        wt = w.detach().clone().requires_grad_()
        return (lambda x: fp8_linear(x, wt, None, recipe, impl="scaled_mm")), [wt]
    if variant.startswith("torchao-"):
        recipe = variant.split("-")[1]
        model = _torchao_linear(w, recipe, variant.endswith("-compiled"))
        return model, list(model.parameters())
    raise ValueError(f"unknown variant {variant!r}; known: {VARIANTS}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_once(fn: Callable, x: torch.Tensor, dy: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """One forward + backward from fresh leaves: [y, dX, dW (None for a frozen weight)]."""
    xl = x.detach().clone().requires_grad_()
    for w in weights:
        w.grad = None
    y = fn(xl)
    y.backward(dy)
    return [y.detach(), xl.grad, weights[0].grad if weights and weights[0].requires_grad else None]


def timed(fn: Callable, x: torch.Tensor, dy: torch.Tensor, weights: list[torch.Tensor], repeats: int,
          warmup: int = 3) -> list[float]:
    """Seconds per forward + backward (CUDA events on a GPU, the wall clock elsewhere), after `warmup` calls."""
    xl = x.detach().clone().requires_grad_()
    cuda = x.is_cuda
    out = []
    for i in range(warmup + repeats):
        xl.grad = None
        for w in weights:
            w.grad = None
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
        t0 = time.perf_counter()
        fn(xl).backward(dy)
        if cuda:
            e.record()
            torch.cuda.synchronize()
            dt = s.elapsed_time(e) / 1e3
        else:
            dt = time.perf_counter() - t0
        if i >= warmup:
            out.append(dt)
    return out


def rel_rms(got: torch.Tensor | None, ref: torch.Tensor) -> float | None:
    if got is None:
        return None
    return ((got.float() - ref).norm() / ref.norm()).item()


def fp8_matmul_tflops(n: int = 8192, iters: int = 20) -> dict[str, float] | None:
    """torch._scaled_mm on n³ E4M3 operands: tensorwise with and without fast accumulation, rowwise with it."""
    if not torch.cuda.is_available():
        return None
    a = torch.randn(n, n, device="cuda").to(E4M3)
    b = torch.randn(n, n, device="cuda").to(E4M3)
    one = torch.ones((), device="cuda")
    cases = {"tensorwise": (one, one, False), "tensorwise_fast_accum": (one, one, True),
             "rowwise_fast_accum": (torch.ones(n, 1, device="cuda"), torch.ones(1, n, device="cuda"), True)}
    out = {}
    for name, (sa, sb, fast) in cases.items():
        def mm():
            return torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fast)
        for _ in range(3):
            mm()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(iters):
            mm()
        e.record()
        torch.cuda.synchronize()
        out[name] = 2 * n**3 * iters / (s.elapsed_time(e) / 1e3) / 1e12
    return out


def bench_shape(m: int, k: int, n: int, device: torch.device, variants: list[str], repeats: int, warmup: int,
                compile_here: bool, deadline: float, torchao_skip: str | None) -> dict[str, Any]:
    g = torch.Generator(device=device).manual_seed(m * 31 + k * 7 + n)
    x = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g, device=device) * k**-0.5).to(torch.bfloat16)
    dy = torch.randn(m, n, generator=g, device=device).to(torch.bfloat16)
    xf, wf, dyf = x.float(), w.float(), dy.float()
    ref = [xf @ wf.t(), dyf @ wf, dyf.t() @ xf]  # fp32 ground truth of y, dX, dW
    result: dict[str, Any] = {"m": m, "k": k, "n": n, "variants": {}}
    for variant in variants:
        trainable = not variant.endswith("-frozen")
        if variant.startswith("torchao-") and torchao_skip:
            result["variants"][variant] = {"skipped": torchao_skip}
            continue
        if variant.endswith("-compiled") and not compile_here:
            result["variants"][variant] = {"skipped": "compiled only at each model's largest shape (--compile-all "
                                                      "times every shape; each one compiles anew)"}
            continue
        if variant not in REQUIRED and time.monotonic() > deadline:
            result["variants"][variant] = {"skipped": "time budget (--budget-s) spent"}
            continue
        try:
            fn, weights = make_variant(variant, w)
            got = run_once(fn, x, dy, weights)
            errs = {name: rel_rms(t, r) for name, t, r in zip(("y", "dx", "dw"), got, ref)}
            del got
            ts = timed(fn, x, dy, weights, repeats, warmup)
        except Exception as e:  # a peer that cannot run here is a result, recorded with its reason
            traceback.print_exc()
            msg = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            result["variants"][variant] = {"skipped": f"failed: {type(e).__name__}: {msg}"}
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        med = statistics.median(ts)
        flops = (6 if trainable else 4) * m * k * n
        result["variants"][variant] = {"ms": med * 1e3, "ms_min": min(ts) * 1e3, "tflops": flops / med / 1e12,
                                       "trainable": trainable, "rel_rms_err": errs}
        print(f"{m}x{k}x{n} {variant}: {med * 1e3:.3f} ms, {flops / med / 1e12:.0f} TFLOP/s, err {errs}", flush=True)
        del fn, weights
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for recipe in RECIPES:  # the frozen base's one-off cost, for the record
        _sync(device)
        t0 = time.perf_counter()
        quantize_frozen_weight(w, recipe)
        _sync(device)
        result[f"weight_quant_ms_{recipe}"] = (time.perf_counter() - t0) * 1e3
    for base, suffix in (("bf16", ""), ("bf16-frozen", "-frozen")):
        b = result["variants"].get(base, {}).get("ms")
        for v, r in result["variants"].items():
            if b and "ms" in r and v.endswith(suffix) and (suffix or not v.endswith("-frozen")):
                r["speedup_vs_bf16"] = b / r["ms"]
    return result


def bench_model(name: str, layers: list[tuple[str, int, int, int]], device: torch.device, variants: list[str],
                repeats: int, warmup: int, compile_all: bool, deadline: float,
                torchao_skip: str | None) -> dict[str, Any]:
    shapes: dict[tuple[int, int, int], list[str]] = {}
    for proj, m, k, n in layers:
        shapes.setdefault((m, k, n), []).append(proj)
    largest = max(shapes, key=lambda s: s[0] * s[1] * s[2])
    out: dict[str, Any] = {"shapes": []}
    for (m, k, n), projs in shapes.items():
        r = bench_shape(m, k, n, device, variants, repeats, warmup, compile_all or (m, k, n) == largest, deadline,
                        torchao_skip)
        r["projections"] = projs
        out["shapes"].append(r)
    totals: dict[str, float] = {}
    for v in variants:  # one block's linears, each projection counted once
        per = [r["variants"][v].get("ms") for r in out["shapes"] for _ in r["projections"]]
        if per and all(p is not None for p in per):
            totals[v] = sum(per)
    out["block_linears_ms"] = totals
    return out


def markdown(report: dict[str, Any]) -> str:
    gpu = report["gpu"].get("name") or "cpu"
    lines = [f"## FP8 linears, forward + backward — {gpu}", "",
             f"bf16 matmul (8192³): {report['matmul_tflops_bf16']} TFLOP/s; fp8 _scaled_mm: "
             f"{report['matmul_tflops_fp8']}; torchao: {report['torchao'] or report['torchao_skipped']}", ""]
    for model, r in report["models"].items():
        lines += [f"### {model}", "", "| projections | M×K×N | variant | ms | TFLOP/s | × bf16 | rel RMS err y / dX / dW |",
                  "|---|---|---|---|---|---|---|"]
        for s in r["shapes"]:
            shape = f"{s['m']}×{s['k']}×{s['n']}"
            for v, x in s["variants"].items():
                if "skipped" in x:
                    lines.append(f"| {', '.join(s['projections'])} | {shape} | {v} | skipped: {x['skipped'][:90]} | | | |")
                    continue
                e = x["rel_rms_err"]
                errs = " / ".join("—" if e[w] is None else f"{e[w]:.1e}" for w in ("y", "dx", "dw"))
                sp = f"{x['speedup_vs_bf16']:.2f}" if "speedup_vs_bf16" in x else ""
                lines.append(f"| {', '.join(s['projections'])} | {shape} | {v} | {x['ms']:.3f} | {x['tflops']:.0f} | "
                             f"{sp} | {errs} |")
        tot = r["block_linears_ms"]
        lines += ["", "One block's linears, total ms: " + ", ".join(f"{v} {t:.3f}" for v, t in tot.items()), ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m bench.fp8_linear", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--budget-s", type=float, default=200.0, help="optional variants are skipped after this long")
    p.add_argument("--compile-all", action="store_true", help="time torchao compiled at every shape")
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU, nothing compiled (tests)")
    a = p.parse_args(argv)
    models = [m for m in a.models.split(",") if m]
    variants = [v for v in a.variants.split(",") if v]
    bad = [m for m in models if m not in MODELS] + [v for v in variants if v not in VARIANTS]
    if bad:
        p.error(f"unknown models/variants {bad}; models {list(MODELS)}, variants {list(VARIANTS)}")
    device = torch.device("cpu") if a.tiny or not torch.cuda.is_available() else torch.device("cuda")
    if device.type != "cuda" and not a.tiny:
        p.error("real shapes need a CUDA GPU; use --tiny on a CPU")
    start = time.monotonic()
    version, skip = torchao_status()
    report: dict[str, Any] = {**environment(), "torchao": version, "torchao_skipped": skip,
                              "clocks": {"before": clocks()}, "matmul_tflops_bf16": matmul_tflops(),
                              "matmul_tflops_fp8": fp8_matmul_tflops(), "models": {}}
    if a.tiny:
        variants = [v for v in variants if not v.endswith("-compiled")]
        report["compiled_skipped"] = "--tiny: torch.compile is not timed on the CPU"
    table = TINY if a.tiny else MODELS
    for name in models:
        report["models"][name] = bench_model(name, table[name], device, variants, a.repeats, 1 if a.tiny else 3,
                                             a.compile_all, start + a.budget_s, skip)
    report["clocks"]["after"] = clocks()
    report["wall_s"] = time.monotonic() - start
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"fp8-linear-{time.strftime('%Y-%m-%d')}"
    tmp = out / f".{stem}.json.tmp"
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(out / f"{stem}.json")
    text = markdown(report)
    tmp = out / f".{stem}.md.tmp"
    tmp.write_text(text)
    tmp.replace(out / f"{stem}.md")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
