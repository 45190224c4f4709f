"""kernels/moe.py: the Triton dispatch / combine around grouped GEMMs against moe_ref (output and every gradient),
the dispatch plan, and, on a GPU, bf16 against transformers' eager experts and a layer with no host sync.

Tolerances (fp32). The Triton path and moe_ref do the same arithmetic in other orders: the grouped GEMM (or the
per-expert loop) against one matmul per expert, the fp32 gather-sum of k weighted rows against index_add. Each
output element is a chain of three reductions (D for gate/up, F for down, k for the combine), so by
rounding_tolerance with terms = D + F + k; a gradient adds the reduction over the routed slots of one expert
(weights) or over E (the router), so terms = D + F + N·k there. A wrong routing, permutation or missing term is
O(1) of the output's scale.
"""
from __future__ import annotations

import pytest
import torch

from atelier_studio.kernels.moe import (
    GATHER_SHAPES,
    ExpertLoRA,
    _gather_sum_kernel,
    _groupable,
    dispatch_plan,
    grouped_mm,
    moe,
    moe_gather_sum,
    moe_ref,
)

from tests.kernels._compare import assert_error_within, assert_within_rounding

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(n, d, e, f, r, seed, device=DEV, dtype=torch.float32):
    """x [N, D] and weights scaled so every intermediate is O(1); LoRA with non-zero B on every projection."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g, dtype=torch.float64) * scale).to(device, dtype)  # noqa: E731
    tensors = dict(x=rnd(n, d), router=rnd(e, d, scale=d ** -0.5), gate_up=rnd(e, 2 * f, d, scale=d ** -0.5),
                   down=rnd(e, d, f, scale=f ** -0.5))
    if r:
        tensors.update(ga=rnd(e, r, d, scale=d ** -0.5), gb=rnd(e, f, r, scale=0.3), ua=rnd(e, r, d, scale=d ** -0.5),
                       ub=rnd(e, f, r, scale=0.3), da=rnd(e, r, f, scale=f ** -0.5), db=rnd(e, d, r, scale=0.3))
    return {k: v.requires_grad_() for k, v in tensors.items()}


def _run(t, top_k, norm, impl, scale=0.5):
    lora = None
    if "ga" in t:
        lora = ExpertLoRA(scale, (t["ga"], t["gb"]), (t["ua"], t["ub"]), (t["da"], t["db"]))
    run = moe if impl != "ref" else (lambda *a, impl=None, **kw: moe_ref(*a[:6], a[6]))
    out, routing = run(t["x"], t["router"], t["gate_up"], t["down"], top_k, norm, lora, impl=impl)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(out)
    grads = torch.autograd.grad((out * dy).sum(), list(t.values()))
    return out, routing, dict(zip(t, grads))


SHAPES = [  # (N, D, E, F, k, rank): one token; primes (D, F not on 16-byte strides: the per-expert loop);
    (1, 16, 4, 8, 2, 0),  # aligned shapes (torch._grouped_mm on the CPU where this torch has it); k = E; E = 1
    (13, 7, 5, 11, 3, 0),
    (37, 16, 8, 12, 2, 4),
    (29, 24, 6, 20, 6, 8),
    (17, 12, 1, 8, 1, 2),
]


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_triton_path_matches_the_reference_output_and_every_gradient(shape, norm):
    n, d, e, f, k, r = shape
    t = _inputs(n, d, e, f, r, seed=n + d)
    got, routing, g_got = _run(t, k, norm, "triton")
    want, routing_ref, g_want = _run(t, k, norm, "ref")
    # the same router on the same inputs: the same choices and weights, exactly
    assert torch.equal(routing.experts, routing_ref.experts) and torch.equal(routing.weights, routing_ref.weights)
    assert_within_rounding(got, want, "out", torch.float32, d + f + k)
    for name in t:
        assert_within_rounding(g_got[name], g_want[name], f"d{name}", torch.float32, d + f + n * k)


def _check_gather_sum(device: str, dtype: torch.dtype, n: int, d: int, k: int, weighted: bool) -> None:
    """moe_gather_sum against a float64 sum of the k (weighted) rows, within recursive summation's bound in fp32
    plus one rounding to `dtype`; then every candidate configuration of its autotuner, run directly, bit for bit
    equal to the launcher's choice."""
    import triton

    g = torch.Generator().manual_seed(11)
    src = torch.randn(n * k, d, generator=g).to(device, dtype)
    pos = torch.randperm(n * k, generator=g).view(n, k).to(device)
    w = torch.rand(n, k, generator=g).to(device, dtype) if weighted else src.new_empty(0)
    terms = src.double()[pos] * (w.double()[..., None] if weighted else 1.0)  # [n, k, d]
    exact = terms.sum(1)
    got = moe_gather_sum(src, pos, w)
    bound = k * torch.finfo(torch.float32).eps * terms.abs().sum(1) + torch.finfo(dtype).eps * exact.abs()
    assert ((got.double() - exact).abs() <= bound).all()
    for block, chunks, warps in GATHER_SHAPES:
        out = torch.full_like(got, float("nan"))
        grid = (n, triton.cdiv(d, block * chunks))
        _gather_sum_kernel.fn[grid](src, pos, w, out, d, K=k, HAS_W=weighted, BLOCK=block, CHUNKS=chunks,
                                    num_warps=warps)
        assert torch.equal(out, got), (block, chunks, warps)


@pytest.mark.parametrize("weighted", [True, False])
def test_gather_sum_is_the_same_under_every_launch_configuration(weighted):
    """The combine's (weighted) and the dispatch dx's gather-sum: each column is summed over j in one order whatever
    the span a program owns, so the autotuner's choice (a timing) changes no bit. D = 200 is no power of two and
    k = 3 none either (masked columns, an odd number of rows); a wrong row, weight or span is O(1)."""
    _check_gather_sum(DEV, torch.float32, 5, 200, 3, weighted)


@pytest.mark.gpu
@pytest.mark.slow  # compiles all nine candidates twice: the slow tier checks every configuration (tests/_gpu_tiers.py)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("weighted", [True, False])
def test_gather_sum_is_the_same_under_every_launch_configuration_on_the_gpu(weighted):
    """The same at 30B-A3B's width in bf16 on the GPU, where the configurations compile to different programs."""
    _check_gather_sum("cuda", torch.bfloat16, 256, 2048, 8, weighted)


def test_the_experts_backward_builds_no_slice_gradients():
    """On the Triton path the gate/up output reaches SwiGLU packed and the adapter input splits by views, so the
    backward makes no slice gradient (each a zero tensor the size of the whole, a copy and a sum: three memory passes
    over [S, 2F] per half). Counted with a dispatch mode on the CPU; the same ops run on the GPU."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    t = _inputs(24, 32, 4, 16, 8, seed=2, device="cpu")
    lora = ExpertLoRA(0.5, (t["ga"], t["gb"]), (t["ua"], t["ub"]), (t["da"], t["db"]))
    out, _ = moe(t["x"], t["router"], t["gate_up"], t["down"], 2, True, lora, impl="triton", kernels="triton")
    with Count() as backward:
        out.sum().backward()
    assert backward.ops["swiglu_packed_bwd"] == 1
    assert backward.ops["slice_backward"] == 0, backward.ops


def test_dispatch_plan_sorts_slots_by_expert_stably():
    g = torch.Generator().manual_seed(0)
    experts = torch.stack([torch.randperm(9, generator=g)[:3] for _ in range(23)])  # [N=23, k=3], distinct per token
    pos, offs = dispatch_plan(experts, 9)
    flat = pos.reshape(-1)
    assert torch.equal(flat.sort().values, torch.arange(flat.numel()))  # a permutation of the slots
    counts = torch.bincount(experts.reshape(-1), minlength=9)
    assert offs.dtype == torch.int32 and torch.equal(offs, counts.cumsum(0).int())
    slot_expert = torch.empty_like(flat)
    slot_expert[flat] = experts.reshape(-1)
    assert torch.equal(slot_expert, slot_expert.sort().values)  # slots grouped by expert
    slot_token = torch.empty_like(flat)
    slot_token[flat] = torch.arange(23).repeat_interleave(3)
    for x in range(9):  # stable: within an expert, tokens in order
        mine = slot_token[slot_expert == x]
        assert torch.equal(mine, mine.sort().values)
    # experts no token chose (the first, one between, the last ones) and no tokens at all
    sparse = torch.tensor([[1, 4], [4, 1], [1, 2], [2, 4]])
    assert torch.equal(dispatch_plan(sparse, 7)[1], torch.tensor([0, 3, 5, 5, 8, 8, 8], dtype=torch.int32))
    pos, offs = dispatch_plan(torch.empty(0, 2, dtype=torch.long), 3)
    assert pos.shape == (0, 2) and torch.equal(offs, torch.zeros(3, dtype=torch.int32))


def test_grouped_mm_paths_agree_and_skip_empty_experts():
    g = torch.Generator().manual_seed(1)
    offs = torch.tensor([3, 3, 10, 10], dtype=torch.int32)  # experts 1 and 3 get no rows
    for d in (16, 7):  # 16-byte strides (the grouped kernel, where this torch has one on the CPU) and not (the loop)
        a, w = torch.randn(10, d, generator=g), torch.randn(4, 5 if d == 7 else 8, d, generator=g)
        want = torch.cat([a[:3] @ w[0].t(), a[3:10] @ w[2].t()])
        assert_within_rounding(grouped_mm(a, w, offs), want, f"grouped_mm D={d}", torch.float32, d)
    assert not _groupable(torch.randn(10, 7), torch.randn(4, 5, 7))


def test_shape_and_argument_errors():
    t = _inputs(4, 8, 3, 4, 0, seed=0)
    with pytest.raises(ValueError, match="top_k must be in 1..3"):
        moe(t["x"], t["router"], t["gate_up"], t["down"], 4, True)
    with pytest.raises(ValueError, match=r"gate_up \[E, 2F, D\]"):
        moe(t["x"], t["router"], t["gate_up"][:, :5], t["down"], 2, True)
    with pytest.raises(ValueError, match="impl must be one of"):
        moe(t["x"], t["router"], t["gate_up"], t["down"], 2, True, impl="cuda")


# --- GPU: bf16 against transformers' eager experts, no host sync -----------------------------------
def _hf_block(d, e, f, k, t, dtype):
    """transformers' Qwen3MoeSparseMoeBlock with the same weights, eager experts (its per-expert loop), in dtype."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=d, moe_intermediate_size=f, num_experts=e, num_experts_per_tok=k,
                         norm_topk_prob=True)
    cfg._experts_implementation = "eager"
    block = Qwen3MoeSparseMoeBlock(cfg).to(t["x"].device, dtype)
    with torch.no_grad():
        block.gate.weight.copy_(t["router"])
        block.experts.gate_up_proj.copy_(t["gate_up"])
        block.experts.down_proj.copy_(t["down"])
    return block


def _same_values(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: v.detach().clone().requires_grad_() for name, v in t.items()}


def _within_twice_eager(shape, dtype, device):
    """The reference is moe_ref on the same low-precision values: it routes with the same low-precision router
    logits as the kernel and transformers (one F.linear, softmax in fp32), so no token's top-k flips between the
    three, and computes the experts in fp32. Errors are then the arithmetic's alone."""
    n, d, e, f, k = shape
    low = {name: v.detach().to(dtype).requires_grad_() for name, v in _inputs(n, d, e, f, 0, 3, device).items()}
    got, routing, g_got = _run(low, k, True, "triton")
    want, routing_ref, g_want = _run(_same_values(low), k, True, "ref")
    assert torch.equal(routing.experts, routing_ref.experts)
    hf = _hf_block(d, e, f, k, low, dtype)
    x = low["x"].detach().requires_grad_()
    base = hf(x[None])[0]
    dy = torch.randn(base.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(base)
    eager = dict(zip(("x", "router", "gate_up", "down"), torch.autograd.grad(
        (base * dy).sum(), [x, hf.gate.weight, hf.experts.gate_up_proj, hf.experts.down_proj])))
    assert_error_within(got, want, base, f"out {dtype}")
    for name, grad in eager.items():  # dx, and the weight gradients full fine-tuning takes
        assert_error_within(g_got[name], g_want[name], grad, f"d{name} {dtype}")
    return low


def test_fp16_within_twice_transformers_eager_error():
    """The Triton path in fp16 on the CPU (Triton's interpreter computes bf16 wrongly; fp16 it does not) against
    the fp32 reference, within 2× the error of transformers' eager experts in fp16 (FlashAttention's rule)."""
    _within_twice_eager((64, 32, 8, 16, 2), torch.float16, "cpu")


GPU_SHAPES = [pytest.param((512, 256, 16, 128, 4), id="small"),
              pytest.param((4096, 2048, 128, 768, 8), id="qwen3-30b-a3b", marks=pytest.mark.slow)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_bf16_within_twice_transformers_eager_error(shape):
    """Output and dx of the grouped path in bf16 against the fp32 reference, within 2× the error of transformers'
    eager experts in bf16 (FlashAttention's rule). Both route with the same bf16 router logits (the same F.linear),
    so a token whose top-k flips against fp32 flips on both sides."""
    low = _within_twice_eager(shape, torch.bfloat16, "cuda")
    assert _groupable(low["x"].detach(), low["gate_up"].detach())  # the grouped kernel ran, not the loop


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_bf16_expert_lora_gradients_match_the_reference(shape):
    """Per-expert LoRA (r = 16) on the grouped path in bf16: the output and every adapter's gradient (grouped GEMMs
    whose groups split the K dimension: expert token counts of any size) against moe_ref (fp32 experts). Norm-relative
    error: bf16 rounds each input and product by 2^-9 relative, so 3e-2 is ~15 roundings of headroom; a wrong
    group, offset or missing term is O(1)."""
    n, d, e, f, k = shape
    low = _inputs(n, d, e, f, 16, seed=5, device="cuda", dtype=torch.bfloat16)
    got, _, g_got = _run(low, k, True, "triton")
    want, _, g_want = _run(_same_values(low), k, True, "ref")  # the same routing (_within_twice_eager's reason)
    pairs = [("out", got, want)] + [(f"d{name}", g_got[name], g_want[name]) for name in low]
    for what, a, b in pairs:
        err = ((a.double() - b.double()).norm() / b.double().norm()).item()
        assert err <= 3e-2, f"{what}: norm-relative error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_layer_trains_without_a_host_sync():
    """Forward and backward of the grouped path, with per-expert LoRA, under sync debug mode "error": routing, the
    sort, the counts, the Triton dispatch / combine and torch._grouped_mm never wait on the host (the output
    gradient is made on the device beforehand: a copy from the host would itself sync)."""
    t = _inputs(1024, 256, 16, 128, 16, seed=4, device="cuda", dtype=torch.bfloat16)
    lora = ExpertLoRA(0.5, (t["ga"], t["gb"]), (t["ua"], t["ub"]), (t["da"], t["db"]))
    dy = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16)

    def step() -> list[torch.Tensor]:
        out, _ = moe(t["x"], t["router"], t["gate_up"], t["down"], 4, True, lora, impl="triton")
        return list(torch.autograd.grad((out * dy).sum(), list(t.values())))

    step()  # warm-up: Triton compiles, cuBLAS / CUTLASS initialise
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grads = step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("rank", [8, 4])
def test_the_layer_compiles_without_graph_breaks_where_every_gemm_is_grouped(rank):
    """Under torch.compile the layer is one graph when every GEMM can be grouped (bf16, LoRA rank 8: each adapter
    slice starts on a 16-byte boundary): _groupable decides from static facts only, so no storage_offset() (an int
    Dynamo cannot trace) breaks the graph. At rank 4 a B matrix's rows are 8 bytes apart, the per-expert loop reads
    the expert offsets on the host, and Dynamo must break there: the positive control for the count."""
    import torch._dynamo as dynamo

    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm: every GEMM takes the per-expert loop")
    g = torch.Generator().manual_seed(rank)
    n, d, e, f, k, bf = 48, 64, 8, 32, 2, torch.bfloat16

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).to(bf)

    x, router, gate_up, down = rand(n, d), rand(e, d), rand(e, 2 * f, d), rand(e, d, f)
    lora = ExpertLoRA(2.0, gate=(rand(e, rank, d), rand(e, f, rank)), up=(rand(e, rank, d), rand(e, f, rank)),
                      down=(rand(e, rank, f), rand(e, d, rank)))
    explained = dynamo.explain(lambda t: moe(t, router, gate_up, down, k, True, lora=lora, impl="triton")[0])(x)
    if rank == 8:
        assert explained.graph_break_count == 0, [b.reason[:120] for b in explained.break_reasons]
    else:
        assert explained.graph_break_count > 0
