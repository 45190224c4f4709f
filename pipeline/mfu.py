"""Model FLOP utilisation: the device peak table and a throughput meter.

MFU = useful model FLOPs per second / the device's dense bf16 peak. The FLOPs of a step come from the
model (`train_flops`), which counts forward, activation-gradient and weight-gradient matmuls of the work
actually requested — recomputation (activation checkpointing) is never counted. The peak is the dense
datasheet rate: sparse figures (1,979 TFLOP/s for H100/H200) would halve every MFU. On a device that is
not in the table (a CPU, say) MFU is reported only when `train.peak_tflops` gives the peak.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

# Dense bf16 tensor-core peaks, TFLOP/s, by a substring of torch.cuda.get_device_name().
# Order matters: the first match wins ("H100 PCIe" before "H100").
PEAK_BF16_TFLOPS: list[tuple[str, float]] = [
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10G", 70.0),
    ("RTX 4090", 165.0),
    ("RTX 3090", 71.0),
]


def device_peak_flops(device: torch.device, override_tflops: float = 0.0) -> float | None:
    """FLOP/s peak of `device`, or None when it is unknown (then MFU is not reported)."""
    if override_tflops > 0:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in name:
            return tflops * 1e12
    return None


@dataclass
class Rate:
    """Throughput over one measured interval (one or more optimizer steps)."""

    units_per_s: float  # tokens/s (designer) or images/s (imagegen)
    flops_per_s: float
    mfu: float | None  # fraction of the peak, None when the peak is unknown
    step_time: float  # seconds per optimizer step in the interval


class ThroughputMeter:
    """Work and time between measurements.

    The step itself never synchronises with the device; the trainer calls `measure()` only right after
    a host sync (reading the logged loss), so the interval's wall time covers exactly its queued work.
    """

    def __init__(self, peak_flops: float | None):
        self.peak_flops = peak_flops
        self.history: list[Rate] = []
        self.restart_clock()

    def restart_clock(self) -> None:
        """Start a new interval (after eval or checkpoint pauses, which are not training time)."""
        self._start = time.perf_counter()
        self._units = self._flops = self._steps = 0

    def add(self, units: int, flops: int) -> None:
        self._units += units
        self._flops += flops
        self._steps += 1

    def measure(self) -> Rate | None:
        if self._steps == 0:
            return None
        dt = max(time.perf_counter() - self._start, 1e-9)
        flops_s = self._flops / dt
        rate = Rate(
            units_per_s=self._units / dt,
            flops_per_s=flops_s,
            mfu=flops_s / self.peak_flops if self.peak_flops else None,
            step_time=dt / self._steps,
        )
        self.history.append(rate)
        self.restart_clock()
        return rate

    def summary(self) -> dict[str, float | None]:
        """Median over the measured intervals, the first (warm-up, compilation) left out when others exist."""
        rates = self.history[1:] or self.history
        if not rates:
            return {}
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        mfus = [r.mfu for r in rates if r.mfu is not None]
        return {
            "units_per_s": med([r.units_per_s for r in rates]),
            "flops_per_s": med([r.flops_per_s for r in rates]),
            "step_time": med([r.step_time for r in rates]),
            "mfu": med(mfus) if mfus else None,
        }
