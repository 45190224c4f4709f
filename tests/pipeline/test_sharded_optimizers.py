"""pipeline/sharded_adafactor.py and pipeline/sharded_prodigy.py on whole (plain) tensors: every sum over ranks is
then the identity, and each is its library's optimizer op for op, so weights, states and step-size estimates equal
the library's bit for bit. Sharded over 2 processes they are compared with the library's on the whole tensors in
tests/pipeline/test_optimizers.py (test_two_process_shards_step_as_whole_tensors), and resumed there."""

from __future__ import annotations

import copy

import pytest
import torch
from prodigyopt import Prodigy

from atelier_studio.pipeline.distributed import DistributedError
from atelier_studio.pipeline.sharded_adafactor import ShardedAdafactor
from atelier_studio.pipeline.sharded_prodigy import ShardedProdigy

from tests.pipeline.optim_dist_worker import SHAPES

STEPS = 6


def twin_params() -> tuple[dict[str, torch.nn.Parameter], dict[str, torch.nn.Parameter]]:
    g = torch.Generator().manual_seed(0)
    ref = {n: torch.nn.Parameter(torch.zeros(s) if n == "zero" else torch.randn(s, generator=g))
           for n, s in SHAPES.items()}
    return ref, {n: torch.nn.Parameter(p.detach().clone()) for n, p in ref.items()}


def groups(params: dict[str, torch.nn.Parameter]) -> list[dict]:
    """Weight decay on the tensors of 2 or more dims, as pipeline/optimizers.py groups them."""
    return [{"params": [p for p in params.values() if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in params.values() if p.ndim < 2], "weight_decay": 0.0}]


def step_both(ref_opt: torch.optim.Optimizer, opt: torch.optim.Optimizer, ref: dict, ours: dict) -> None:
    """STEPS steps of both on the same gradients: a steady direction plus noise (Prodigy's estimate of d grows)."""
    g = torch.Generator().manual_seed(1)
    drift = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    for _ in range(STEPS):
        for n, s in SHAPES.items():
            ref[n].grad = drift[n] + 0.5 * torch.randn(s, generator=g)
            ours[n].grad = ref[n].grad.clone()
        ref_opt.step()
        opt.step()


def assert_same(ref_opt: torch.optim.Optimizer, opt: torch.optim.Optimizer, ref: dict, ours: dict) -> None:
    for n in SHAPES:
        assert torch.equal(ref[n], ours[n]), n
        want, got = ref_opt.state[ref[n]], opt.state[ours[n]]
        assert want.keys() == got.keys(), n
        for k, v in want.items():
            w = got[k]
            if torch.is_tensor(v) and v.shape != w.shape:  # prodigyopt's flat s and p0; a scalar 0 p0 when all-zero
                v = v.reshape(w.shape) if v.ndim else v.expand(w.shape)
            assert torch.equal(v, w) if torch.is_tensor(v) else v == w, (n, k)
    for a, b in zip(ref_opt.param_groups, opt.param_groups):
        assert {k: v for k, v in a.items() if k != "params"} == {k: v for k, v in b.items() if k != "params"}


@pytest.mark.parametrize("eps1, maximize", [(None, False), (1e-20, True)])
def test_adafactor_on_whole_tensors_is_torchs(eps1, maximize):
    ref, ours = twin_params()
    settings = {"lr": 1e-2, "eps": (eps1, 1e-3), "maximize": maximize, "beta2_decay": -0.8, "d": 1.0}
    ref_opt, opt = torch.optim.Adafactor(groups(ref), **settings), ShardedAdafactor(groups(ours), **settings)
    before = ours["matrix"].detach().clone()
    step_both(ref_opt, opt, ref, ours)
    assert_same(ref_opt, opt, ref, ours)
    assert not torch.equal(before, ours["matrix"])


@pytest.mark.parametrize("settings", [{}, {"use_bias_correction": True, "beta3": 0.9},
                                      {"decouple": False, "betas": (0.0, 0.99), "safeguard_warmup": True}])
def test_prodigy_on_whole_tensors_is_prodigyopts(settings):
    """prodigyopt's defaults; bias correction; coupled decay without a first moment, with the warm-up safeguard."""
    ref, ours = twin_params()
    settings = {"lr": 1.0, "d0": 1e-6, **settings}
    ref_opt, opt = Prodigy(groups(ref), **settings), ShardedProdigy(groups(ours), **settings)
    step_both(ref_opt, opt, ref, ours)
    assert_same(ref_opt, opt, ref, ours)
    assert opt.param_groups[0]["d"] > 1e-6, "the step-size estimate did not grow: the sums were not exercised"


def test_prodigy_continues_from_prodigyopts_own_state():
    """A one-process checkpoint in prodigyopt's layout (flat s and p0, p0 a scalar zero for the all-zero matrix)
    loads, and the run goes on as prodigyopt's would, bit for bit."""
    ref, ours = twin_params()
    ref_opt = Prodigy(groups(ref), lr=1.0)
    step_both(ref_opt, torch.optim.SGD(groups(ours), lr=0.0), ref, ours)
    with torch.no_grad():
        for n in SHAPES:
            ours[n].copy_(ref[n])
    opt = ShardedProdigy(groups(ours), lr=1.0)
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))  # a copy, as from a file: state_dict() shares tensors
    assert ref_opt.state[ref["zero"]]["p0"].ndim == 0 and ref_opt.state[ref["matrix"]]["s"].ndim == 1
    step_both(ref_opt, opt, ref, ours)
    assert_same(ref_opt, opt, ref, ours)


def test_prodigy_refuses_what_it_cannot_sum(monkeypatch):
    """Every entry (slice_p 1), and one set of ranks for all parameters: the step-size sums are over all of them."""
    with pytest.raises(ValueError, match="slice_p must be 1"):
        ShardedProdigy([torch.nn.Parameter(torch.ones(3))], slice_p=11)
    from atelier_studio.pipeline import sharded_prodigy

    monkeypatch.setattr(sharded_prodigy, "shard_groups", lambda p: ("ranks 0-1",) if p.ndim == 2 else ())
    with pytest.raises(DistributedError, match=r"'prodigy' sums its step-size estimate over every parameter"):
        ShardedProdigy([torch.nn.Parameter(torch.ones(3, 2)), torch.nn.Parameter(torch.ones(3))])
    ShardedProdigy([torch.nn.Parameter(torch.ones(3, 2)), torch.nn.Parameter(torch.ones(2, 2))])
