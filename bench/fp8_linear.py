"""FP8 linears on one GPU: bf16 vs Atelier's FP8 vs torchao's Float8Linear at the real projection shapes, with the
diagnostics that say where the time goes, the shared-input groups, and whole blocks.

    python3 -m atelier_studio.bench.fp8_linear [--quick] [--models qwen3-8b,qwen3-1.7b,sd3-medium-1024]
                                [--sections components,blocks,linears,groups,quant] [--repeats 10]
                                [--budget-s 200] [--compile-all] [--out bench/results] [--tiny]

--quick: 5 timed repeats after 2 warm-ups, no torch.compile'd peers, the optional linear variants (benchmark
recipes, torchao eager) at each model's largest shape only, a 130 s budget (the whole run in about 2.5 minutes
on an H200, Triton's compiles included). --tiny: tiny shapes on the CPU (the Triton kernels through the interpreter;
tests): one host-cost call per piece, one shape's breakdown per model.

Sections, in the order they run (a section or an optional variant past --budget-s is recorded as skipped):
  components  the host's µs per call of each piece an FP8 linear issues (allocation, memset, Triton launch,
              _scaled_mm, the custom-op dispatch, a whole Float8Linear fwd+bwd) on tiny operands
              (bench/fp8_parts.py): what a launch costs on this machine;
  blocks      one Qwen3-8B decoder block (full fine-tuning and LoRA) and one SD3-medium joint block, fwd+bwd,
              bf16 vs FP8 rowwise/tensorwise, grouped and not (bench/fp8_blocks.py), with the profiler's device
              time by kernel category;
  linears     every projection shape of each model (below), fwd+bwd per variant: median ms (CUDA events), the
              host's issue ms, TFLOP/s, × bf16, relative RMS error of y, dX, dW against fp32; and for each
              variant its GEMMs and quantisations timed alone on the GPU (CUDA graphs: no launch cost), with each
              quantisation's effective GB/s: GEMM + quant ≈ the GPU's work, ms − that ≈ launch and host cost;
  groups      the projections that share an input (q/k/v, gate/up, the MMDiT's to_q/k/v and add_q/k/v), fwd+bwd
              as one FP8 group (kernels/fp8_group.py: x quantised once) vs one layer at a time vs bf16;
  quant       each quantisation flavour at four shapes under every CUDA launch configuration and the tuner's
              choice: device ms, effective and DRAM GB/s (bench/fp8_parts.quant_sweep).
Shapes (M tokens × K in → N out), one block's linears of each model; a projection with the shape of another is
timed once and listed under both names:
  qwen3-8b          M = 16,384 (micro-batch 8 × 2048): q, o 4096→4096; k, v 4096→1024; gate, up 4096→12288;
                    down 12288→4096
  qwen3-1.7b        M = 16,384: q, o 2048→2048; k, v 2048→1024; gate, up 2048→6144; down 6144→2048
  sd3-medium-1024   batch 8 at 1024 px, 4096 image + 333 text tokens per image, the two streams' own linears:
                    image M = 32,768: to_q/k/v, to_out 1536→1536; ff 1536→6144→1536; text M = 2,664: add_q/k/v,
                    to_add_out, ff_context, and the caption projection context_embedder 4096→1536
Linear variants, forward + backward of y = x Wᵀ (bf16 x and W, dy bf16; quantisation included in every fp8 time):
  bf16, bf16-frozen                                 F.linear (trainable: dX and dW; frozen: dX only)
  fp8-tensorwise, fp8-rowwise                       kernels.fp8_linear.fp8_linear (trainable)
  fp8-tensorwise-frozen, fp8-rowwise-frozen         fp8_frozen_linear over the weight quantised once (the one-off
                                                    weight quantisation is timed apart: weight_quant_ms)
  fp8-{tensorwise,rowwise}-fastgrad                 fast accumulation in the dX and dW GEMMs too (benchmark recipe)
  fp8-rowwise-e5m2grad                              dY in E5M2 with row scales (benchmark recipe)
  fp8-rowwise-gwhp                                  dW = dYᵀ x in bf16 from the saved x: x and dY quantised by the
                                                    one-pass row kernel, no transposed copies (benchmark recipe)
  torchao-tensorwise, torchao-rowwise               torchao.float8.convert_to_float8_training's Float8Linear,
  torchao-{tensorwise,rowwise}-compiled             eager and torch.compile'd (compiled only at each model's
                                                    largest shape unless --compile-all; never with --quick)
A peer that does not import or fails is recorded as skipped with the reason.
Judged: the relative RMS error ‖out − ref‖ / ‖ref‖ of y, dX and dW against fp32 matmuls of the same bf16 inputs.
TFLOP/s: 6·M·K·N for trainable (3 GEMMs), 4·M·K·N for frozen. The report also holds the card's measured bf16
matmul rate (bench/env.py), the FP8 `_scaled_mm` rate at 8192³, clocks before and after, and the quantisers'
tuned launch configurations.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from atelier_studio.bench.env import clocks, environment, fp8_matmul_tflops, matmul_tflops
from atelier_studio.bench.fp8_blocks import bench_blocks
from atelier_studio.bench.fp8_parts import (
    QUANT_SHAPES,
    TINY_QUANT_SHAPES,
    components,
    device_ms,
    median,
    quant_sweep,
    sync,
)
from atelier_studio.kernels.fp8_group import fp8_linear_group, fp8_lora_linear_group
from atelier_studio.kernels.fp8_linear import (
    FAST_ACCUM_FORWARD,
    PAD,
    RECIPES,
    _scaled_mm,
    fp8_frozen_linear,
    fp8_linear,
    fp8_lora_linear,
    quantize_frozen_weight,
)
from atelier_studio.kernels.fp8_quant import launch_configs, quantize
from atelier_studio.kernels.lora_linear import lora_linear_group
from atelier_studio.pipeline.atomic import atomic_write_text


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
# The shared-input groups of each model: (projections, M, K, the members' N)
GROUPS = {"qwen3-8b": [("q, k, v", 16384, 4096, (4096, 1024, 1024)), ("gate, up", 16384, 4096, (12288, 12288))],
          "qwen3-1.7b": [("q, k, v", 16384, 2048, (2048, 1024, 1024)), ("gate, up", 16384, 2048, (6144, 6144))],
          "sd3-medium-1024": [("to_q, to_k, to_v", 32768, 1536, (1536,) * 3),
                              ("add_q, add_k, add_v", 2664, 1536, (1536,) * 3)]}
TINY_GROUPS = {"qwen3-8b": [("q, k, v", 40, 64, (64, 32, 32)), ("gate, up", 40, 64, (96, 96))],
               "qwen3-1.7b": [("q, k, v", 24, 32, (32, 16, 16))],
               "sd3-medium-1024": [("add_q, add_k, add_v", 10, 32, (32,) * 3)]}
TRAIN_RECIPES = ("tensorwise", "rowwise")
BENCH_RECIPES = ("tensorwise-fastgrad", "rowwise-fastgrad", "rowwise-e5m2grad", "rowwise-gwhp")
VARIANTS = ("bf16", "bf16-frozen", *(f"fp8-{r}" for r in TRAIN_RECIPES), *(f"fp8-{r}-frozen" for r in TRAIN_RECIPES),
            *(f"fp8-{r}" for r in BENCH_RECIPES), *(f"torchao-{r}" for r in TRAIN_RECIPES),
            *(f"torchao-{r}-compiled" for r in TRAIN_RECIPES))
REQUIRED = ("bf16", "bf16-frozen", *(f"fp8-{r}" for r in TRAIN_RECIPES), *(f"fp8-{r}-frozen" for r in TRAIN_RECIPES))
GROUP_VARIANTS = ("bf16", "fp8-rowwise", "fp8-rowwise-grouped", "fp8-tensorwise", "fp8-tensorwise-grouped",
                  "bf16-lora", "fp8-rowwise-lora", "fp8-rowwise-lora-grouped")
SECTIONS = ("components", "blocks", "linears", "groups", "quant")


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


def _recipe(variant: str) -> str:
    """'fp8-rowwise-frozen' → 'rowwise', 'fp8-rowwise-fastgrad' → 'rowwise-fastgrad'."""
    return variant.removeprefix("fp8-").removesuffix("-frozen")


def make_variant(variant: str, w: torch.Tensor) -> tuple[Callable[[torch.Tensor], torch.Tensor], list[torch.Tensor]]:
    """variant → (fn(x) → y, the weight tensors whose .grad it fills). W [N, K] bf16."""
    if variant in ("bf16", "bf16-frozen"):
        wt = w.detach().clone().requires_grad_(variant == "bf16")
        return (lambda x: F.linear(x, wt)), [wt]
    if variant.startswith("fp8-"):
        recipe = _recipe(variant)
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


def run_once(fn: Callable, x: torch.Tensor, dy: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """One forward + backward from fresh leaves: [y, dX, dW (None for a frozen weight)]."""
    xl = x.detach().clone().requires_grad_()
    for w in weights:
        w.grad = None
    y = fn(xl)
    y.backward(dy)
    return [y.detach(), xl.grad, weights[0].grad if weights and weights[0].requires_grad else None]


def timed(step: Callable[[], None], device: torch.device, repeats: int,
          warmup: int = 3) -> tuple[list[float], list[float]]:
    """(seconds per step (CUDA events on a GPU, the wall clock elsewhere), seconds the host spent issuing it)."""
    cuda = device.type == "cuda"
    out, host = [], []
    for i in range(warmup + repeats):
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
        t0 = time.perf_counter()
        step()
        t_host = time.perf_counter() - t0
        if cuda:
            e.record()
            e.synchronize()
            dt = s.elapsed_time(e) / 1e3
        else:
            dt = t_host
        if i >= warmup:
            out.append(dt)
            host.append(t_host)
    return out, host


def rel_rms(got: torch.Tensor | None, ref: torch.Tensor) -> float | None:
    if got is None:
        return None
    return ((got.float() - ref).norm() / ref.norm()).item()


def _quant_bytes(r: int, c: int, itemsize: int, rows: bool, cols: bool, rowwise: bool) -> int:
    """Bytes a quantisation must move at least: v read once, q / qᵀ (token columns padded) and scales written."""
    written = (r * c if rows else 0) + (c * (-(-r // PAD) * PAD) if cols else 0)
    written += 4 * ((r if rows else 0) + (c if cols else 0) if rowwise else 1)
    return r * c * itemsize + written


def stages(variant: str, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, device: torch.device) -> dict[str, Any]:
    """The GPU time of each GEMM and quantisation the variant's forward + backward makes, each alone (device_ms:
    no launch cost), and each quantisation's effective GB/s. bf16 variants: their GEMMs."""
    out: dict[str, Any] = {"gemm_ms": {}, "quant_ms": {}, "quant_gbps": {}}
    if variant in ("bf16", "bf16-frozen"):
        gemms = {"y": lambda: F.linear(x, w), "dx": lambda: dy @ w}
        if variant == "bf16":
            gemms["dw"] = lambda: dy.t() @ x
    else:
        rc = RECIPES[_recipe(variant)]
        f, g, rw = rc.forward_dtype, rc.grad_dtype, rc.rowwise
        fast = rc.grad_fast_accum
        if variant.endswith("-frozen"):
            fw = quantize_frozen_weight(w, _recipe(variant))
            xq, dq = quantize(x, f, rw), quantize(dy, g, rw)
            quants = {"x": (x, f, True, False), "dy": (dy, g, True, False)}
            gemms = {"y": lambda: _scaled_mm(xq.q, fw.q, xq.scale, fw.scale, rw, torch.bfloat16, None,
                                             FAST_ACCUM_FORWARD),
                     "dx": lambda: _scaled_mm(dq.q, fw.qt, dq.scale, fw.scale_t, rw, torch.bfloat16, fast_accum=fast)}
        else:
            cols = not rc.dw_high_precision  # x's and dY's transposed copies, unless dW reads x itself
            xq, wq = quantize(x, f, rw, True, cols, PAD), quantize(w, f, rw, True, True)
            dq = quantize(dy, g, rw, True, cols, PAD)
            quants = {"x": (x, f, True, cols), "w": (w, f, True, True), "dy": (dy, g, True, cols)}
            gemms = {"y": lambda: _scaled_mm(xq.q, wq.q, xq.scale, wq.scale, rw, torch.bfloat16, None,
                                             FAST_ACCUM_FORWARD),
                     "dx": lambda: _scaled_mm(dq.q, wq.qt, dq.scale, wq.scale_t, rw, torch.bfloat16, fast_accum=fast),
                     "dw": (lambda: _scaled_mm(dq.qt, xq.qt, dq.scale_t, xq.scale_t, rw, torch.bfloat16,
                                               fast_accum=fast))
                     if cols else (lambda: dy.t() @ x)}
        for name, (v, dtype, rows, cols) in quants.items():
            ms = device_ms(lambda v=v, dtype=dtype, rows=rows, cols=cols: quantize(v, dtype, rw, rows, cols, PAD),
                           device)
            out["quant_ms"][name] = ms
            out["quant_gbps"][name] = _quant_bytes(*v.shape, v.element_size(), rows, cols, rw) / ms / 1e6
    for name, fn in gemms.items():
        out["gemm_ms"][name] = device_ms(fn, device)
    out["gpu_ms"] = sum(out["gemm_ms"].values()) + sum(out["quant_ms"].values())
    return out


def bench_shape(m: int, k: int, n: int, device: torch.device, variants: list[str], repeats: int, warmup: int,
                compile_here: bool, deadline: float, torchao_skip: str | None, with_stages: bool = True,
                optional_here: bool = True) -> dict[str, Any]:
    """Every variant's fwd+bwd at M×K→N: errors, ms, host ms, TFLOP/s, and (with_stages) its GPU breakdown.
    optional_here False skips the variants outside REQUIRED (other than compiled ones, which compile_here gates)."""
    g = torch.Generator(device=device).manual_seed(m * 31 + k * 7 + n)
    x = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g, device=device) * k**-0.5).to(torch.bfloat16)
    dy = torch.randn(m, n, generator=g, device=device).to(torch.bfloat16)
    xf, wf, dyf = x.float(), w.float(), dy.float()
    ref = [xf @ wf.t(), dyf @ wf, dyf.t() @ xf]  # fp32 ground truth of y, dX, dW
    del xf, wf, dyf
    result: dict[str, Any] = {"m": m, "k": k, "n": n, "variants": {}}
    for variant in variants:
        trainable = not variant.endswith("-frozen")
        if variant.startswith("torchao-") and torchao_skip:
            result["variants"][variant] = {"skipped": torchao_skip}
            continue
        if variant.endswith("-compiled") and not compile_here:
            result["variants"][variant] = {"skipped": "compiled only at each model's largest shape (--compile-all "
                                                      "times every shape; each one compiles anew; none with --quick)"}
            continue
        if variant not in REQUIRED and not variant.endswith("-compiled") and not optional_here:
            result["variants"][variant] = {"skipped": "--quick: at each model's largest shape only"}
            continue
        if variant not in REQUIRED and time.monotonic() > deadline:
            result["variants"][variant] = {"skipped": "time budget (--budget-s) spent"}
            continue
        try:
            fn, weights = make_variant(variant, w)
            got = run_once(fn, x, dy, weights)
            errs = {name: rel_rms(t, r) for name, t, r in zip(("y", "dx", "dw"), got, ref)}
            del got
            xl = x.detach().clone().requires_grad_()

            def step(fn=fn, weights=weights, xl=xl) -> None:
                xl.grad = None
                for p in weights:
                    p.grad = None
                fn(xl).backward(dy)

            ts, host = timed(step, device, repeats, warmup)
            parts = None
            if with_stages and not variant.startswith("torchao"):
                try:
                    parts = stages(variant, x, w, dy, device)
                except Exception as e:  # the breakdown failing (a graph capture, say) keeps the timing
                    traceback.print_exc()
                    parts = {"failed": f"{type(e).__name__}: {str(e).strip()[:300]}"}
        except Exception as e:  # a peer that cannot run here is a result, recorded with its reason
            traceback.print_exc()
            msg = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            result["variants"][variant] = {"skipped": f"failed: {type(e).__name__}: {msg}"}
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        med = median(ts)
        flops = (6 if trainable else 4) * m * k * n
        r = {"ms": med * 1e3, "ms_min": min(ts) * 1e3, "host_ms": median(host) * 1e3, "tflops": flops / med / 1e12,
             "trainable": trainable, "rel_rms_err": errs}
        if parts is not None:
            r["stages"] = parts
        result["variants"][variant] = r
        print(f"{m}x{k}x{n} {variant}: {med * 1e3:.3f} ms (host {r['host_ms']:.3f}), {r['tflops']:.0f} TFLOP/s, "
              f"err {errs}", flush=True)
        del fn, weights
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for recipe in TRAIN_RECIPES:  # the frozen base's one-off cost, for the record
        sync(device)
        t0 = time.perf_counter()
        quantize_frozen_weight(w, recipe)
        sync(device)
        result[f"weight_quant_ms_{recipe}"] = (time.perf_counter() - t0) * 1e3
    for base, suffix in (("bf16", ""), ("bf16-frozen", "-frozen")):
        b = result["variants"].get(base, {}).get("ms")
        for v, r in result["variants"].items():
            if b and "ms" in r and v.endswith(suffix) and (suffix or not v.endswith("-frozen")):
                r["speedup_vs_bf16"] = b / r["ms"]
    return result


def bench_model(name: str, layers: list[tuple[str, int, int, int]], device: torch.device, variants: list[str],
                repeats: int, warmup: int, compile_all: bool, no_compile: bool, deadline: float,
                torchao_skip: str | None, quick: bool = False) -> dict[str, Any]:
    shapes: dict[tuple[int, int, int], list[str]] = {}
    for proj, m, k, n in layers:
        shapes.setdefault((m, k, n), []).append(proj)
    largest = max(shapes, key=lambda s: s[0] * s[1] * s[2])
    out: dict[str, Any] = {"shapes": []}
    for i, ((m, k, n), projs) in enumerate(shapes.items()):
        compile_here = not no_compile and (compile_all or (m, k, n) == largest)
        with_stages = device.type == "cuda" or i == 0  # the interpreter is slow: one shape's breakdown on a CPU
        optional_here = not quick or (m, k, n) == largest  # --quick: the optional variants at the largest shape
        r = bench_shape(m, k, n, device, variants, repeats, warmup, compile_here, deadline, torchao_skip, with_stages,
                        optional_here)
        r["projections"] = projs
        out["shapes"].append(r)
    totals: dict[str, float] = {}
    for v in variants:  # one block's linears, each projection counted once
        per = [r["variants"][v].get("ms") for r in out["shapes"] for _ in r["projections"]]
        if per and all(p is not None for p in per):
            totals[v] = sum(per)
    out["block_linears_ms"] = totals
    return out


def _group_variant(variant: str, x: torch.Tensor, ws: list[torch.Tensor], device: torch.device
                   ) -> tuple[Callable[[torch.Tensor], list[torch.Tensor]], list[torch.Tensor]]:
    """A shared-input group's variant → (fn(x) → [y_i], the tensors whose grads it fills)."""
    if "-lora" in variant:
        g = torch.Generator(device=device).manual_seed(7)
        k = x.shape[1]
        As = [(torch.randn(16, k, generator=g, device=device) * k**-0.5).requires_grad_() for _ in ws]
        Bs = [(torch.randn(w.shape[0], 16, generator=g, device=device) * 0.02).requires_grad_() for w in ws]
        scales = [2.0] * len(ws)
        if variant == "bf16-lora":
            return (lambda x: lora_linear_group(x, ws, As, Bs, scales)), As + Bs
        recipe = variant.split("-")[1]
        frozens = [quantize_frozen_weight(w, recipe) for w in ws]
        if variant.endswith("-grouped"):
            return (lambda x: fp8_lora_linear_group(x, ws, frozens, As, Bs, scales, recipe, "scaled_mm")), As + Bs
        return (lambda x: [fp8_lora_linear(x, w, None, f, a, b, s, 0.0, recipe, "scaled_mm")
                           for w, f, a, b, s in zip(ws, frozens, As, Bs, scales)]), As + Bs
    wt = [w.detach().clone().requires_grad_() for w in ws]
    if variant == "bf16":
        return (lambda x: [F.linear(x, w) for w in wt]), wt
    recipe = variant.split("-")[1]
    if variant.endswith("-grouped"):
        return (lambda x: fp8_linear_group(x, wt, None, recipe, "scaled_mm")), wt
    return (lambda x: [fp8_linear(x, w, None, recipe, "scaled_mm") for w in wt]), wt


def bench_groups(groups: list[tuple[str, int, int, tuple[int, ...]]], device: torch.device, repeats: int,
                 warmup: int, deadline: float) -> list[dict[str, Any]]:
    out = []
    for projs, m, k, outs in groups:
        g = torch.Generator(device=device).manual_seed(m + k)
        x = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)
        ws = [(torch.randn(n, k, generator=g, device=device) * k**-0.5).to(torch.bfloat16) for n in outs]
        dys = [torch.randn(m, n, generator=g, device=device).to(torch.bfloat16) for n in outs]
        res: dict[str, Any] = {"projections": projs, "m": m, "k": k, "n": list(outs), "variants": {}}
        for variant in GROUP_VARIANTS:
            if time.monotonic() > deadline:
                res["variants"][variant] = {"skipped": "time budget (--budget-s) spent"}
                continue
            try:
                fn, params = _group_variant(variant, x, ws, device)
                xl = x.detach().clone().requires_grad_()

                def step(fn=fn, params=params, xl=xl, dys=dys) -> None:
                    xl.grad = None
                    for p in params:
                        p.grad = None
                    torch.autograd.backward(fn(xl), dys)

                ts, host = timed(step, device, repeats, warmup)
            except Exception as e:  # recorded with its reason, as a linear variant's failure is
                traceback.print_exc()
                res["variants"][variant] = {"skipped": f"failed: {type(e).__name__}: {str(e).strip()[:300]}"}
                continue
            res["variants"][variant] = {"ms": median(ts) * 1e3, "host_ms": median(host) * 1e3}
            print(f"group {projs} {m}x{k}→{outs} {variant}: {median(ts) * 1e3:.3f} ms", flush=True)
            del fn, params
        for v, r in res["variants"].items():
            base = res["variants"].get("bf16-lora" if "-lora" in v else "bf16", {}).get("ms")
            if "ms" in r and base:
                r["speedup_vs_bf16"] = base / r["ms"]
        out.append(res)
        del x, ws, dys
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


# --- report ---------------------------------------------------------------------------------------
def _fmt(v: float | None, spec: str = ".3f") -> str:
    return "—" if v is None else format(v, spec)


def markdown(report: dict[str, Any]) -> str:
    gpu = report["gpu"].get("name") or "cpu"
    lines = [f"## FP8 linears, forward + backward — {gpu}", "",
             f"bf16 matmul (8192³): {report['matmul_tflops_bf16']} TFLOP/s; fp8 _scaled_mm: "
             f"{report['matmul_tflops_fp8']}; torchao: {report['torchao'] or report['torchao_skipped']}; "
             f"wall {report.get('wall_s', 0):.0f} s ("
             + ", ".join(f"{k} {v:.0f} s" for k, v in report.get("section_wall_s", {}).items()) + ")", ""]
    sections = report["sections"]
    if "components" in sections:
        lines += ["### Host cost per call (µs, tiny operands: the GPU is never the bottleneck)", "",
                  "| piece | µs |", "|---|---|"]
        lines += [f"| {k} | {v:.1f} |" for k, v in sections["components"].items()] + [""]
    if "blocks" in sections:
        b = sections["blocks"]
        lines += ["### Whole blocks, forward + backward", "",
                  f"Shapes: {json.dumps(b.get('shapes', {}))}", "",
                  "| block | variant | ms | × bf16 | host ms | peak GiB | "
                  "GPU busy ms: gemm / quant / attention / other |",
                  "|---|---|---|---|---|---|---|"]
        for model in ("qwen3-8b", "sd3-medium"):
            for v, r in b.get(model, {}).items():
                if "skipped" in r:
                    lines.append(f"| {model} | {v} | skipped: {r['skipped'][:90]} | | | | |")
                    continue
                c = r.get("profile", {}).get("category_ms")
                cats = " / ".join(f"{c[k]:.2f}" for k in ("gemm", "quant", "attention", "other")) if c else "—"
                lines.append(f"| {model} | {v} | {r['ms']:.2f} | {_fmt(r.get('speedup_vs_bf16'), '.2f')} | "
                             f"{r['host_ms']:.2f} | {_fmt(r.get('peak_gib'), '.2f')} | {cats} |")
        lines.append("")
    for model, r in sections.get("linears", {}).items():
        lines += [f"### {model}", "", "| projections | M×K×N | variant | ms | host ms | TFLOP/s | × bf16 | "
                  "rel RMS err y / dX / dW |", "|---|---|---|---|---|---|---|---|"]
        where = ["", f"Where the time goes ({model}): each GEMM and quantisation alone on the GPU (CUDA graphs, ms), "
                     "the quantisations' effective GB/s, and ms − (GEMMs + quants): launch, host and the rest", "",
                 "| M×K×N | variant | ms | GEMMs y / dX / dW | quant x / W / dY | quant GB/s x / W / dY | rest |",
                 "|---|---|---|---|---|---|---|"]
        for s in r["shapes"]:
            shape = f"{s['m']}×{s['k']}×{s['n']}"
            for v, x in s["variants"].items():
                if "skipped" in x:
                    lines.append(f"| {', '.join(s['projections'])} | {shape} | {v} | skipped: {x['skipped'][:90]} "
                                 "| | | | |")
                    continue
                e = x["rel_rms_err"]
                errs = " / ".join("—" if e[w] is None else f"{e[w]:.1e}" for w in ("y", "dx", "dw"))
                lines.append(f"| {', '.join(s['projections'])} | {shape} | {v} | {x['ms']:.3f} | {x['host_ms']:.3f} | "
                             f"{x['tflops']:.0f} | {_fmt(x.get('speedup_vs_bf16'), '.2f')} | {errs} |")
                st = x.get("stages")
                if st and "failed" in st:
                    where.append(f"| {shape} | {v} | {x['ms']:.3f} | breakdown failed: {st['failed'][:80]} | | | |")
                elif st:
                    gm, qm, qg = st["gemm_ms"], st["quant_ms"], st["quant_gbps"]
                    where.append(f"| {shape} | {v} | {x['ms']:.3f} | "
                                 + " / ".join(_fmt(gm.get(k)) for k in ("y", "dx", "dw")) + " | "
                                 + " / ".join(_fmt(qm.get(k)) for k in ("x", "w", "dy")) + " | "
                                 + " / ".join(_fmt(qg.get(k), ".0f") for k in ("x", "w", "dy"))
                                 + f" | {x['ms'] - st['gpu_ms']:.3f} |")
        tot = r["block_linears_ms"]
        lines += ["", "One block's linears, total ms: " + ", ".join(f"{v} {t:.3f}" for v, t in tot.items())]
        lines += where + [""]
    if "groups" in sections:
        lines += ["### Shared-input groups, forward + backward (ms; × bf16 or × bf16-lora)", "",
                  "| model | projections | M×K→N | " + " | ".join(GROUP_VARIANTS) + " |",
                  "|---|---|---|" + "---|" * len(GROUP_VARIANTS)]
        for model, groups in sections["groups"].items():
            for gr in groups:
                cells = []
                for v in GROUP_VARIANTS:
                    r = gr["variants"].get(v, {})
                    cells.append("skipped" if "ms" not in r else
                                 f"{r['ms']:.3f} ({_fmt(r.get('speedup_vs_bf16'), '.2f')}×)")
                lines.append(f"| {model} | {gr['projections']} | {gr['m']}×{gr['k']}→{gr['n']} | "
                             + " | ".join(cells) + " |")
        lines.append("")
    if "quant" in sections:
        lines += ["### Quantisers (device ms; effective GB/s = v read once + outputs written; dram GB/s adds the "
                  "two-pass kernels' second read)", "", "| shape | flavour | config | ms | eff GB/s | dram GB/s |",
                  "|---|---|---|---|---|---|"]
        for q in sections["quant"]:
            if "skipped" in q:
                lines.append(f"| {q['shape']} | {q['flavour']} | {q['config']} | skipped | | |")
                continue
            lines.append(f"| {q['shape'][0]}×{q['shape'][1]} | {q['flavour']} | {q['config']} | {q['ms']:.4f} | "
                         f"{q['eff_gbps']:.0f} | {_fmt(q.get('dram_gbps'), '.0f')} |")
        lines.append("")
    if report.get("launch_configs"):
        lines += ["### Tuned quantiser launch configurations", ""]
        lines += [f"- {k}: {v}" for k, v in report["launch_configs"].items()] + [""]
    for name, why in report.get("sections_skipped", {}).items():
        lines.append(f"Section {name} skipped: {why}")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m atelier_studio.bench.fp8_linear", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--variants", default=",".join(VARIANTS), help="linear variants")
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--repeats", type=int, default=None, help="timed repeats (default 10, --quick 5)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="optional work is skipped after this long (default 200, --quick 130)")
    p.add_argument("--quick", action="store_true", help="5 repeats, 2 warm-ups, nothing compiled, 130 s budget")
    p.add_argument("--compile-all", action="store_true", help="time torchao compiled at every shape")
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU, nothing compiled (tests)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    a = p.parse_args(argv)
    models = [m for m in a.models.split(",") if m]
    variants = [v for v in a.variants.split(",") if v]
    sections = [s for s in a.sections.split(",") if s]
    bad = ([m for m in models if m not in MODELS] + [v for v in variants if v not in VARIANTS]
           + [s for s in sections if s not in SECTIONS])
    if bad:
        p.error(f"unknown models/variants/sections {bad}; models {list(MODELS)}, variants {list(VARIANTS)}, "
                f"sections {list(SECTIONS)}")
    device = torch.device("cpu") if a.tiny or not torch.cuda.is_available() else torch.device("cuda")
    if device.type != "cuda" and not a.tiny:
        p.error("real shapes need a CUDA GPU; use --tiny on a CPU")
    repeats = a.repeats if a.repeats is not None else (5 if a.quick else 10)
    warmup = 1 if a.tiny else (2 if a.quick else 3)
    budget = a.budget_s if a.budget_s is not None else (130.0 if a.quick else 200.0)
    no_compile = a.tiny or a.quick
    start = time.monotonic()
    deadline = start + budget
    version, skip = torchao_status()
    report: dict[str, Any] = {**environment(), "torchao": version, "torchao_skipped": skip,
                              "args": {"quick": a.quick, "tiny": a.tiny, "repeats": repeats, "warmup": warmup,
                                       "budget_s": budget, "models": models, "sections": sections},
                              "clocks": {"before": clocks()}, "matmul_tflops_bf16": matmul_tflops(),
                              "matmul_tflops_fp8": fp8_matmul_tflops(), "sections": {}, "sections_skipped": {}}
    if no_compile:
        variants = [v for v in variants if not v.endswith("-compiled")]
        report["compiled_skipped"] = "--tiny / --quick: torch.compile'd peers are not timed"
    for section in SECTIONS:
        if section not in sections:
            continue
        if section != "linears" and time.monotonic() > deadline:
            report["sections_skipped"][section] = "time budget (--budget-s) spent"
            continue
        t0 = time.monotonic()
        if section == "components":
            report["sections"]["components"] = components(device, 1 if a.tiny else 200, 0 if a.tiny else 5)
        elif section == "blocks":
            report["sections"]["blocks"] = bench_blocks(device, a.tiny, repeats, warmup, deadline)
        elif section == "linears":
            table = TINY if a.tiny else MODELS
            report["sections"]["linears"] = {
                name: bench_model(name, table[name], device, variants, repeats, warmup, a.compile_all, no_compile,
                                  deadline, skip, a.quick) for name in models}
        elif section == "groups":
            table = TINY_GROUPS if a.tiny else GROUPS
            report["sections"]["groups"] = {name: bench_groups(table[name], device, repeats, warmup, deadline)
                                            for name in models}
        elif section == "quant":
            report["sections"]["quant"] = quant_sweep(device, TINY_QUANT_SHAPES if a.tiny else QUANT_SHAPES, deadline)
        report.setdefault("section_wall_s", {})[section] = time.monotonic() - t0
        print(f"section {section}: {time.monotonic() - t0:.1f} s", flush=True)
    report["launch_configs"] = {k: f"{c.block_r}x{c.block_c}/{c.num_warps}w" for k, c in launch_configs().items()}
    report["clocks"]["after"] = clocks()
    report["wall_s"] = time.monotonic() - start
    out = Path(a.out)
    stem = f"fp8-linear-{time.strftime('%Y-%m-%d')}"
    atomic_write_text(out / f"{stem}.json", json.dumps(report, indent=1))
    text = markdown(report)
    atomic_write_text(out / f"{stem}.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
