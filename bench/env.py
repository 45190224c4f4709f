"""What every benchmark report records about the machine it ran on.

GPU name and driver, library versions, SM clock and power (read with nvidia-smi, never changed), and
the bf16 and FP8 matmul rates measured on this card in this run — the practical ceilings on a power-capped H200
(a report quotes MFU against them beside the datasheet peaks: bench/harness.py mfu_fields).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

LIBRARIES = ("torch", "triton", "transformers", "peft", "diffusers", "liger-kernel", "fla-core", "flash-attn",
             "flash-attn-4", "nvidia-cutlass-dsl", "tilelang", "accelerate", "safetensors", "bitsandbytes", "torchao")


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    found["cuda"] = torch.version.cuda
    return found


def gpu_info() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"name": None}
    props = torch.cuda.get_device_properties(0)
    info: dict[str, Any] = {"name": props.name, "sms": props.multi_processor_count,
                            "memory_gb": props.total_memory / 2**30}
    info["driver"] = _smi("driver_version")
    return info


def clocks() -> dict[str, str | None]:
    """SM clock, power draw and power limit now (read only)."""
    return {"sm_mhz": _smi("clocks.sm"), "power_w": _smi("power.draw"), "power_limit_w": _smi("power.limit"),
            "temp_c": _smi("temperature.gpu"), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def _smi(field: str) -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def _events_tflops(fn, flops_per_call: float, iters: int) -> float:
    """TFLOP/s of `fn()` over `iters` calls after 3 warm-up calls (CUDA events)."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return flops_per_call * iters / (start.elapsed_time(end) / 1e3) / 1e12


def matmul_tflops(n: int = 8192, iters: int = 20) -> float | None:
    """bf16 n³ matmul rate on random data (CUDA events, after warm-up)."""
    if not torch.cuda.is_available():
        return None
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return _events_tflops(lambda: a @ b, 2 * n**3, iters)


def fp8_matmul_tflops(n: int = 8192, iters: int = 20) -> dict[str, float] | None:
    """torch._scaled_mm on n³ E4M3 operands (bf16 out): tensorwise with and without fast accumulation, rowwise with
    it. None without a GPU with FP8 tensor cores (compute capability >= 8.9)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        return None
    e4m3 = torch.float8_e4m3fn
    a = torch.randn(n, n, device="cuda").to(e4m3)
    b = torch.randn(n, n, device="cuda").to(e4m3)
    one = torch.ones((), device="cuda")
    cases = {"tensorwise": (one, one, False), "tensorwise_fast_accum": (one, one, True),
             "rowwise_fast_accum": (torch.ones(n, 1, device="cuda"), torch.ones(1, n, device="cuda"), True)}
    out = {}
    for name, (sa, sb, fast) in cases.items():
        def mm(sa=sa, sb=sb, fast=fast):
            return torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fast)
        out[name] = _events_tflops(mm, 2 * n**3, iters)
    return out


def matmul_rates() -> dict[str, Any]:
    """The card's measured matmul ceilings in this run: {"bf16": TFLOP/s, "fp8": {case: TFLOP/s}, "fp8_best": the
    fastest FP8 case} (None each where the machine has no such tensor cores)."""
    fp8 = fp8_matmul_tflops()
    return {"bf16": matmul_tflops(), "fp8": fp8, "fp8_best": max(fp8.values()) if fp8 else None}


PACKAGES = ("bench", "data", "designer", "imagegen", "kernels", "pipeline")


def source_revision() -> dict[str, str | None]:
    """Which code produced a report: the git commit (None where the tree travelled without .git, as on the
    device machine) and a SHA-256 over every .py file of the packages, which identifies the code either way."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(p for pkg in PACKAGES for p in (root / pkg).rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"git_commit": commit, "source_sha256": digest.hexdigest()}


def environment() -> dict[str, Any]:
    return {"gpu": gpu_info(), "versions": versions(), "command": " ".join(sys.argv), "host": platform.node(),
            "source": source_revision()}
