"""Shared assertions for kernel tests: closeness (on failure: mismatch count, first indices, max/mean diff,
NaN/inf), error within a multiple of eager PyTorch's, equality up to reordered sums, and no leak across a packed
document boundary."""
from __future__ import annotations

import torch


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, what: str) -> None:
    a, e = actual.detach().double(), expected.detach().double()
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    bad = ~torch.isclose(a, e, atol=atol, rtol=rtol) | ~torch.isfinite(a)
    if bad.any():
        diff = (a - e).abs()
        idx = bad.nonzero()[:5].tolist()
        raise AssertionError(f"{what}: {int(bad.sum())}/{a.numel()} mismatches (atol={atol}, rtol={rtol}); "
                             f"first at {idx}; "
                             f"max diff {diff.max():.3e}, mean diff {diff.mean():.3e}; nan {int(a.isnan().sum())}, "
                             f"inf {int(a.isinf().sum())}")


def assert_error_within(actual: torch.Tensor, expected: torch.Tensor, baseline: torch.Tensor, what: str,
                        factor: float = 2.0, atol: float = 1e-6, dtype: torch.dtype | None = None) -> None:
    """FlashAttention's rule: max |actual − expected| ≤ factor · max |baseline − expected| + floor.

    `expected` is the high-precision reference, `baseline` eager PyTorch in the kernel's dtype. The floor is the
    larger of `atol` and one rounding of the actual's dtype at the output's scale (eps · max |expected|): both
    results are rounded to that dtype, so either may be off by up to that much at its largest elements whatever
    the other's luck; eager's maximum error depends on where its roundings happen to fall (and, for reductions,
    on the order this CPU adds in), so without the floor a kernel exactly as accurate could fail on a machine
    where eager rounds luckily. A wrong kernel is off by O(1) of the scale, far above it. `dtype`: the precision
    the result was computed in, where that is not its own dtype (an fp32 gradient computed under bf16 autocast).
    """
    a, e, b = actual.detach().double(), expected.detach().double(), baseline.detach().double()
    assert a.shape == e.shape == b.shape, f"{what}: shapes {tuple(a.shape)}, {tuple(e.shape)}, {tuple(b.shape)}"
    err, base = (a - e).abs(), (b - e).abs()
    precision = dtype or (actual.dtype if actual.is_floating_point() else torch.float64)
    floor = max(atol, torch.finfo(precision).eps * e.abs().max().item())
    bound = factor * base.max().item() + floor
    if not torch.isfinite(a).all() or err.max().item() > bound:
        bad = (err > bound) | ~torch.isfinite(a)
        idx = bad.nonzero()[:5].tolist()
        raise AssertionError(f"{what}: {int(bad.sum())}/{a.numel()} beyond {factor}×eager error + {floor:.3e} "
                             f"(bound {bound:.3e}); first at {idx}; max diff {err.max():.3e} (eager {base.max():.3e}), "
                             f"mean diff {err.mean():.3e} (eager {base.mean():.3e}); nan {int(a.isnan().sum())}, "
                             f"inf {int(a.isinf().sum())}")


def rounding_tolerance(expected: torch.Tensor, dtype: torch.dtype, terms: int) -> float:
    """The largest difference between two computations of the same math in `dtype` that add in other orders.

    Reordering a sum of n terms moves it by at most n · eps · Σ|terms| (the classical bound for recursive
    summation, eps the dtype's machine epsilon), with Σ|terms| taken as the output's scale, max |expected|.
    `terms` is the caller's stated n: how many roundings can pile up along the computation (its longest
    reduction, times its depth)."""
    if terms < 1:
        raise ValueError(f"rounding_tolerance: terms must be >= 1, got {terms}")
    return terms * torch.finfo(dtype).eps * max(expected.detach().abs().max().item(), torch.finfo(dtype).tiny)


def assert_within_rounding(actual: torch.Tensor, expected: torch.Tensor, what: str, dtype: torch.dtype, terms: int,
                           why: str = "beyond rounding") -> None:
    """max |actual − expected| ≤ rounding_tolerance(expected, dtype, terms): the same math in the same dtype, done
    in another order (another kernel, layout or blocking). `dtype` is the precision the computation runs in.
    The failure message gives the difference in units of the bound and where it is largest."""
    a, e = actual.detach().double(), expected.detach().double()
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    bound = rounding_tolerance(expected, dtype, terms)
    diff = (a - e).abs()
    if not torch.isfinite(a).all() or diff.max().item() > bound:
        where = [int(i) for i in torch.unravel_index(diff.flatten().argmax(), diff.shape)]
        raise AssertionError(f"{what}: differs by {diff.max():.3e} at {where} ({diff.max().item() / bound:.1f}× the "
                             f"rounding bound {bound:.3e} = {terms} terms × eps({dtype}) × max|expected| "
                             f"{e.abs().max():.3e}); {int((diff > bound).sum())}/{a.numel()} elements beyond it: {why}")


# A leak is an O(1) relative change; a bound looser than this could mistake a weak one for rounding.
LEAK_BOUND_CEILING = 1e-3


def assert_no_leak(packed: torch.Tensor, alone: torch.Tensor, what: str, dtype: torch.dtype, terms: int) -> None:
    """`packed` (a document's output or gradient computed inside a packed row) equals `alone` (the same document
    on its own) up to rounding, so nothing of another document reached it.

    Both runs do the same arithmetic on the same values; packing only changes the layout (batch sizes, BLAS
    blockings, vector widths), i.e. the order of each output's sums, so they may differ by
    rounding_tolerance(alone, dtype, terms). A leak (state, conv taps or attention keys of the previous document
    reaching this one) moves the first tokens after a boundary by O(1) of the output's scale. The bound may not
    exceed LEAK_BOUND_CEILING of that scale, so no choice of `terms` lets a leak pass as rounding. `dtype` is the
    precision the computation runs in (fp32 for the kernels' references, whatever their input dtype)."""
    eps = torch.finfo(dtype).eps
    if terms * eps > LEAK_BOUND_CEILING:
        raise ValueError(f"assert_no_leak: {terms} terms × eps {eps:.1e} ({dtype}) is above {LEAK_BOUND_CEILING:g} of "
                         f"the output's scale: such a bound cannot tell a leak from rounding")
    assert_within_rounding(packed, alone, f"{what} (packed vs alone)", dtype, terms,
                           why="a leak across the document boundary")
