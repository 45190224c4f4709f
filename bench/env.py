"""What every benchmark report records about the machine it ran on.

GPU name and driver, library versions, SM clock and power (read with nvidia-smi, never changed), and
the bf16 matmul rate measured on this card in this run — the practical ceiling on a power-capped H200.
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
             "accelerate", "safetensors", "bitsandbytes", "torchao")


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


def matmul_tflops(n: int = 8192, iters: int = 20) -> float | None:
    """bf16 n³ matmul rate on random data (CUDA events, after warm-up)."""
    if not torch.cuda.is_available():
        return None
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        a @ b
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    return 2 * n**3 * iters / seconds / 1e12


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
