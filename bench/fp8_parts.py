"""Where an FP8 linear's time goes, for bench/fp8_linear.py: timers that separate the GPU's work from the host's,
the host cost of each piece, the quantisers' bandwidth per launch configuration, and a profiler breakdown.

Timers (all in ms unless named _us):
  device_ms(fn)  the GPU time of one fn(): `calls` copies captured in one CUDA graph and replayed, so no launch
                 or Python cost is in it (on a CPU, the wall clock per call);
  host_us(fn)    the host's time to issue one fn() (tiny operands: the GPU finishes each call before the next is
                 issued, so the issue loop never waits on it);
  a fwd+bwd timed with CUDA events around the call (bench/fp8_linear.py's `timed`) is the larger of the two plus
  any gaps: where it is near host_us, the host, not the GPU, sets the speed.
Quantiser bandwidth: effective GB/s = (bytes of v read once + bytes of q, qᵀ and scales written) / device time;
the two-pass kernels read v twice, so their memory traffic is one more read of v (dram GB/s, an estimate: the
second read may partly hit L2). An H200 copies at about 4.3 TB/s (read + write counted).
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from atelier_studio.kernels.fp8_quant import CUDA_CONFIGS, E4M3, LaunchConfig, quantize

# The quantisations a step makes, as (rowwise, rows, cols): x or dY for the trainable GEMMs (both layouts), a frozen
# base's x or dY (rows only; rowwise takes the one-pass kernel)
FLAVOURS = {"tensorwise q+qt": (False, True, True), "rowwise q+qt": (True, True, True),
            "tensorwise q": (False, True, False), "rowwise q (one pass)": (True, True, False)}
QUANT_SHAPES = [(16384, 4096), (32768, 1536), (2664, 1536), (16384, 1024)]
TINY_QUANT_SHAPES = [(40, 64), (24, 48)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_ms(fn: Callable[[], Any], device: torch.device, calls: int = 10, replays: int = 3) -> float:
    """GPU milliseconds of one fn(), launch costs excluded (module docstring). fn must not synchronise; it runs once
    eagerly first (compiles, tunes the quantisers' launches), then `calls` times inside one captured graph."""
    if device.type != "cuda":  # (the interpreter is slow: one call after the warm-up)
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    fn()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # a warm-up on a side stream before capture, as torch.cuda.graph asks
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):  # captured on the warmed-up stream
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    ms = start.elapsed_time(end) / (calls * replays)
    del graph
    return ms


def host_us(fn: Callable[[], Any], device: torch.device, n: int = 200, warmup: int = 5) -> float:
    """Microseconds the host spends issuing one fn() (fn on tiny operands: module docstring)."""
    for _ in range(warmup):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t0
    sync(device)
    return dt / n * 1e6


def components(device: torch.device, n: int, warmup: int = 5) -> dict[str, float]:
    """Host µs per call of each piece an FP8 linear issues, on 64×64 operands (the GPU never the bottleneck here)."""
    from atelier_studio.kernels.fp8_group import fp8_linear_group
    from atelier_studio.kernels.fp8_linear import fp8_frozen_fwd, fp8_linear, quantize_frozen_weight
    from atelier_studio.pipeline.float8 import Float8Linear

    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(64, 64, generator=g, device=device).to(torch.bfloat16)
    b = torch.randn(64, 64, generator=g, device=device).to(torch.bfloat16)
    qa, qb = a.to(E4M3), b.to(E4M3)
    one = torch.ones((), device=device)
    rows, cols = torch.ones(64, 1, device=device), torch.ones(1, 64, device=device)
    frozen = quantize_frozen_weight(b, "rowwise")
    out: dict[str, float] = {}

    def add(name: str, fn: Callable[[], Any]) -> None:
        out[name] = host_us(fn, device, n, warmup)

    add("torch.empty (allocation, no kernel)", lambda: torch.empty(64, device=device))
    add("torch.zeros (one memset)", lambda: torch.zeros(64, device=device))
    add("bf16 matmul 64³ (cuBLAS)", lambda: a @ b)
    add("_scaled_mm tensorwise 64³", lambda: torch._scaled_mm(qa, qb.t(), scale_a=one, scale_b=one,
                                                              out_dtype=torch.bfloat16))
    add("_scaled_mm rowwise 64³", lambda: torch._scaled_mm(qa, qb.t(), scale_a=rows, scale_b=cols,
                                                           out_dtype=torch.bfloat16))
    for name, (rowwise, r, c) in FLAVOURS.items():
        launches = "1 Triton launch" if (rowwise and not c) else "memset + 2 Triton launches"
        add(f"quantize {name} ({launches})", lambda rowwise=rowwise, r=r, c=c: quantize(a, E4M3, rowwise, r, c, 16))
    add("fp8_frozen_fwd custom op (quantize + _scaled_mm)",
        lambda: fp8_frozen_fwd(a, frozen.q, frozen.scale, None, "rowwise", torch.bfloat16))
    body = fp8_frozen_fwd.atelier_body  # what plain eager runs (kernels.custom_op.call_op)
    add("the same, its Python body called directly (no dispatcher: eager's path)",
        lambda: body(a, frozen.q, frozen.scale, None, "rowwise", torch.bfloat16))
    x = a.clone().requires_grad_()

    def fwd_bwd(f: Callable[[torch.Tensor], Any], params: list[torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            for p in (x, *params):
                p.grad = None
            ys = f(x)
            ys = ys if isinstance(ys, list) else [ys]
            torch.autograd.backward(ys, [torch.ones_like(y) for y in ys])
        return run

    def linear(requires_grad: bool = True) -> torch.nn.Linear:
        return torch.nn.Linear(64, 64, bias=False, device=device, dtype=torch.bfloat16).requires_grad_(requires_grad)

    lin = linear()
    add("nn.Linear fwd+bwd (bf16)", fwd_bwd(lin, [lin.weight]))
    for recipe in ("rowwise", "tensorwise"):
        f8 = Float8Linear.from_linear(linear(), recipe, "scaled_mm")
        add(f"Float8Linear fwd+bwd ({recipe})", fwd_bwd(f8, [f8.weight]))
        f8z = Float8Linear.from_linear(linear(False), recipe, "scaled_mm")
        add(f"frozen Float8Linear fwd+bwd ({recipe})", fwd_bwd(f8z, []))
    ws = [torch.randn(64, 64, generator=g, device=device).to(torch.bfloat16).requires_grad_() for _ in range(3)]
    add("3 fp8_linear fwd+bwd over one x (rowwise)",
        fwd_bwd(lambda x: [fp8_linear(x, w, None, "rowwise", "scaled_mm") for w in ws], ws))
    add("fp8_linear_group of 3 fwd+bwd (rowwise)",
        fwd_bwd(lambda x: fp8_linear_group(x, ws, None, "rowwise", "scaled_mm"), ws))
    return out


def quant_sweep(device: torch.device, shapes: list[tuple[int, int]], deadline: float) -> list[dict[str, Any]]:
    """Device ms and GB/s of each quantisation flavour at each shape, for every CUDA launch configuration and for
    the tuner's choice (config None); on a CPU only the interpreter's configuration."""
    rows_out = []
    g = torch.Generator(device=device).manual_seed(1)
    for r, c in shapes:
        v = (torch.randn(r, c, generator=g, device=device) * 2).to(torch.bfloat16)
        r16 = -(-r // 16) * 16
        for name, (rowwise, want_q, want_qt) in FLAVOURS.items():
            kind = "rows" if rowwise and not want_qt else "tiles"
            configs: list[LaunchConfig | None] = [None]
            if device.type == "cuda":
                configs += list(CUDA_CONFIGS[kind])
            written = (r * c if want_q else 0) + (c * r16 if want_qt else 0)
            written += 4 * ((r if want_q else 0) + (c if want_qt else 0) if rowwise else 1)
            read = 2 * r * c
            for cfg in configs:
                chosen = "tuned" if device.type == "cuda" else "interpreter"
                row: dict[str, Any] = {"shape": [r, c], "flavour": name,
                                       "config": (chosen if cfg is None
                                                  else f"{cfg.block_r}x{cfg.block_c}/{cfg.num_warps}w")}
                if time.monotonic() > deadline:
                    row["skipped"] = "time budget (--budget-s) spent"
                    rows_out.append(row)
                    continue
                ms = device_ms(lambda cfg=cfg, v=v: quantize(v, E4M3, rowwise, want_q, want_qt, 16, cfg), device)
                row.update(ms=ms, eff_gbps=(read + written) / ms / 1e6)
                if kind == "tiles":
                    row["dram_gbps"] = (2 * read + written) / ms / 1e6
                rows_out.append(row)
        del v
    return rows_out


def kernel_category(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("_amax_kernel", "_cast_kernel", "_quant_rows_kernel")):
        return "quant"
    if any(k in n for k in ("flash", "fmha", "sdpa", "attention", "attn")):
        return "attention"
    if any(k in n for k in ("gemm", "nvjet", "cutlass", "xmma", "matmul", "wgmma", "sm90_", "sm80_", "splitk")):
        return "gemm"
    return "other"


def profile(fn: Callable[[], Any], device: torch.device, iters: int = 2, top: int = 12) -> dict[str, Any]:
    """Device ms per fn() by kernel category (quant, gemm, attention, other) and the top kernels, from
    torch.profiler's key_averages (CUDA kernels only: CPU ops' device time would count their kernels twice)."""
    if device.type != "cuda":
        return {"skipped": "no CUDA device"}
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()
    sync(device)
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        sync(device)
    cats: dict[str, float] = {"quant": 0.0, "gemm": 0.0, "attention": 0.0, "other": 0.0}
    kernels = []
    for evt in prof.key_averages():
        if getattr(evt, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        us = getattr(evt, "self_device_time_total", None)
        if us is None:
            us = getattr(evt, "self_cuda_time_total", 0.0)
        if not us:
            continue
        ms = us / 1e3 / iters
        cats[kernel_category(evt.key)] += ms
        kernels.append({"name": evt.key[:120], "ms": ms, "calls": evt.count // iters})
    kernels.sort(key=lambda k: -k["ms"])
    return {"category_ms": cats, "busy_ms": sum(cats.values()), "top": kernels[:top]}


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")
