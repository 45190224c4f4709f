"""Shared assertions for kernel tests: closeness (on failure: mismatch count, first indices, max/mean diff,
NaN/inf), error within a multiple of eager PyTorch's, and no leak across a packed document boundary."""
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


# A leak is an O(1) relative change; a bound looser than this could mistake a weak one for rounding.
LEAK_BOUND_CEILING = 1e-3


def leak_tolerance(alone: torch.Tensor, dtype: torch.dtype, terms: int) -> float:
    """The largest rounding difference between a document computed alone and inside a packed row.

    Both runs do the same arithmetic on the same values; packing only changes the layout (batch sizes, BLAS
    blockings, vector widths), i.e. the order in which each output's sums are added. Reordering a sum of n terms
    moves it by at most n · eps · Σ|terms| (the classical bound for recursive summation, eps the dtype's machine
    epsilon), and Σ|terms| is taken here as the output's scale, max |alone|. `terms` is the caller's stated n: how
    many roundings can pile up along the computation (its longest reduction, times its depth). The bound may not
    exceed LEAK_BOUND_CEILING of the scale, so no choice of `terms` lets a leak pass as rounding."""
    eps = torch.finfo(dtype).eps
    if terms < 1 or terms * eps > LEAK_BOUND_CEILING:
        raise ValueError(f"leak_tolerance: {terms} terms × eps {eps:.1e} ({dtype}) is above {LEAK_BOUND_CEILING:g} of "
                         f"the output's scale: such a bound cannot tell a leak from rounding")
    return terms * eps * max(alone.detach().abs().max().item(), torch.finfo(dtype).tiny)


def assert_no_leak(packed: torch.Tensor, alone: torch.Tensor, what: str, dtype: torch.dtype, terms: int) -> None:
    """`packed` (a document's output or gradient computed inside a packed row) equals `alone` (the same document
    on its own) up to rounding, so nothing of another document reached it.

    Passes for reordered sums (leak_tolerance: `terms` · eps(dtype) · max |alone|); fails for a leak, which moves
    the first tokens after a boundary by O(1) of the output's scale. `dtype` is the precision the computation
    runs in (fp32 for the kernels' references, whatever their input dtype). The failure message prints the
    difference in units of the bound and where it is largest."""
    a, e = packed.detach().double(), alone.detach().double()
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    bound = leak_tolerance(alone, dtype, terms)
    diff = (a - e).abs()
    if not torch.isfinite(a).all() or diff.max().item() > bound:
        where = [int(i) for i in torch.unravel_index(diff.flatten().argmax(), diff.shape)]
        raise AssertionError(f"{what}: packed differs from alone by {diff.max():.3e} at {where} "
                             f"({diff.max().item() / bound:.1f}× the rounding bound {bound:.3e} = {terms} terms × "
                             f"eps({dtype}) × max|alone| {e.abs().max():.3e}); {int((diff > bound).sum())}/"
                             f"{a.numel()} elements beyond it: a leak across the document boundary")
