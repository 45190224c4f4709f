"""The shared assertions of tests/kernels/_compare.py on known differences: each passes for rounding of the size
it allows and fails beyond it, so a relaxed bound still catches what it is there for."""
import pytest
import torch

from tests.kernels._compare import LEAK_BOUND_CEILING, assert_error_within, assert_no_leak, assert_within_rounding

EPS = torch.finfo(torch.float32).eps


def _alone() -> torch.Tensor:
    return torch.randn(50, 4, 8, generator=torch.Generator().manual_seed(0))


def test_the_leak_check_passes_rounding_and_fails_a_leak_of_its_first_tokens():
    alone = _alone()
    scale = alone.abs().max()
    rounded = alone + (torch.rand(alone.shape, generator=torch.Generator().manual_seed(1)) - 0.5) * 2 * EPS * scale
    assert_no_leak(rounded, alone, "1 ulp of the scale everywhere", torch.float32, terms=4)
    leaked = alone.clone()
    leaked[:3] += 0.3 * scale  # the first tokens after the boundary see the previous document
    with pytest.raises(AssertionError, match=r"at \[[0-2], .*a leak across the document boundary"):
        assert_no_leak(leaked, alone, "leaked", torch.float32, terms=256)
    faint = alone.clone()
    faint[0, 0, 0] += 100 * 256 * EPS * scale  # a leak 100x the bound on a single element still fails
    with pytest.raises(AssertionError, match="100.0× the rounding bound"):
        assert_no_leak(faint, alone, "faint", torch.float32, terms=256)
    nan = alone.clone()
    nan[5, 0, 0] = float("nan")
    with pytest.raises(AssertionError):
        assert_no_leak(nan, alone, "nan", torch.float32, terms=256)


def test_the_leak_check_refuses_a_bound_too_loose_to_tell_a_leak_from_rounding():
    alone = _alone()
    too_many = int(LEAK_BOUND_CEILING / EPS) + 1
    with pytest.raises(ValueError, match="cannot tell a leak from rounding"):
        assert_no_leak(alone, alone, "loose", torch.float32, terms=too_many)
    with pytest.raises(ValueError, match="cannot tell a leak from rounding"):
        assert_no_leak(alone, alone, "bf16", torch.bfloat16, terms=1)  # bf16's eps alone is above the ceiling
    with pytest.raises(ValueError, match="terms must be >= 1"):
        assert_within_rounding(alone, alone, "no terms", torch.float32, terms=0)


def test_the_eager_rule_floors_at_one_rounding_of_the_precision():
    """A result off by less than one fp16 rounding of the scale passes even where eager happened to be exact;
    1.5 roundings fails when eager is exact (the floor is one rounding, not more)."""
    e = torch.linspace(-40, 40, 101, dtype=torch.float64)
    one_rounding = torch.finfo(torch.float16).eps * 40
    assert_error_within(e + 0.9 * one_rounding, e, e.clone(), "within one rounding", dtype=torch.float16)
    with pytest.raises(AssertionError, match="beyond"):
        assert_error_within(e + 1.5 * one_rounding, e, e.clone(), "1.5 roundings", dtype=torch.float16)
