"""Mixture-of-experts FFN (Qwen3-MoE's sparse block): top-k routing, dropless dispatch to per-expert SwiGLU FFNs
run as grouped GEMMs, and the weighted combine.

Shapes: N tokens, D dim, E experts, k experts per token, F expert ffn dim, S = N·k routed slots, r LoRA rank.

Routing (transformers' Qwen3MoeTopKRouter):
  logits = x Wrᵀ [N, E] in the compute dtype;  p = softmax(logits) in fp32;  (w, e) = topk(p, k) [N, k]
  (ties go to the lower expert index, as torch.topk breaks them for transformers too);
  w /= Σ_j w[:, j] when norm_topk_prob;  w cast to the compute dtype.
Dispatch (the permute): the S pairs (token n, choice j), flattened as n·k + j, sorted by expert, stable (within an
  expert the tokens keep their order): counts [E] by scatter-add, offs = cumsum(counts) int32 (expert g owns
  slots offs[g−1] .. offs[g]), pos [N, k] = the slot of pair (n, j);  xs [S, D], xs[pos[n, j]] = x[n].
Experts, each on its own slots (one grouped GEMM for all experts):
  h = xs W_gu[g]ᵀ [S, 2F] (W_gu[g] = [W_gate[g]; W_up[g]]);  a = silu(h[:, :F]) · h[:, F:] [S, F];
  ys = a W_down[g]ᵀ [S, D];  with LoRA, projection P adds s · (in A_P[g]ᵀ) B_P[g]ᵀ (one adapter per expert).
Combine (the unpermute): out[n] = Σ_j w[n, j] · ys[pos[n, j]], accumulated in fp32, rounded once.
Backward:
  combine   dys[pos[n, j]] = w[n, j] · dout[n];  dw[n, j] = ⟨dout[n], ys[pos[n, j]]⟩ (fp32 accumulation);
  experts   autograd through the grouped GEMMs (a frozen weight gets no weight gradient) and kernels/swiglu.py;
  dispatch  dx[n] = Σ_j dxs[pos[n, j]] (fp32 accumulation);
  routing   autograd through softmax, topk's values and the renormalisation (the choice itself has none).
Saved: dispatch keeps pos; combine keeps ys, pos and w; the GEMMs keep their inputs.
Dropless: every pair is computed (no capacity factor, no dropped token), and tokens never interact, so a packed
  row routes each of its documents exactly as the document alone.
No host sync on the grouped path: sort, scatter-add, cumsum, the Triton gathers and torch._grouped_mm read counts
  on the device only. The per-expert loop (the CPU's path where a grouped GEMM's 16-byte stride rule is not met,
  and fp32 on CUDA, where torch._grouped_mm is bf16-only) reads offs on the host.

Expert parallelism (pipeline/expert_parallel.py): with an `exchange`, this rank holds only its share of the experts
(weights [E/P, ...]); the sorted slots go to the ranks owning their experts and come back by all-to-all around the
local grouped GEMMs. Routing, dispatch and combine stay local.

Frozen experts in NF4 (QLoRA, kernels/nf4_moe.py): gate_up and down may be FrozenExperts instead of tensors; the
experts then run their grouped GEMMs over a transient dequantised stack that is never saved for the backward, and
the adapters as above.

Implementations (argument `impl`): "triton" (the Triton dispatch / combine around grouped GEMMs: torch._grouped_mm
where the inputs allow it, the per-expert loop otherwise), "ref" (moe_ref: plain PyTorch in fp32, differentiated by
autograd; under expert parallelism, plain-PyTorch gathers around the local experts), "auto" (triton on CUDA, ref
elsewhere).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Protocol, Union

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from atelier_studio.kernels.custom_op import call_op, custom_op
from atelier_studio.kernels.swiglu import swiglu_packed

IMPLS = ("auto", "triton", "ref")
BLOCK_D = 512  # the scatter's columns per step: k rows × 512 fp32 accumulators, 16 per thread at 8 warps for k = 8


# (BLOCK, CHUNKS, warps) of the gather's candidates (_gather_configs)
GATHER_SHAPES = ((512, 1, 8), (512, 4, 8), (1024, 1, 8), (1024, 2, 8), (2048, 1, 8), (256, 1, 4), (256, 8, 4),
                 (128, 1, 4), (64, 1, 2))


def _gather_configs() -> list[triton.Config]:
    """The gather's launch candidates: BLOCK columns per step, CHUNKS steps per program (unrolled, so a program has
    CHUNKS·k row loads in flight), warps. One under the interpreter. On CUDA the first is one [512]-column step per
    program (what the GPU fast tier pins); the others give a program a wider span, up to a whole row of D = 2048
    (one program per token, as the scatter runs), or fewer warps. Tuned because one span does not suit every
    shape: in the 30B-A3B LoRA step's H200 profile a gather of 512-column programs took ~296 µs a call, the
    scatter, which moves the same bytes a row per program, ~62 µs (bench/moe_dispatch.py times each candidate)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # read by Triton at import, as here
    shapes = GATHER_SHAPES if torch.cuda.is_available() and not interpreted else GATHER_SHAPES[:1]
    return [triton.Config({"BLOCK": b, "CHUNKS": c}, num_warps=w) for b, c, w in shapes]


def _prune_gather(configs, named_args, **kwargs):
    """Keep the spans that fit a row of D (a wider one only masks); the narrowest if none does."""
    width = triton.next_power_of_2(named_args["D"])
    keep = [c for c in configs if c.kwargs["BLOCK"] * c.kwargs["CHUNKS"] <= width]
    return keep or [min(configs, key=lambda c: c.kwargs["BLOCK"] * c.kwargs["CHUNKS"])]


# --- Triton kernels -------------------------------------------------------------------------------
@triton.autotune(configs=_gather_configs(), key=["D", "K", "HAS_W"],
                 prune_configs_by={"early_config_prune": _prune_gather})
@triton.jit
def _gather_sum_kernel(src_ptr, pos_ptr, w_ptr, out_ptr, D, K: tl.constexpr, HAS_W: tl.constexpr,
                       BLOCK: tl.constexpr, CHUNKS: tl.constexpr):
    """out[n, cols] = Σ_j w[n, j] · src[pos[n, j], cols] (w = 1 without HAS_W): the combine, and dispatch's dx.
    Program (n, c) owns columns [c·BLOCK·CHUNKS, (c+1)·BLOCK·CHUNKS) of token n. Each column is summed in fp32 over
    j = 0 … k−1 in that order, whatever the configuration: the autotuner's choice (a timing) never changes a bit."""
    n = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * (BLOCK * CHUNKS)
    for c in tl.static_range(CHUNKS):
        cols = start + c * BLOCK + tl.arange(0, BLOCK)
        cmask = cols < D
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):  # unrolled: the k row loads are independent, all in flight at once
            row = tl.load(pos_ptr + n * K + j).to(tl.int64)
            x = tl.load(src_ptr + row * D + cols, mask=cmask, other=0.0).to(tl.float32)
            if HAS_W:
                x = x * tl.load(w_ptr + n * K + j).to(tl.float32)
            acc += x
        tl.store(out_ptr + n * D + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _scatter_kernel(src_ptr, pos_ptr, w_ptr, y_ptr, out_ptr, dw_ptr, D, K: tl.constexpr, K_P2: tl.constexpr,
                    HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    """out[pos[n, j]] = w[n, j] · src[n] (w = 1 without HAS_W): dispatch's xs, and the combine's dys; with HAS_W
    also dw[n, j] = ⟨src[n], y[pos[n, j]]⟩, reduced over D in fp32 (so one program owns a token's whole row)."""
    n = tl.program_id(0).to(tl.int64)
    js = tl.arange(0, K_P2)
    jmask = js < K
    p = tl.load(pos_ptr + n * K + js, mask=jmask, other=0).to(tl.int64)  # [K_P2]
    if HAS_W:
        w = tl.load(w_ptr + n * K + js, mask=jmask, other=0.0).to(tl.float32)
        dot = tl.zeros([K_P2, BLOCK], dtype=tl.float32)
    for d0 in range(0, D, BLOCK):
        cols = d0 + tl.arange(0, BLOCK)
        cmask = cols < D
        row = tl.load(src_ptr + n * D + cols, mask=cmask, other=0.0).to(tl.float32)  # [BLOCK]
        tile = tl.broadcast_to(row[None, :], (K_P2, BLOCK))
        m2 = jmask[:, None] & cmask[None, :]
        if HAS_W:
            y = tl.load(y_ptr + p[:, None] * D + cols[None, :], mask=m2, other=0.0).to(tl.float32)
            dot += tile * y
            tile = tile * w[:, None]
        tl.store(out_ptr + p[:, None] * D + cols[None, :], tile.to(out_ptr.dtype.element_ty), mask=m2)
    if HAS_W:
        tl.store(dw_ptr + n * K + js, tl.sum(dot, axis=1).to(dw_ptr.dtype.element_ty), mask=jmask)


# --- launchers ------------------------------------------------------------------------------------
# torch.library custom ops: opaque to torch.compile. Absent tensors are passed as empty ones (a custom op cannot
# take None for a tensor it forwards to Triton).
def _block(d: int) -> int:
    return min(BLOCK_D, triton.next_power_of_2(d))


@custom_op("atelier::moe_gather_sum")
def moe_gather_sum(src: torch.Tensor, pos: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """src [S, D], pos [N, k] int64, w [N, k] (or empty: weights 1) → out [N, D] in src.dtype."""
    n, k = pos.shape
    d = src.shape[1]
    out = src.new_empty(n, d)
    if n and d:
        grid = lambda meta: (n, triton.cdiv(d, meta["BLOCK"] * meta["CHUNKS"]))  # noqa: E731
        _gather_sum_kernel[grid](src, pos, w, out, d, K=k, HAS_W=w.numel() > 0)
    return out


@moe_gather_sum.register_fake
def _(src, pos, w):
    return src.new_empty(pos.shape[0], src.shape[1])


@custom_op("atelier::moe_scatter")
def moe_scatter(src: torch.Tensor, pos: torch.Tensor, w: torch.Tensor, y: torch.Tensor,
                slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """src [N, D], pos [N, k] int64 (a permutation of 0..slots−1), w [N, k] (or empty) and y [slots, D] (read only
    with w) → (out [slots, D] in src.dtype, dw [N, k] in w.dtype, empty without w)."""
    n, k = pos.shape
    d = src.shape[1]
    out = src.new_empty(slots, d)
    dw = torch.empty_like(w)
    if n and d:
        block = _block(d)
        _scatter_kernel[(n,)](src, pos, w, y, out, dw, d, K=k, K_P2=triton.next_power_of_2(k), HAS_W=w.numel() > 0,
                              BLOCK=block, num_warps=8)
    return out, dw


@moe_scatter.register_fake
def _(src, pos, w, y, slots):
    return src.new_empty(slots, src.shape[1]), torch.empty_like(w)


# --- autograd.Function ----------------------------------------------------------------------------
class Dispatch(torch.autograd.Function):
    """x [N, D], pos [N, k] → xs [S, D] with xs[pos[n, j]] = x[n]; dx[n] = Σ_j dxs[pos[n, j]]."""

    @staticmethod
    def forward(ctx, x, pos):  # noqa: D102
        ctx.save_for_backward(pos)
        none = x.new_empty(0)
        return call_op(moe_scatter, x, pos, none, none, pos.numel())[0]

    @staticmethod
    def backward(ctx, dxs):  # noqa: D102
        (pos,) = ctx.saved_tensors
        return call_op(moe_gather_sum, dxs.contiguous(), pos, dxs.new_empty(0)), None


class Combine(torch.autograd.Function):
    """ys [S, D], pos [N, k], w [N, k] → out [N, D] = Σ_j w[n, j] · ys[pos[n, j]]."""

    @staticmethod
    def forward(ctx, ys, pos, w):  # noqa: D102
        ctx.save_for_backward(ys, pos, w)
        return call_op(moe_gather_sum, ys, pos, w)

    @staticmethod
    def backward(ctx, dout):  # noqa: D102
        ys, pos, w = ctx.saved_tensors
        dys, dw = call_op(moe_scatter, dout.contiguous(), pos, w, ys, ys.shape[0])
        return dys, None, dw


# --- routing and the expert GEMMs (plain torch ops: no host sync) -----------------------------------
@dataclass(frozen=True)
class Routing:
    """One layer's routing of N tokens: what transformers' router returns, and the dispatch plan."""

    logits: torch.Tensor  # [N, E] router logits, compute dtype
    weights: torch.Tensor  # [N, k] routing weights (normalised when norm_topk_prob), compute dtype
    experts: torch.Tensor  # [N, k] int64 chosen experts
    pos: torch.Tensor  # [N, k] int64: the slot of pair (n, j) in expert order
    offs: torch.Tensor  # [E] int32: cumulative slot counts (expert g owns offs[g−1] .. offs[g])


def route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, norm_topk_prob: bool) -> Routing:
    """x [N, D], router_weight [E, D] → Routing (transformers' Qwen3MoeTopKRouter, then the sort by expert)."""
    logits = F.linear(x, router_weight)  # [N, E]; under autocast in its dtype, as transformers' F.linear
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)  # [N, k]
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.to(logits.dtype)
    return Routing(logits, weights, experts, *dispatch_plan(experts, router_weight.shape[0]))


def dispatch_plan(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """experts [N, k] → (pos [N, k] int64, offs [E] int32): slots sorted by expert, stable, counted on the device."""
    flat = experts.reshape(-1)  # [S]
    sorted_experts, order = torch.sort(flat, stable=True)  # [S]: each slot's expert, and the pair in it
    pos = torch.empty_like(order)
    pos[order] = torch.arange(flat.numel(), device=flat.device)
    # offs[g] = the slots whose expert is ≤ g: one search of the sorted experts (no bincount: its size syncs)
    experts_ids = torch.arange(num_experts, device=flat.device, dtype=flat.dtype)
    offs = torch.searchsorted(sorted_experts, experts_ids, right=True, out_int32=True)
    return pos.view_as(experts), offs


@dataclass(frozen=True)
class ExpertLoRA:
    """One LoRA adapter per expert on each projection (None: that projection has none): a pair
    (A [E, r, in], B [E, out, r]) with out = F for gate and up, D for down."""

    scale: float
    gate: tuple[torch.Tensor, torch.Tensor] | None = None
    up: tuple[torch.Tensor, torch.Tensor] | None = None
    down: tuple[torch.Tensor, torch.Tensor] | None = None


def _groupable(a: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch._grouped_mm takes a [S, I] @ w[g]ᵀ (w [E, O, I], row-major, or column-major as the transpose of
    a row-major [E, I, O]: the input gradient's layout): present in this torch, bf16 on CUDA (its CUDA kernel's only
    dtype), a unit stride in a's rows and in one of w's last two dims, and every other stride, the output width and
    both start offsets on a 16-byte boundary (its rule on every device). Static facts only, so a compiled block
    decides it at trace time. The base address and the start offsets are checked outside compile only: reading a
    view's storage_offset() breaks the compiled graph (Dynamo cannot trace an op that returns a Python int), and
    the callers in this file pass tensors whose offsets are aligned by construction (experts_ffn aligns its adapter
    slices); PyTorch's own allocations are aligned, a buffer from elsewhere may not be."""
    if not hasattr(torch, "_grouped_mm") or a.dtype != w.dtype or a.dim() != 2 or w.dim() != 3:
        return False
    if a.is_cuda and a.dtype != torch.bfloat16:
        return False
    size = a.element_size()
    lead = w.stride(1) if w.stride(2) == 1 else w.stride(2)  # the stride between w's rows (or columns)
    compiling = torch.compiler.is_compiling()
    offsets = () if compiling else (a.storage_offset(), w.storage_offset())
    steps = (a.stride(0), w.stride(0), lead, w.shape[1], *offsets)
    if a.stride(1) != 1 or 1 not in (w.stride(1), w.stride(2)) or any(x * size % 16 for x in steps):
        return False
    return compiling or (a.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0)


def grouped_mm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """out[offs[g−1]:offs[g]] = a[offs[g−1]:offs[g]] @ w[g]ᵀ.  a [S, I], w [E, O, I], offs [E] int32 → [S, O].

    One torch._grouped_mm when the inputs allow (no host sync), else one matmul per expert (offs read on the host).
    """
    if _groupable(a, w):
        return torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)
    ends = offs.tolist()
    parts = [a[start:end] @ w[g].t() for g, (start, end) in enumerate(zip([0] + ends[:-1], ends))]
    return torch.cat(parts) if parts else a.new_empty(0, w.shape[1])


class FrozenExperts(Protocol):
    """A frozen stack [E, O, I] stored otherwise than as a tensor (kernels/nf4_moe.py's NF4Experts): it runs its own
    grouped GEMM and gives its values for the reference."""

    shape: tuple[int, int, int]

    def grouped_mm(self, a: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """a [S, I] → a Ŵ[g]ᵀ per expert [S, O] in a's dtype (differentiable in a)."""
        ...

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Ŵ [E, O, I]."""
        ...


Weights = Union[torch.Tensor, FrozenExperts]


def _base_mm(a: torch.Tensor, w: Weights, offs: torch.Tensor) -> torch.Tensor:
    """The frozen (or trained) base's grouped GEMM: a tensor's through grouped_mm, a FrozenExperts' its own."""
    return grouped_mm(a, w, offs) if isinstance(w, torch.Tensor) else w.grouped_mm(a, offs)


def _adapted(a: torch.Tensor, w: Weights, offs: torch.Tensor, lora: tuple[torch.Tensor, torch.Tensor] | None,
             scale: float, adapter_dtype: torch.dtype) -> torch.Tensor:
    """The base's a Wᵀ plus s · (a Aᵀ) Bᵀ per expert; the adapter computes in adapter_dtype, cast to a's dtype."""
    y = _base_mm(a, w, offs)
    if lora is None:
        return y
    lora_a, lora_b = (t.to(adapter_dtype) for t in lora)
    delta = grouped_mm(grouped_mm(a.to(adapter_dtype), lora_a, offs), lora_b, offs)
    return y + (delta * scale).to(y.dtype)


def experts_ffn(xs: torch.Tensor, gate_up: Weights, down: Weights, offs: torch.Tensor,
                lora: ExpertLoRA | None = None, kernels: str = "auto") -> torch.Tensor:
    """The experts on their slots: xs [S, D] (sorted by expert), gate_up [E, 2F, D], down [E, D, F] → ys [S, D].

    gate and up run as one grouped GEMM h = [g | u] [S, 2F], which SwiGLU reads packed (kernels/swiglu.py
    swiglu_packed: no copies of the halves, and one [S, 2F] gradient in the backward). Their adapters read xs once
    too (x [A_gate; A_up]ᵀ [S, 2r]); each adapter's B product is one half of a [S, 2F] term added to h by one add
    (a half without an adapter adds zeros). A FrozenExperts base (NF4) runs its own grouped GEMM in the compute
    dtype.
    """
    cd, ad = _compute_dtypes(xs, lora)
    xs = xs.to(cd)
    gate_up, down = (w.to(cd) if isinstance(w, torch.Tensor) else w for w in (gate_up, down))
    h = _base_mm(xs, gate_up, offs)  # [S, 2F]
    pairs = [] if lora is None else [(i, p) for i, p in enumerate((lora.gate, lora.up)) if p is not None]
    if pairs:
        r = pairs[0][1][0].shape[1]
        u = grouped_mm(xs.to(ad), torch.cat([p[0] for _, p in pairs], dim=1).to(ad), offs)  # [S, m·r]
        parts = u.split(r, dim=1)  # views whose backward is one cat (slices' would be a zero tensor each, then a sum)
        deltas: list[torch.Tensor | None] = [None, None]  # gate, up: s-free B products [S, F]
        for j, (i, (_, lora_b)) in enumerate(pairs):
            u_j = parts[j]
            if j * r * u.element_size() % 16:  # a slice that starts off a 16-byte boundary (r not a multiple of 8
                u_j = u_j.contiguous()  # in bf16): a copy the grouped GEMM can take, decided at trace time
            deltas[i] = grouped_mm(u_j, lora_b.to(ad), offs)
        other = next(d for d in deltas if d is not None)
        delta = torch.cat([d if d is not None else torch.zeros_like(other) for d in deltas], dim=1)  # [S, 2F]
        h = h + (delta * lora.scale).to(cd)
    act = swiglu_packed(h, kernels)  # [S, F]
    return _adapted(act, down, offs, None if lora is None else lora.down, 0.0 if lora is None else lora.scale, ad)


def _compute_dtypes(x: torch.Tensor, lora: ExpertLoRA | None) -> tuple[torch.dtype, torch.dtype]:
    """(base dtype, adapter dtype): autocast's for both when it is on (grouped GEMMs are not autocast ops), else
    x's and the adapters' (as kernels/lora_linear.py)."""
    if torch.is_autocast_enabled(x.device.type):
        c = torch.get_autocast_dtype(x.device.type)
        return c, c
    pairs = [p for p in (lora.gate, lora.up, lora.down) if p is not None] if lora is not None else []
    return x.dtype, (pairs[0][0].dtype if pairs else x.dtype)


# --- public ---------------------------------------------------------------------------------------
def _check(x, router_weight, gate_up, down, top_k, impl, local: bool) -> None:
    """Shapes and arguments; `local`: the experts are this rank's share (expert parallelism), not all E."""
    if impl not in IMPLS:
        raise ValueError(f"moe: impl must be one of {IMPLS}, got {impl!r}")
    n_experts, d = router_weight.shape
    held = gate_up.shape[0] if local and len(gate_up.shape) == 3 else n_experts
    if (x.dim() != 2 or x.shape[1] != d or len(gate_up.shape) != 3 or len(down.shape) != 3 or gate_up.shape[0] != held
            or n_experts % held or down.shape[:2] != (held, d) or gate_up.shape[1:] != (2 * down.shape[2], d)):
        raise ValueError(f"moe: expected x [N, D], router_weight [E, D], gate_up [E, 2F, D], down [E, D, F]; got "
                         f"x {tuple(x.shape)}, router_weight {tuple(router_weight.shape)}, gate_up "
                         f"{tuple(gate_up.shape)}, down {tuple(down.shape)}")
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"moe: top_k must be in 1..{n_experts} (the number of experts), got {top_k}")


class Exchange(Protocol):
    """Expert parallelism's all-to-all (pipeline/expert_parallel.py ExpertExchange)."""

    def dispatch(self, xs: torch.Tensor, offs: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Slots sorted by global expert [S, D] and their offs [E] → (this rank's experts' rows, sorted by local
        expert [R, D], a plan whose `offs` [E/P] are theirs)."""
        ...

    def combine(self, ys_local: torch.Tensor, plan: Any) -> torch.Tensor:
        """The local experts' outputs [R, D] → this rank's slots' outputs [S, D], in dispatch's order."""
        ...


def moe(x: torch.Tensor, router_weight: torch.Tensor, gate_up: Weights, down: Weights, top_k: int,
        norm_topk_prob: bool, lora: ExpertLoRA | None = None, impl: str = "auto",
        kernels: str = "auto", exchange: Exchange | None = None) -> tuple[torch.Tensor, Routing]:
    """The sparse MoE block on N tokens: x [N, D] → (out [N, D] in the compute dtype, its Routing).

    `kernels` is the SwiGLU kernel choice (kernels/swiglu.py) of the Triton path. With `exchange` (expert
    parallelism), gate_up, down and lora hold this rank's experts only. Frozen experts stored otherwise
    (FrozenExperts: NF4) run their own grouped GEMMs on the Triton path, and are dequantised for the reference.
    """
    ref = impl == "ref" or (impl == "auto" and not x.is_cuda)
    _check(x, router_weight, gate_up, down, top_k, impl, local=exchange is not None)
    if ref:  # the reference computes on the values (autograd keeps them for the backward: an oracle, not the step)
        gate_up, down = (w if isinstance(w, torch.Tensor) else w.dequantize() for w in (gate_up, down))
    if exchange is None:
        if ref:
            return moe_ref(x, router_weight, gate_up, down, top_k, norm_topk_prob, lora)
    r = route(x, router_weight, top_k, norm_topk_prob)
    cd = _compute_dtypes(x, lora)[0]
    x = x.to(cd).contiguous()
    if ref:  # plain-PyTorch gathers (the CPU's path under expert parallelism)
        xs = x.new_zeros(r.pos.numel(), x.shape[1]).index_copy(0, r.pos.reshape(-1), x.repeat_interleave(top_k, 0))
    else:
        xs = Dispatch.apply(x, r.pos)  # [S, D]
    if exchange is None:
        ys = experts_ffn(xs, gate_up, down, r.offs, lora, kernels)  # [S, D]
    else:
        rows, plan = exchange.dispatch(xs, r.offs)
        ys = exchange.combine(experts_ffn(rows, gate_up, down, plan.offs, lora, "ref" if ref else kernels), plan)
    w = r.weights.to(ys.dtype)
    if ref:
        return (ys[r.pos].float() * w[..., None].float()).sum(1).to(ys.dtype), r  # [N, k, D] → [N, D]
    return Combine.apply(ys, r.pos, w), r


# --- reference ------------------------------------------------------------------------------------
def moe_ref(x: torch.Tensor, router_weight: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
            norm_topk_prob: bool, lora: ExpertLoRA | None = None) -> tuple[torch.Tensor, Routing]:
    """Plain PyTorch: the router in the compute dtype (as transformers), every expert's FFN in fp32 on its tokens (a
    loop over experts, as transformers' eager experts), the weighted sum in fp32; out cast to the compute dtype."""
    cd, _ = _compute_dtypes(x, lora)
    r = route(x.to(cd), router_weight.to(cd), top_k, norm_topk_prob)
    f = down.shape[2]
    with torch.autocast(x.device.type, enabled=False):
        xf = x.float()
        out = torch.zeros_like(xf)
        for g in range(router_weight.shape[0]):
            token, choice = torch.where(r.experts == g)
            if token.numel() == 0:
                continue
            xg = xf[token]  # [n_g, D]

            def proj(inp: torch.Tensor, w: torch.Tensor,
                     pair: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
                y = inp @ w.float().t()
                if pair is not None:
                    y = y + (inp @ pair[0][g].float().t()) @ pair[1][g].float().t() * lora.scale
                return y

            gate = proj(xg, gate_up[g, :f], lora.gate if lora else None)
            up = proj(xg, gate_up[g, f:], lora.up if lora else None)
            y = proj(F.silu(gate) * up, down[g], lora.down if lora else None)  # [n_g, D]
            out = out.index_add(0, token, y * r.weights[token, choice, None].float())
    return out.to(cd), r
