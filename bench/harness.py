"""What every speed benchmark shares (docs/performance.md): the timed optimizer-step loop, OOM as a result,
the report files (JSON + markdown + ablation chart) and small formatting helpers. bench/designer.py and
bench/imagegen.py build their models and batches; this runs and records them the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
import torch._dynamo

PEAK_TFLOPS = 989.0  # dense bf16, H100/H200 SXM (docs/mfu.md)
PEAK_FP8_TFLOPS = 1979.0  # dense FP8, H100/H200 SXM: what FP8 runs are also quoted against


class Budget:
    """A benchmark's time budget (--budget-s): runs that would start after it is spent are recorded as skipped
    with `reason()` instead of run, so a bench under a hard time limit ends with a report of what it finished.
    None seconds: no limit."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.deadline = None if seconds is None else time.monotonic() + seconds

    def spent(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def left(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def reason(self) -> str:
        return f"time budget (--budget-s {self.seconds:g}) spent"

    def skipped(self) -> dict[str, Any]:
        """A run's result when the budget was spent before it started."""
        return {"oom": False, "skipped": self.reason()}


def mfu_fields(tflops: float, matmul_bf16: float | None, matmul_fp8: float | None) -> dict[str, float | None]:
    """MFU against the ceilings beside the dense bf16 peak (which each bench reports under its own key): the dense
    FP8 peak, and the bf16 and FP8 matmul rates measured on the card in the same run (bench/env.py matmul_rates)."""
    return {"mfu_fp8_peak": tflops / PEAK_FP8_TFLOPS,
            "mfu_matmul": tflops / matmul_bf16 if matmul_bf16 else None,
            "mfu_matmul_fp8": tflops / matmul_fp8 if matmul_fp8 else None}


def timed_steps(step: Callable[[int], torch.Tensor], count: int, cuda: bool,
                context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> dict[str, Any]:
    """Run `step(i)` for i < count — one forward + loss + backward + optimizer step + zero_grad, returning the
    loss — timed with CUDA events (wall clock on CPU). No host sync inside the loop; losses read at the end.
    `context` is entered around the whole loop (so it also covers the first step's compile)."""
    times, losses = [], []
    with context():
        for i in range(count):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            else:
                t0 = time.perf_counter()
            loss = step(i)
            if cuda:
                end.record()
                times.append((start, end))
            else:
                times.append(time.perf_counter() - t0)
            losses.append(loss.detach())
    if cuda:
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) / 1e3 for s, e in times]
    return {"step_s": times, "losses": [float(x) for x in losses]}


def train_step(loss: Callable[[Any], torch.Tensor], batches: Sequence[Any], opt: torch.optim.Optimizer,
               context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
               ) -> Callable[[int], torch.Tensor]:
    """The benches' step(i): loss of batches[i mod len] and its backward (inside `context`, e.g. CPU activation
    offload), optimizer step, zero_grad; returns the loss (not synchronised)."""

    def step(i: int) -> torch.Tensor:
        with context():
            value = loss(batches[i % len(batches)])
            value.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return value

    return step


def profile_table(step: Callable[[int], torch.Tensor], warmup: int, path: Path, rows: int = 45,
                  context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> Path:
    """`warmup` steps, then torch.profiler over 2 more: the kernel table by CUDA time, written to `path` (GPU)."""
    from torch.profiler import ProfilerActivity, profile

    timed_steps(step, warmup, cuda=True, context=context)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        timed_steps(lambda i: step(warmup + i), 2, cuda=True, context=context)
    path.write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=90))
    return path


def guarded(build: Callable[[], Any], use: Callable[[Any], dict[str, Any]], cuda: bool) -> dict[str, Any]:
    """`use(build())` on a clean device (compile caches reset, peak memory counter reset); an out-of-memory
    error is a result ({"oom": True, "error": ...}). Frees the built run and the cache afterwards."""
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    # what the bench itself holds on the device (shared source weights, batches): inside peak_gb for every run alike
    baseline = torch.cuda.memory_allocated() / 1e9 if cuda else None
    torch._dynamo.reset()
    run = None
    try:
        run = build()
        result = use(run)
    except torch.OutOfMemoryError as e:
        return {"oom": True, "error": str(e).splitlines()[0]}
    finally:
        del run
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    result["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9 if cuda else None
    result["baseline_gb"] = baseline
    result["oom"] = False
    return result


def attempt(run: Callable[[], dict[str, Any]], passthrough: tuple[type[BaseException], ...] = (ImportError,)
            ) -> dict[str, Any]:
    """run() (a measurement), with any failure other than `passthrough` (a compile error, a kernel that cannot run
    these shapes) recorded as its result instead of ending the bench: {"oom": False, "failed": True, "error": the
    exception's type and first line}; the traceback goes to stderr."""
    try:
        return run()
    except passthrough:
        raise
    except Exception as e:  # an unattended run records every failure and goes on to the next measurement
        traceback.print_exc()
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        return {"oom": False, "failed": True, "error": f"{type(e).__name__}: {first}"}


def best_run(runs: dict[str, dict[str, Any]], rate: str) -> str | None:
    """The key of the fastest of `runs` by their `rate` field (tokens_per_s, images_per_s); None when no run has
    one (out of memory, failed, skipped)."""
    ok = [k for k, r in runs.items() if r and rate in r]
    return max(ok, key=lambda k: runs[k][rate]) if ok else None


def best_per_size(runs: dict[str, dict[str, dict[str, Any]]], rate: str
                  ) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, float | None]]]:
    """runs[size][compile mode] → (the best run of each size, or its first when none has a rate; the rate of each
    mode per size where a size ran in several)."""
    best, by_mode = {}, {}
    for size, modes in runs.items():
        k = best_run(modes, rate)
        best[size] = modes[k] if k else next(iter(modes.values()))
        if len(modes) > 1:
            by_mode[size] = {c: r.get(rate) for c, r in modes.items()}
    return best, by_mode


def no_rate(runs: dict[str, dict[str, Any]], sizes: str) -> dict[str, Any]:
    """The report row of a configuration none of whose runs has a rate: out of memory at every size (listed under
    `sizes`), else the first failure's error, else why it was skipped."""
    rs = list(runs.values())
    if rs and all(r.get("oom") for r in rs):
        return {"oom": True, sizes: [int(k) for k in runs]}
    failed = next((r["error"] for r in rs if r.get("failed")), None)
    if failed:
        return {"failed": True, "error": failed}
    return {"skipped": next((r["skipped"] for r in rs if r.get("skipped")), "no run")}


def run_status(r: dict[str, Any], rate_text: Callable[[dict[str, Any]], str]) -> str:
    """A run as its log line reads: skipped (why), failed (the error), OOM, or rate_text(r) and its peak memory."""
    if r.get("skipped"):
        return f"skipped ({r['skipped']})"
    if r.get("failed"):
        return f"failed ({r['error']})"
    return "OOM" if r["oom"] else f"{rate_text(r)}, {fmt(r.get('peak_gb'), '.1f')} GB"


def adamw(params: list[torch.nn.Parameter], lr: float, fused: bool) -> torch.optim.AdamW:
    """The benches' optimizer: fused AdamW (CUDA) or the foreach one, no weight decay."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=fused, foreach=None if fused else True)


def fmt(x: Any, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def parse_ints(text: str) -> list[int]:
    """argparse type for "2,4,8"."""
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def kernel_bench_parser(prog: str, description: str, tiny_help: str) -> argparse.ArgumentParser:
    """A kernel benchmark's command line: --repeats, --out and --tiny; the bench adds its own options."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default="bench/results")
    p.add_argument("--tiny", action="store_true", help=tiny_help)
    return p


def kernel_bench_args(p: argparse.ArgumentParser,
                      argv: list[str] | None) -> tuple[argparse.Namespace, torch.device, torch.dtype]:
    """`p` (a kernel_bench_parser) parsed and checked, and where the bench runs: CUDA in bf16, or with --tiny the
    CPU in fp32 (Triton's interpreter computes bf16 wrongly)."""
    a = p.parse_args(argv)
    if a.repeats < 1:
        p.error(f"--repeats must be at least 1, got {a.repeats}")
    if not a.tiny and not torch.cuda.is_available():
        p.error("needs a CUDA device (or --tiny for the CPU)")
    if a.tiny and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        # Triton reads it when a kernel is first defined, at import: too late to set it here
        p.error("--tiny on a CPU runs the Triton kernels through Triton's interpreter: start Python with "
                "TRITON_INTERPRET=1 set (TRITON_INTERPRET=1 python3 -m ...)")
    return a, torch.device("cpu" if a.tiny else "cuda"), torch.float32 if a.tiny else torch.bfloat16


def run_layer_bench(a: argparse.Namespace, device: torch.device, dtype: torch.dtype, layer: dict[str, int],
                    measure: Callable[..., dict[str, Any]], stem: str, markdown: Callable[[dict[str, Any]], str],
                    describe: Callable[[dict[str, Any]], Iterable[str]]) -> int:
    """One MoE layer's kernel bench (bench/nf4_moe.py, bench/moe_dispatch.py): the report (environment, the card's
    clocks before and after, the layer, the micro-batches: --micro-batches or 1, 2, 4), measure(layer, micro-batches,
    repeats, device, dtype) as its result, describe(result)'s lines printed, the files written."""
    from atelier_studio.bench.env import clocks, environment

    mbs = a.micro_batches or [1, 2, 4]
    report: dict[str, Any] = {**environment(), "clocks": {"before": clocks()}, "layer": layer, "micro_batches": mbs,
                              "repeats": a.repeats, "dtype": str(dtype)}
    report["result"] = measure(layer, mbs, a.repeats, device, dtype)
    report["clocks"]["after"] = clocks()
    for line in describe(report["result"]):
        print(line, flush=True)
    print(f"wrote {write_report(report, Path(a.out), stem, markdown(report), lambda _: None)}")
    return 0


def bar_chart(items: Iterable[tuple[str, float | None]], xlabel: str, title: str, path: Path,
              marks: dict[str, float] | None = None) -> Path | None:
    """Horizontal bars (the ablation), optional dashed vertical `marks` (a peer's rate); None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    items = list(items)
    if not items:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [k for k, _ in items][::-1]
    ax.barh(names, [v or 0.0 for _, v in items][::-1], color="#4a7bb7")
    for i, (_, v) in enumerate(items[::-1]):
        if v is None:  # a run without a rate (out of memory): say so instead of drawing an empty bar
            ax.text(0, i, " out of memory", va="center", fontsize=8, color="#c0504d")
    for name, x in (marks or {}).items():
        ax.axvline(x, color="#c0504d", linestyle="--", linewidth=1)
        ax.text(x, -0.6, f" {name}", color="#c0504d", fontsize=7)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(report: dict[str, Any], out: Path, stem: str, markdown: str,
                 chart: Callable[[Path], Path | None]) -> Path:
    """out/<stem>-<date>.json, .md and -ablation.png (when `chart` draws one); returns the JSON's path."""
    from atelier_studio.pipeline.atomic import atomic_write_text

    stem = f"{stem}-{time.strftime('%Y-%m-%d')}"
    path = atomic_write_text(out / f"{stem}.json", json.dumps(report, indent=1), what="benchmark report")
    atomic_write_text(out / f"{stem}.md", markdown, what="benchmark report")
    chart(out / f"{stem}-ablation.png")
    return path


# --- runs through the user-facing CLI (the first-runs benchmarks) -----------------------------------------------

def atelier(*args: str, log: Path) -> tuple[int, float]:
    """`atelier ARGS` from the repository root, its output appended to `log`: (exit status, seconds)."""
    start = time.time()
    with open(log, "a") as fh:
        fh.write(f"$ atelier {' '.join(args)}\n")
        fh.flush()
        root = Path(__file__).resolve().parents[1]  # resolved: imported through atelier_studio/ links too
        proc = subprocess.run([sys.executable, "-m", "atelier_studio.flows.cli", *args], cwd=root, stdout=fh,
                              stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc.returncode, time.time() - start


def read_run(out: Path) -> dict:
    """A finished run's summary.json and metrics.jsonl, whichever exist."""
    result: dict = {}
    if (out / "summary.json").is_file():
        result["summary"] = json.loads((out / "summary.json").read_text())
    if (out / "metrics.jsonl").is_file():
        result["metrics"] = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    return result
