"""Qwen3.5's gated delta rule on one GPU: fla-core's tilelang backend against its Triton kernels under Atelier's
lift of fla's Hopper guard (kernels/gated_delta_rule.py), forward + backward, each judged against the fp32
reference.

    python3 -m atelier_studio.bench.gated_delta_rule [--backends tilelang,triton] [--repeats 10] [--out DIR]
                                      [--budget-s 120] [--tiny]

Shapes: N packed tokens in S documents, Hk key heads, Hv value heads, Dk, Dv head dims. Qwen3.5-9B's Gated DeltaNet
layer: Hk 16, Hv 32, Dk = Dv = 128, on four packed rows of 2048 (N 8,192; the documents of the GPU test at these
shapes, tests/kernels/test_gated_delta_rule.py), bf16, the log decay in fp32.

Backends. On Hopper with Triton 3.4 – 3.7.0, fla refuses its Triton backward (a Triton miscompile at key tiles of
64) unless the guard is lifted, which Atelier does for key head dims in (64, 128] only; with tilelang installed (and
nvcc), fla dispatches that backward kernel to its tilelang backend instead and no guard applies. fla reads its
dispatch switch (FLA_DISABLE_BACKEND_DISPATCH) when it is imported, so each backend runs in its own process:
  tilelang  fla as installed (the dispatch on); recorded as skipped unless tilelang really takes the kernel
            (kernels.gated_delta_rule.fla_tilelang_enabled);
  triton    FLA_DISABLE_BACKEND_DISPATCH=1: fla's Triton kernels, the guard lifted by Atelier.
Each: median ms of forward + backward (CUDA events, after 3 warm-up calls: autotuning and tilelang's compile
happen there) and the RMS ratio RMS(x − ref) / RMS(ref) of the output and every gradient against
gated_delta_rule_ref in fp32, within fla's own test tolerances (1e-2; 2e-2 for the gate gradients dg and dbeta).
Choice: the path that needs no guard lift (tilelang) when it is exact and within 3% of the fastest exact path.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

BACKENDS = ("tilelang", "triton")
LENS = [700, 1348, 2048, 1, 63, 64, 65, 1855, 37, 2011]  # four rows of 2048, uneven documents
HEADS = (16, 32, 128, 128)  # Qwen3.5-9B: Hk, Hv, Dk, Dv
TINY_LENS, TINY_HEADS = [30, 1, 64, 33], (2, 4, 16, 16)
LIMITS = {"o": 1e-2, "dq": 1e-2, "dk": 1e-2, "dv": 1e-2, "dg": 2e-2, "dbeta": 2e-2}  # fla's own tolerances
WITHIN = 1.03  # the guard-free path is preferred when at most 3% slower


def inputs(lens: list[int], heads: tuple[int, int, int, int], device: torch.device, seed: int = 0
           ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """(q, k, v, g, beta) as the model feeds them (bf16, g fp32 ≤ 0), dy, cu_seqlens int32."""
    hk, hv, dk, dv = heads
    n = sum(lens)
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device)

    q, k, v = randn(n, hk, dk), randn(n, hk, dk), randn(n, hv, dv)
    decay = -torch.nn.functional.softplus(randn(n, hv))  # log decay ≤ 0
    beta = torch.sigmoid(randn(n, hv))
    dy = randn(n, hv, dv).to(torch.bfloat16)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return [q.bfloat16(), k.bfloat16(), v.bfloat16(), decay, beta.bfloat16()], dy, cu


def rms_ratio(a: torch.Tensor, e: torch.Tensor) -> float:
    """RMS(a − e) / RMS(e), in fp64."""
    a, e = a.double(), e.double()
    return float((a - e).pow(2).mean().sqrt() / e.pow(2).mean().sqrt().clamp_min(1e-30))


def run_backend(backend: str, lens: list[int], heads: tuple[int, int, int, int], repeats: int) -> dict[str, Any]:
    """This process's fla path (the caller set the dispatch switch): what ran, its time, its errors."""
    from atelier_studio.kernels import gated_delta_rule as gdr

    if not torch.cuda.is_available():
        return {"skipped": "needs a CUDA GPU"}
    if not gdr.has_fla():
        return {"skipped": gdr.FLA_MISSING}
    device = torch.device("cuda")
    tilelang = gdr.fla_tilelang_enabled()
    if backend == "tilelang" and not tilelang:
        return {"skipped": "fla's tilelang backend is not taking the kernel here (tilelang and nvcc installed? "
                           "FLA_DISABLE_BACKEND_DISPATCH unset?)"}
    if backend == "triton" and tilelang:
        return {"skipped": "fla's tilelang backend is on: the Triton path needs FLA_DISABLE_BACKEND_DISPATCH=1"}
    leaves, dy, cu = inputs(lens, heads, device)
    guard = gdr.hopper_guard_action(torch.cuda.get_device_capability(), gdr.triton_version(), heads[2],
                                    torch.bfloat16, tilelang)

    def step(impl: str, fp32: bool = False) -> list[torch.Tensor]:
        xs = [(t.float() if fp32 else t).clone().requires_grad_() for t in leaves]
        y = gdr.gated_delta_rule(*xs, cu, impl=impl)
        return [y, *torch.autograd.grad((y.float() * dy.float()).sum(), xs)]

    ms = []
    for i in range(3 + repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        got = step("fla")
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            ms.append(start.elapsed_time(end))
    ref = step("ref", fp32=True)
    ratios = {name: rms_ratio(a, e) for name, a, e in zip(LIMITS, got, ref)}
    return {"ms": statistics.median(ms), "ms_min": min(ms), "rms_ratio": ratios,
            "exact": all(ratios[k] < LIMITS[k] and torch.isfinite(a).all().item() for k, a in zip(LIMITS, got)),
            "tilelang": tilelang, "guard": guard, "tokens": sum(lens), "heads": list(heads)}


def choose(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The path to use: tilelang (no guard lift) when exact and within WITHIN of the fastest exact path; else the
    fastest exact path. {"choice", "why"}."""
    exact = {b: r for b, r in results.items() if r.get("exact")}
    if not exact:
        return {"choice": None, "why": "no backend ran exactly here"}
    fastest = min(exact, key=lambda b: exact[b]["ms"])
    if "tilelang" in exact and exact["tilelang"]["ms"] <= WITHIN * exact[fastest]["ms"]:
        return {"choice": "tilelang", "why": f"no guard lift, {exact['tilelang']['ms'] / exact[fastest]['ms']:.3f}× "
                                             f"the fastest exact path ({fastest})"}
    if "tilelang" in exact:
        return {"choice": fastest, "why": f"tilelang is {exact['tilelang']['ms'] / exact[fastest]['ms']:.3f}× "
                                          f"{fastest}: more than {WITHIN - 1:.0%} slower"}
    return {"choice": fastest, "why": "the only exact path that ran"}


def child_env(backend: str) -> dict[str, str]:
    """The environment of a backend's process: fla's dispatch switch off for triton, unset for tilelang."""
    env = dict(os.environ)
    env.pop("FLA_DISABLE_BACKEND_DISPATCH", None)
    if backend == "triton":
        env["FLA_DISABLE_BACKEND_DISPATCH"] = "1"
    return env


def markdown(report: dict[str, Any]) -> str:
    lines = [f"## gated delta rule, forward + backward — {report['gpu'].get('name') or 'cpu'}, "
             f"{report['shape']['tokens']} tokens, heads {report['shape']['heads']}", "",
             "| backend | ms (min) | guard | RMS ratio o, dq, dk, dv, dg, dbeta | exact |", "|---|---|---|---|---|"]
    for b, r in report["backends"].items():
        if "ms" not in r:
            lines.append(f"| {b} | {r.get('skipped') or r.get('error')} | | | |")
            continue
        ratios = ", ".join(f"{r['rms_ratio'][k]:.1e}" for k in LIMITS)
        lines.append(f"| {b} | {r['ms']:.2f} ({r['ms_min']:.2f}) | {r['guard']} | {ratios} | {r['exact']} |")
    lines += ["", f"choice: {report['choice']['choice']} ({report['choice']['why']})"]
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    """The bench's command line (bench/session.py's plan is checked against it)."""
    p = argparse.ArgumentParser(prog="python3 -m atelier_studio.bench.gated_delta_rule",
                                description=__doc__.split("\n")[0])
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default="bench/results")
    p.add_argument("--budget-s", type=float, default=None, help="seconds for all backends (each its share)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (tests; without a GPU every backend skips)")
    p.add_argument("--child", choices=BACKENDS, help=argparse.SUPPRESS)  # one backend, in this process
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    a = p.parse_args(argv)
    lens, heads = (TINY_LENS, TINY_HEADS) if a.tiny else (LENS, HEADS)
    if a.child:
        Path(a.child_out).write_text(json.dumps(run_backend(a.child, lens, heads, a.repeats)))
        return 0
    backends = [x for x in a.backends.split(",") if x]
    if [x for x in backends if x not in BACKENDS]:
        p.error(f"--backends: unknown {[x for x in backends if x not in BACKENDS]}; known: {list(BACKENDS)}")
    from atelier_studio.bench.env import clocks, environment
    from atelier_studio.pipeline.atomic import atomic_write_text

    report: dict[str, Any] = {**environment(), "shape": {"tokens": sum(lens), "documents": lens, "heads": list(heads)},
                              "clocks": {"before": clocks()}, "backends": {}}
    deadline = None if a.budget_s is None else time.monotonic() + a.budget_s
    for i, b in enumerate(backends):
        left = None if deadline is None else (deadline - time.monotonic()) / (len(backends) - i)
        if left is not None and left <= 0:
            report["backends"][b] = {"skipped": f"time budget (--budget-s {a.budget_s:g}) spent"}
            continue
        with tempfile.TemporaryDirectory(prefix="atelier-gdr-") as tmp:
            out = Path(tmp) / "result.json"
            cmd = [sys.executable, "-m", "atelier_studio.bench.gated_delta_rule", "--child", b, "--child-out",
                   str(out), "--repeats", str(a.repeats)] + (["--tiny"] if a.tiny else [])
            try:
                done = subprocess.run(cmd, env=child_env(b), timeout=left, capture_output=True, text=True)
                last = done.stderr.strip().splitlines()[-1][:300] if done.stderr.strip() else ""
                report["backends"][b] = json.loads(out.read_text()) if out.exists() else {
                    "error": f"exit {done.returncode}: {last}"}
            except subprocess.TimeoutExpired:
                report["backends"][b] = {"skipped": f"ran past its share of --budget-s ({left:.0f} s)"}
        print(f"{b}: {report['backends'][b]}", flush=True)
    report["choice"] = choose(report["backends"])
    report["clocks"]["after"] = clocks()
    dest = Path(a.out)
    stem = dest / f"gated-delta-rule-{time.strftime('%Y-%m-%d')}"
    atomic_write_text(stem.with_suffix(".json"), json.dumps(report, indent=1), what="benchmark report")
    atomic_write_text(stem.with_suffix(".md"), markdown(report), what="benchmark report")
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
