"""Shared assertion for kernel tests: on failure print mismatch count, first indices, max/mean diff, NaN/inf."""
from __future__ import annotations

import torch


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, what: str) -> None:
    a, e = actual.detach().double(), expected.detach().double()
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    bad = ~torch.isclose(a, e, atol=atol, rtol=rtol) | ~torch.isfinite(a)
    if bad.any():
        diff = (a - e).abs()
        idx = bad.nonzero()[:5].tolist()
        raise AssertionError(f"{what}: {int(bad.sum())}/{a.numel()} mismatches (atol={atol}, rtol={rtol}); first at {idx}; "
                             f"max diff {diff.max():.3e}, mean diff {diff.mean():.3e}; nan {int(a.isnan().sum())}, "
                             f"inf {int(a.isinf().sum())}")
