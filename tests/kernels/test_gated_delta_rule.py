import pytest
import torch
import torch.nn.functional as F

import atelier_studio.kernels.gated_delta_rule as gdr
from atelier_studio.kernels.gated_delta_rule import gated_delta_rule, gated_delta_rule_ref

from tests.kernels._compare import assert_close, assert_no_leak


def _cu(lens: list[int], device: str = "cpu") -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)


def _recurrent(q, k, v, g, beta, lens, carry: float = 0.0):
    """The recurrence of the module docstring, token by token, each document from a zero state (any dtype).

    `carry` > 0 makes it leak on purpose: a document then starts from carry × the previous one's final state."""
    rep = v.shape[1] // q.shape[1]
    q = q.repeat_interleave(rep, 1) / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6).repeat_interleave(rep, 1)
    k = k.repeat_interleave(rep, 1) / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6).repeat_interleave(rep, 1)
    q = q * q.shape[-1] ** -0.5
    out, t = [], 0
    s = q.new_zeros(v.shape[1], q.shape[-1], v.shape[-1])  # [Hv, Dk, Dv]
    for n in lens:
        s = s * carry
        for _ in range(n):
            s = s * g[t].exp()[:, None, None]
            delta = (v[t] - torch.einsum("hkv,hk->hv", s, k[t])) * beta[t][:, None]
            s = s + k[t][:, :, None] * delta[:, None, :]
            out.append(torch.einsum("hkv,hk->hv", s, q[t]))
            t += 1
    return torch.stack(out)


# fla autotunes each kernel once per head layout (its autotune keys are H, HV, K, V), and that was most of the GPU
# fast tier's time; so every fast-tier fla test uses this one layout: the tiny models' head counts with key dim
# 128 (the dim fla trains on Hopper) and value dim 64. The slow tier runs Qwen3.5-9B's.
FAST_HEADS = (2, 4, 128, 64)
QWEN35_9B_HEADS = (16, 32, 128, 128)


def _inputs(lens, hk, hv, dk, dv, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    q = torch.randn(n, hk, dk, generator=g, dtype=torch.float64)
    k = torch.randn(n, hk, dk, generator=g, dtype=torch.float64)
    v = torch.randn(n, hv, dv, generator=g, dtype=torch.float64)
    # log-decay as the model makes it: −exp(A_log)·softplus(a + dt_bias), some near 0 (long memory), some strong
    logd = -torch.rand(hv, generator=g, dtype=torch.float64).mul(3).exp() * F.softplus(
        torch.randn(n, hv, generator=g, dtype=torch.float64))
    beta = torch.rand(n, hv, generator=g, dtype=torch.float64)
    return [t.to(device) for t in (q, k, v, logd, beta)]


# lengths around the 64-token chunk: a chunk boundary, one past it, a single token, two chunks and a bit
CASES = [([5], 1, 1, 4, 4), ([64, 65, 1, 130], 2, 4, 16, 24), ([3, 70, 7], 3, 3, 8, 5), ([128], 1, 2, 32, 16)]


@pytest.mark.parametrize("lens,hk,hv,dk,dv", CASES)
def test_ref_equals_the_recurrence_with_grads(lens, hk, hv, dk, dv):
    leaves = _inputs(lens, hk, hv, dk, dv)
    dy = torch.randn(sum(lens), hv, dv, generator=torch.Generator().manual_seed(9), dtype=torch.float64)

    def go(fn, dt):
        xs = [t.to(dt).requires_grad_() for t in leaves]
        y = fn(*xs)
        return [y, *torch.autograd.grad((y.double() * dy).sum(), xs)]

    got = go(lambda *xs: gated_delta_rule_ref(*xs, _cu(lens)), torch.float32)
    exp = go(lambda *xs: _recurrent(*xs, lens), torch.float64)
    assert got[0].dtype == torch.float32
    for name, a, e in zip(["o", "dq", "dk", "dv", "dg", "dbeta"], got, exp):
        assert_close(a, e, atol=5e-5, rtol=5e-4, what=f"{name} {lens}")


# The leak check's rounding bound for the fp32 reference: its longest reductions are a chunk long (64 terms: the
# intra-chunk products and the triangular solves), chained over four stages (solve, the state's update, the
# inter- and intra-chunk outputs) — 256 terms, 3e-5 of the output's scale. A state that survives the boundary
# moves the next document's first outputs by O(1) of it (28% in LEAK_CASE).
DELTA_RULE_TERMS = 4 * gdr.CHUNK
LEAK_CASE = dict(lens=[50, 90], hk=2, hv=4, dk=8, dv=8, seed=3)


def _packed_and_alone(lens, hk, hv, dk, dv, seed):
    """The second document's output inside the packed row and on its own (the fp32 reference both times)."""
    q, k, v, g, beta = _inputs(lens, hk, hv, dk, dv, seed=seed)
    packed = gated_delta_rule_ref(q, k, v, g, beta, _cu(lens))
    alone = gated_delta_rule_ref(*(t[lens[0]:] for t in (q, k, v, g, beta)), _cu(lens[1:]))
    return (q, k, v, g, beta), packed[lens[0]:], alone


def test_state_restarts_at_every_document():
    """A document's output is the same alone and after another document in the row, up to rounding: the two
    runs batch the chunks differently (two documents side by side vs one), so BLAS may add in another order."""
    _, packed, alone = _packed_and_alone(**LEAK_CASE)
    assert_no_leak(packed, alone, "delta rule, 2nd document packed vs alone", torch.float32, DELTA_RULE_TERMS)


def test_the_leak_check_fails_for_a_state_that_is_not_reset():
    """The check above, fed delta rules that leak on purpose, fails: the packed row run as one document (the
    state never reset), and the token-by-token recurrence carrying 1e-3 of the previous document's state."""
    (q, k, v, g, beta), _, alone = _packed_and_alone(**LEAK_CASE)
    lens = LEAK_CASE["lens"]
    never_reset = gated_delta_rule_ref(q, k, v, g, beta, _cu([sum(lens)]))[lens[0]:]
    with pytest.raises(AssertionError, match="leak across the document boundary"):
        assert_no_leak(never_reset, alone, "state never reset", torch.float32, DELTA_RULE_TERMS)
    weak = _recurrent(q, k, v, g, beta, lens, carry=1e-3)[lens[0]:]
    assert_no_leak(_recurrent(q, k, v, g, beta, lens)[lens[0]:], alone, "fp64 recurrence, reset", torch.float32,
                   DELTA_RULE_TERMS)  # the same recurrence without the leak passes: what fails below is the leak
    with pytest.raises(AssertionError, match="leak across the document boundary"):
        assert_no_leak(weak, alone, "1e-3 of the state carried over", torch.float32, DELTA_RULE_TERMS)


def test_auto_is_the_reference_on_cpu_and_fla_fails_loudly(monkeypatch):
    q, k, v, g, beta = (t.float() for t in _inputs([7, 3], 1, 2, 4, 4))
    cu = _cu([7, 3])
    # exact: "auto" on the CPU is the reference, so this is the same call on the same inputs twice
    assert torch.equal(gated_delta_rule(q, k, v, g, beta, cu), gated_delta_rule_ref(q, k, v, g, beta, cu))
    monkeypatch.setattr(gdr, "has_fla", lambda: False)
    with pytest.raises(RuntimeError, match="pip install fla-core"):
        gated_delta_rule(q, k, v, g, beta, cu, impl="fla")


def test_bad_inputs():
    q, k, v, g, beta = (t.float() for t in _inputs([6], 2, 4, 4, 4))
    with pytest.raises(ValueError, match="multiple"):
        gated_delta_rule(q, k, v[:, :3], g[:, :3], beta[:, :3], _cu([6]))
    with pytest.raises(ValueError, match="beta"):
        gated_delta_rule(q, k, v, g, beta[:, :1], _cu([6]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        gated_delta_rule(q, k, v, g, beta, torch.tensor([0, 6]))
    with pytest.raises(ValueError, match="rise from 0 to N"):
        gated_delta_rule_ref(q, k, v, g, beta, _cu([5]))
    with pytest.raises(ValueError, match="impl"):
        gated_delta_rule(q, k, v, g, beta, _cu([6]), impl="triton")
    with pytest.raises(ValueError, match=r"chunks must be chunk_index\(cu_seqlens\) of these 6 tokens and 1 doc"):
        gated_delta_rule(q, k, v, g, beta, _cu([6]), chunks=gdr.chunk_index(_cu([3, 3])))
    with pytest.raises(ValueError, match="in chunks of 64; got .* chunks of 2"):
        gated_delta_rule(q, k, v, g, beta, _cu([6]), chunks=gdr.chunk_index(_cu([6]), chunk=2))


def test_chunk_index_lists_each_documents_chunks_in_order():
    """(document, chunk within it) for every 64-token block: a document of 64 is one chunk, 65 two, 1 one,
    an empty one (padding segment) none; the rows past the index pad it to a length set by N and S alone."""
    lens = [64, 65, 1, 0, 130]
    expect = [[d, c] for d, n in enumerate(lens) for c in range(-(-n // gdr.CHUNK))]
    got = gdr.chunk_index(_cu(lens))
    assert got.rows.dtype == torch.long and got.index().tolist() == expect
    assert got.count.device.type == "cpu" and int(got.count) == len(expect)
    assert got.rows.shape == (sum(lens) // gdr.CHUNK + len(lens), 2) and not got.rows[len(expect):].any()
    other = gdr.chunk_index(_cu([1] * 4 + [256]))  # same N and S, different documents: same row count
    assert other.rows.shape == got.rows.shape and int(other.count) == 8
    assert gdr.chunk_index(_cu([5, 3]), chunk=2).index().tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1]]


# --- the fast path on the GPU (fla-core) ------------------------------------------------------------
def _rms_ratio(a: torch.Tensor, e: torch.Tensor) -> float:
    """fla's own test criterion: RMS(a − e) / RMS(e)."""
    a, e = a.double(), e.double()
    return float((a - e).pow(2).mean().sqrt() / e.pow(2).mean().sqrt().clamp_min(1e-30))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(not gdr.has_fla(), reason="needs fla-core (pip install fla-core)")
@pytest.mark.parametrize("lens, heads", [
    pytest.param([300, 1, 64, 65, 500, 97], FAST_HEADS, id="small"),
    pytest.param([700, 1348, 2048, 1, 63, 64, 65, 1855, 37, 2011], QWEN35_9B_HEADS, id="qwen3.5-9b",
                 marks=pytest.mark.slow)])
def test_fla_matches_the_reference(lens, heads):
    """bf16, uneven packed documents: the fast tier at the shared small head layout, the slow tier at
    Qwen3.5-9B's heads (Hk 16, Hv 32, Dk = Dv = 128) on four packed rows of 2048."""
    for name, ratio in _fla_vs_reference(lens, heads).items():
        print(f"fla vs reference, {sum(lens)} tokens, heads {heads}, {name}: RMS ratio {ratio:.2e}")


def _fla_vs_reference(lens: list[int], heads: tuple[int, int, int, int] = FAST_HEADS) -> dict[str, float]:
    """RMS ratios of fla's output and every gradient against the fp32 reference (asserted under fla's own
    tolerances: the gate gradients sum bf16 products over whole chunks, twice the others' error)."""
    hk, hv, dk, dv = heads
    leaves = [t.to(torch.bfloat16) for t in _inputs(lens, hk, hv, dk, dv, device="cuda")]
    leaves[3] = leaves[3].float()  # the model's log-decay is fp32
    dy = torch.randn(sum(lens), hv, dv, device="cuda", dtype=torch.bfloat16)
    cu = _cu(lens, "cuda")

    def go(impl):
        xs = [t.clone().requires_grad_() for t in leaves]
        y = gated_delta_rule(*xs, cu, impl=impl)
        return [y, *torch.autograd.grad((y.float() * dy.float()).sum(), xs)]

    fast, ref = go("fla"), go("ref")
    limits = {"o": 1e-2, "dq": 1e-2, "dk": 1e-2, "dv": 1e-2, "dg": 2e-2, "dbeta": 2e-2}
    ratios = {}
    for (name, limit), a, e in zip(limits.items(), fast, ref):
        assert torch.isfinite(a).all(), name
        ratios[name] = _rms_ratio(a, e)
        assert ratios[name] < limit, f"{name}: RMS ratio {ratios[name]:.2e}"
    return ratios


@pytest.mark.gpu
@pytest.mark.slow  # compiles the kernel once per autotune configuration
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(not gdr.has_fla(), reason="needs fla-core (pip install fla-core)")
def test_fla_backward_is_right_under_every_autotune_config(monkeypatch):
    """The kernel fla's #640 guard is about (chunk_bwd_kernel_dqkwg) is autotuned: a run may pick any of its
    configs, so where Atelier lifts the guard each one is checked, one at a time."""
    import fla.ops.common.chunk_o as chunk_o

    tuner = chunk_o.chunk_bwd_kernel_dqkwg
    while not (hasattr(tuner, "configs") and hasattr(tuner, "cache")):  # heuristics wrap the autotuner
        tuner = tuner.fn
    configs = list(tuner.configs)
    try:
        for config in configs:
            monkeypatch.setattr(tuner, "configs", [config])
            tuner.cache.clear()
            ratios = _fla_vs_reference([300, 1, 64, 65, 500, 97])
            print(f"chunk_bwd_kernel_dqkwg {config}: worst RMS ratio {max(ratios.values()):.2e}")
    finally:
        tuner.cache.clear()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_on_cuda_bf16_uses_fla_or_says_what_to_install(monkeypatch):
    q, k, v, g, beta = (t.to("cuda", torch.bfloat16) for t in _inputs([70, 9], *FAST_HEADS))
    cu = _cu([70, 9], "cuda")
    if gdr.has_fla():
        o = gated_delta_rule(q, k, v, g.float(), beta, cu)
        assert _rms_ratio(o, gated_delta_rule_ref(q, k, v, g, beta, cu)) < 1e-2
    monkeypatch.setattr(gdr, "has_fla", lambda: False)
    with pytest.raises(RuntimeError, match="pip install fla-core"):
        gated_delta_rule(q, k, v, g, beta, cu)


# --- fla's Hopper guard (fla issue #640) -------------------------------------------------------------
def test_hopper_guard_lifts_only_for_key_tiles_of_128():
    act, bf16 = gdr.hopper_guard_action, torch.bfloat16
    assert act((9, 0), (3, 6, 0), 128, bf16) == "lift"  # the H200 here: Qwen3.5's key head dim
    assert act((9, 0), (3, 6, 0), 100, bf16) == "lift"  # tiled by 128 too (the issue's own case)
    assert act((9, 0), (3, 6, 0), 128, torch.float16) == "refuse"  # fp16 was not checked
    assert act((9, 0), (3, 6, 0), 64, bf16) == "refuse"  # the miscompiled tile
    assert act((9, 0), (3, 4, 0), 16, bf16) == "refuse"
    assert act((9, 0), (3, 6, 0), 256, bf16) == "refuse"  # two key tiles: not what was checked
    assert act((9, 0), (3, 6, 0), 64, bf16, tilelang=True) == "none"  # fla's tilelang backend takes the kernel
    assert act((9, 0), (3, 7, 1), 64, bf16) == "none"  # fixed in Triton 3.7.1
    assert act((9, 0), (3, 3, 1), 64, bf16) == "none"  # before the regression
    assert act((8, 0), (3, 6, 0), 64, bf16) == "none"  # not Hopper
    assert act((10, 0), (3, 6, 0), 64, bf16) == "none"


def test_the_lift_is_restored_after_errors_and_overlapping_backwards(monkeypatch):
    """fla's flag is set while any lifted block runs and restored when the last one leaves, error or not."""
    import sys
    import types

    chunk_o = types.SimpleNamespace(TRITON_ABOVE_3_7_1=False)
    for name, mod in (("fla", types.ModuleType("fla")), ("fla.ops", types.ModuleType("fla.ops")),
                      ("fla.ops.common", types.ModuleType("fla.ops.common")), ("fla.ops.common.chunk_o", chunk_o)):
        monkeypatch.setitem(sys.modules, name, mod)
    sys.modules["fla.ops.common"].chunk_o = chunk_o
    monkeypatch.setattr(gdr, "hopper_guard", lambda device, dk, dtype: "lift")
    cpu = torch.device("cpu")
    with pytest.raises(ZeroDivisionError):
        with gdr.fla_guard_lifted(128, cpu):
            assert chunk_o.TRITON_ABOVE_3_7_1
            1 / 0
    assert chunk_o.TRITON_ABOVE_3_7_1 is False
    outer, inner = gdr.fla_guard_lifted(128, cpu), gdr.fla_guard_lifted(128, cpu)
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)  # the first to enter leaves first: the other still needs the lift
    assert chunk_o.TRITON_ABOVE_3_7_1
    inner.__exit__(None, None, None)
    assert chunk_o.TRITON_ABOVE_3_7_1 is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(not gdr.has_fla(), reason="needs fla-core (pip install fla-core)")
def test_training_where_fla_would_be_wrong_stops_with_the_fix():
    """Key head dim 64 on Hopper with Triton < 3.7.1: fla's backward is miscompiled there, so training stops
    before any work (no kernel runs, so nothing autotunes) and names the fix."""
    q, k, v, g, beta, cu = _miscompiled_on_this_gpu()
    with pytest.raises(RuntimeError, match=r"#640.*triton>=3.7.1 or tilelang.*impl='ref'"):
        gated_delta_rule(q.requires_grad_(), k, v, g.float(), beta, cu)


@pytest.mark.gpu
@pytest.mark.slow  # fla autotunes its forward kernels again for key dim 64 (about 45 s on an H200)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(not gdr.has_fla(), reason="needs fla-core (pip install fla-core)")
def test_inference_where_fla_training_would_be_wrong_still_runs():
    """Where training is refused (key head dim 64, Hopper, Triton < 3.7.1), a forward without grad still runs
    fla, and matches the reference."""
    q, k, v, g, beta, cu = _miscompiled_on_this_gpu()
    o = gated_delta_rule(q, k, v, g.float(), beta, cu)
    assert _rms_ratio(o, gated_delta_rule_ref(q, k, v, g, beta, cu)) < 1e-2


def _miscompiled_on_this_gpu() -> list[torch.Tensor]:
    """bf16 inputs with key head dim 64 (fla's backward miscompiles there on Hopper with Triton < 3.7.1) and
    their cu_seqlens; skips the test where this GPU and Triton are sound."""
    if gdr.hopper_guard_action(torch.cuda.get_device_capability(), gdr.triton_version(), 64, torch.bfloat16,
                               gdr.fla_tilelang_enabled()) != "refuse":
        pytest.skip("fla's backward is sound on this GPU and Triton")
    leaves = [t.to("cuda", torch.bfloat16) for t in _inputs([70, 9], 2, 4, 64, 64)]
    return [*leaves, _cu([70, 9], "cuda")]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(not gdr.has_fla(), reason="needs fla-core (pip install fla-core)")
def test_fla_custom_ops_pass_opcheck():
    """The fla ops' fake implementations (what torch.compile traces) match the real outputs."""
    lens = [70, 9, 130]
    q, k, v, g, beta = (t.to("cuda") for t in _inputs(lens, *FAST_HEADS))
    q, k, v, beta = (t.to(torch.bfloat16) for t in (q, k, v, beta))
    cu = _cu(lens, "cuda").long()
    chunks = gdr.chunk_index(cu)
    fwd_args = (q, k, v, g.float(), beta, cu, chunks.rows, chunks.count)
    torch.library.opcheck(gdr.fla_fwd, fwd_args)
    _, qn, q_rstd, kn, k_rstd, g_cum, a = gdr.fla_fwd(*fwd_args)
    do = torch.randn_like(v)
    with gdr.fla_guard_lifted(128, q.device, q.dtype):
        torch.library.opcheck(gdr.fla_bwd, (do, qn, q_rstd, kn, k_rstd, v, g_cum, beta, a, cu, chunks.rows,
                                             chunks.count))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(not gdr.has_fla(), reason="needs fla-core (pip install fla-core)")
def test_chunk_index_is_flas_own():
    from fla.ops.utils.index import prepare_chunk_indices

    cu = _cu([64, 65, 1, 0, 130, 7], "cuda").long()
    assert torch.equal(gdr.chunk_index(cu).index(), prepare_chunk_indices(cu, gdr.CHUNK).long())
