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


def assert_error_within(actual: torch.Tensor, expected: torch.Tensor, baseline: torch.Tensor, what: str,
                        factor: float = 2.0, atol: float = 1e-6) -> None:
    """FlashAttention's rule: max |actual − expected| ≤ factor · max |baseline − expected| + atol.

    `expected` is the high-precision reference, `baseline` eager PyTorch in the kernel's dtype.
    """
    a, e, b = actual.detach().double(), expected.detach().double(), baseline.detach().double()
    assert a.shape == e.shape == b.shape, f"{what}: shapes {tuple(a.shape)}, {tuple(e.shape)}, {tuple(b.shape)}"
    err, base = (a - e).abs(), (b - e).abs()
    bound = factor * base.max().item() + atol
    if not torch.isfinite(a).all() or err.max().item() > bound:
        bad = (err > bound) | ~torch.isfinite(a)
        idx = bad.nonzero()[:5].tolist()
        raise AssertionError(f"{what}: {int(bad.sum())}/{a.numel()} beyond {factor}×eager error + {atol} "
                             f"(bound {bound:.3e}); first at {idx}; max diff {err.max():.3e} (eager {base.max():.3e}), "
                             f"mean diff {err.mean():.3e} (eager {base.mean():.3e}); nan {int(a.isnan().sum())}, "
                             f"inf {int(a.isinf().sum())}")
