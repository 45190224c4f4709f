"""The gated delta rule over packed documents (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks",
arXiv:2412.06464), with the state reset at every document start.

Shapes: N packed tokens, S documents, Hk query/key heads, Hv value heads (Hv % Hk == 0; value head h reads
key head h // (Hv/Hk), as Hugging Face's repeat_interleave), Dk key head dim, Dv value head dim, c chunk (64).
  q, k [N, Hk, Dk], v [N, Hv, Dv], g [N, Hv] (log decay, ≤ 0), beta [N, Hv], cu_seqlens int32 [S+1]
  → o [N, Hv, Dv] (v.dtype).

Recurrence per document and value head, state S [Dk, Dv] starting at 0 at the document's first token:
  q̂ = q / √(|q|² + 1e-6) · Dk^−½,  k̂ = k / √(|k|² + 1e-6)          (the L2 norm is part of the op, as fla's
                                                                   use_qk_l2norm_in_kernel=True)
  S_t = e^{g_t} S_{t−1} + β_t k̂_t (v_t − e^{g_t} S_{t−1}ᵀ k̂_t)ᵀ;   o_t = S_tᵀ q̂_t.
Chunked form (the WY representation; what fla's kernels compute and the reference below follows), per chunk
with γ_i = Σ_{j≤i} g_j inside the chunk and Γ_ij = e^{γ_i − γ_j}:
  A = I + strictly_lower((β k̂) k̂ᵀ ∘ Γ);   u = A⁻¹ (β v);   w = A⁻¹ (β k̂ ∘ e^{γ})
  v' = u − w S;   o = (q̂ ∘ e^{γ}) S + lower(q̂ k̂ᵀ ∘ Γ) v';   S ← e^{γ_c} S + (k̂ ∘ e^{γ_c − γ})ᵀ v'.
Chunks never straddle documents (a document's last chunk is short), so the reset is exact.
Backward: autograd through the reference; fla's own backward on the fast path. Accumulation: fp32.

The fast path calls fla's chunk forward and backward functions from Atelier's own custom ops (opaque to
torch.compile, like every launcher in kernels/), with grouped value heads natively (no repeat of q and k).
fla-core refuses the gated backward on Hopper with 3.4 ≤ Triton < 3.7.1 (fla issue #640: Triton miscompiles
`tl.trans` of an MMA accumulator in chunk_bwd_kernel_dqkwg at key tiles of 64). With a key head dim in
(64, 128] the kernel tiles keys by 128 on Hopper, where the miscompile does not occur (the issue's own tile
sweep); the GPU test checks every gradient against the fp32 reference at Qwen3.5-9B's shapes in bf16. So for
bf16 with those head dims Atelier lifts fla's guard for the duration of its own backward call only, and
otherwise stops with an error naming the fix (Triton ≥ 3.7.1, tilelang, or impl='ref'). Where fla's
tilelang backend is installed and on, it takes that kernel and no guard applies.

Implementations (argument `impl`, from the model config — never an environment variable):
  "fla"  fla-core's chunk_gated_delta_rule with cu_seqlens (CUDA, bf16/fp16; `pip install fla-core`, the
         package's `gpu` extra). Imported lazily; asking for it without fla installed raises.
  "ref"  gated_delta_rule_ref below: plain PyTorch in fp32, any device.
  "auto" fla on CUDA with bf16/fp16 (raising if fla-core is missing: a silent fall-back would double the step time; the
         fp32 path is about twice the step time; pass impl="ref" to accept it), the reference elsewhere.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import threading
from dataclasses import dataclass

import torch

IMPLS = ("auto", "fla", "ref")
CHUNK = 64  # fla's chunk size (BT); the FLOP count in designer/qwen35.py uses the same
FLA_MISSING = ("gated_delta_rule: the fast path needs fla-core, which is not installed: `pip install fla-core` "
               "(or `pip install 'atelier-studio[gpu]'`); pass impl='ref' to run the slow fp32 PyTorch reference "
               "instead")

# --- Triton kernels -------------------------------------------------------------------------------
# (none here: the fast path is fla-core's Triton kernels.)


def has_fla() -> bool:
    return importlib.util.find_spec("fla") is not None


def _check(q, k, v, g, beta, cu_seqlens) -> None:
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"gated_delta_rule: expected q, k [N, Hk, Dk] and v [N, Hv, Dv]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if v.shape[1] % q.shape[1]:
        raise ValueError(f"gated_delta_rule: {v.shape[1]} value heads is not a multiple of {q.shape[1]} key heads")
    if g.shape != v.shape[:2] or beta.shape != v.shape[:2]:
        raise ValueError(f"gated_delta_rule: g {tuple(g.shape)} and beta {tuple(beta.shape)} must be [N, Hv] = "
                         f"{tuple(v.shape[:2])}")
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32 or cu_seqlens.numel() < 2:
        raise ValueError(f"gated_delta_rule: cu_seqlens must be int32 [S+1] with S >= 1, got {cu_seqlens.dtype} "
                         f"{tuple(cu_seqlens.shape)}")


# --- public ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChunkIndex:
    """(document, chunk within it) of every `CHUNK`-token block the chunked kernels run, in order, as fla takes it.

    rows  int64 [N // CHUNK + S, 2] on the tokens' device: the index in its first `count` rows, zeros after. The
          length is a bound that depends only on N and S, never on the document lengths, so blocks compiled for
          one packed shape take every batch of that shape without a recompile.
    count int64 [1] on the CPU: how many rows are the index. It lives on the host, so reading it costs no sync.
    Building one costs a host sync (the chunk count), so build it once per forward (chunk_index) and hand it to
    every layer: fla builds the index per call when not given one, which on the 9B profile was a sync per layer
    and pass, each draining the GPU's queue."""

    rows: torch.Tensor
    count: torch.Tensor
    chunk: int = CHUNK

    def index(self) -> torch.Tensor:
        """int64 [NT, 2]: the index itself (a view; no sync)."""
        return self.rows[: int(self.count)]


def chunk_index(cu_seqlens: torch.Tensor, chunk: int = CHUNK) -> ChunkIndex:
    """The ChunkIndex of the packed documents cu_seqlens int32 [S+1] (empty documents have no chunks)."""
    device = cu_seqlens.device
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    counts = (lens + chunk - 1).div(chunk, rounding_mode="floor")
    nt, n = torch.cat([counts.sum().view(1), cu_seqlens[-1:].long()]).tolist()  # the one sync
    doc = torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts, output_size=nt)
    first = torch.cumsum(counts, 0) - counts  # each document's first chunk
    rows = torch.zeros(n // chunk + counts.numel(), 2, dtype=torch.long, device=device)  # Σ ceil(l/c) ≤ Σ (l/c + 1)
    rows[:nt, 0] = doc
    rows[:nt, 1] = torch.arange(nt, device=device) - first[doc]
    return ChunkIndex(rows, torch.tensor([nt], dtype=torch.long), chunk)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     cu_seqlens: torch.Tensor, impl: str = "auto",
                     chunks: ChunkIndex | None = None) -> torch.Tensor:
    """The gated delta rule within each document of a packed batch. See the module docstring for shapes.
    `chunks`: chunk_index(cu_seqlens), when the caller shares one across layers (the reference ignores it)."""
    _check(q, k, v, g, beta, cu_seqlens)
    if chunks is not None and (chunks.rows.dim() != 2 or chunks.rows.shape[1] != 2 or chunks.rows.device != q.device
                               or chunks.rows.shape[0] != q.shape[0] // CHUNK + cu_seqlens.numel() - 1
                               or chunks.chunk != CHUNK):
        raise ValueError(f"gated_delta_rule: chunks must be chunk_index(cu_seqlens) of these {q.shape[0]} tokens and "
                         f"{cu_seqlens.numel() - 1} documents on {q.device}, in chunks of {CHUNK}; got rows "
                         f"{tuple(chunks.rows.shape)} on {chunks.rows.device}, chunks of {chunks.chunk}")
    if impl not in IMPLS:
        raise ValueError(f"gated_delta_rule: impl must be one of {IMPLS}, got {impl!r}")
    fast_dtype = q.dtype in (torch.float16, torch.bfloat16)
    if impl == "auto":
        impl = "fla" if (q.is_cuda and fast_dtype) else "ref"
    if impl == "ref":
        return gated_delta_rule_ref(q, k, v, g, beta, cu_seqlens)
    if not has_fla():
        raise RuntimeError(FLA_MISSING)
    if not (q.is_cuda and fast_dtype):
        raise RuntimeError(f"gated_delta_rule: impl='fla' needs CUDA bf16/fp16 tensors (fla has no fp32 chunk "
                           f"kernel), got {q.device} {q.dtype}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta)):
        hopper_guard(q.device, q.shape[-1], q.dtype)  # fla's backward would refuse: say so before any work
    if chunks is None:
        chunks = chunk_index(cu_seqlens)
    dt = q.dtype
    o = FlaGatedDeltaRule.apply(q.contiguous(), k.to(dt).contiguous(), v.to(dt).contiguous(),
                                g.float().contiguous(), beta.to(dt).contiguous(), cu_seqlens.long(), chunks.rows,
                                chunks.count)
    return o.to(v.dtype)


# --- the fla fast path ----------------------------------------------------------------------------
@functools.cache
def triton_version() -> tuple[int, ...]:
    import triton

    return tuple(int(p) for p in triton.__version__.split("+")[0].split(".")[:3] if p.isdigit())


def hopper_guard_action(capability: tuple[int, int], triton: tuple[int, ...], dk: int, dtype: torch.dtype,
                        tilelang: bool = False) -> str:
    """What to do about fla's Hopper guard (fla issue #640): "none" (no guard applies: not Hopper, a Triton
    outside [3.4, 3.7.1), or fla's tilelang backend takes the kernel), "lift" (bf16 with key tiles of 128, the
    checked case) or "refuse" (key tiles of 64 or less, split key tiles, or fp16, which was not checked)."""
    if capability[0] != 9 or not (3, 4, 0) <= triton < (3, 7, 1) or tilelang:
        return "none"
    return "lift" if 64 < dk <= 128 and dtype == torch.bfloat16 else "refuse"


def fla_tilelang_enabled() -> bool:
    """Whether fla dispatches the gated backward's dq/dk/dw/dg kernel to its tilelang backend (then fla's
    Triton guard never runs): tilelang and nvcc present, the backend switched on, dispatch not disabled."""
    if os.environ.get("FLA_DISABLE_BACKEND_DISPATCH") == "1":
        return False
    try:
        from fla.ops.common.backends.tilelang import CommonTileLangBackend
    except ImportError:
        return False
    return CommonTileLangBackend.is_available() and CommonTileLangBackend().is_enabled()


def hopper_guard(device: torch.device, dk: int, dtype: torch.dtype) -> str:
    """hopper_guard_action for this device, dtype and the installed Triton; "refuse" raises with the fix."""
    capability, triton = torch.cuda.get_device_capability(device), triton_version()
    action = hopper_guard_action(capability, triton, dk, dtype, capability[0] == 9 and fla_tilelang_enabled())
    if action == "refuse":
        raise RuntimeError(
            f"gated_delta_rule: fla-core's gated backward is wrong on Hopper with Triton "
            f"{'.'.join(map(str, triton))} (fla issue #640); Atelier lets through only bf16 with key head dims in "
            f"(64, 128], got {dtype} with {dk}: install triton>=3.7.1 or tilelang (`pip install tilelang`), or "
            f"pass impl='ref'")
    return action


_LIFT_LOCK = threading.Lock()
_lift_depth = 0  # backward calls inside fla_guard_lifted right now (several threads may run backwards)
_lift_saved = False  # fla's flag as it was before the first of them


@contextlib.contextmanager
def fla_guard_lifted(dk: int, device: torch.device, dtype: torch.dtype = torch.bfloat16):
    """Within the block, fla's #640 guard lets bf16 with a key head dim in (64, 128] through (module docstring).

    fla's guard reads a module flag; overlapping blocks (backwards on several threads) share one lift, counted,
    and the flag is restored when the last one leaves, so it can never stay lifted."""
    global _lift_depth, _lift_saved
    if hopper_guard(device, dk, dtype) != "lift":
        yield
        return
    import fla.ops.common.chunk_o as chunk_o

    with _LIFT_LOCK:
        if _lift_depth == 0:
            _lift_saved = chunk_o.TRITON_ABOVE_3_7_1
            chunk_o.TRITON_ABOVE_3_7_1 = True
        _lift_depth += 1
    try:
        yield
    finally:
        with _LIFT_LOCK:
            _lift_depth -= 1
            if _lift_depth == 0:
                chunk_o.TRITON_ABOVE_3_7_1 = _lift_saved


# torch.library custom ops: opaque to torch.compile (fla's functions are compiler-disabled besides).
# fla's layout is [1, N, heads, dim] with cu_seqlens (int64); g is the raw fp32 log decay.
@torch.library.custom_op("atelier::gated_delta_rule_fla_fwd", mutates_args=())
def fla_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            cu_seqlens: torch.Tensor, chunk_rows: torch.Tensor, chunk_count: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                       torch.Tensor]:
    """q, k [N, Hk, Dk], v [N, Hv, Dv], g fp32 [N, Hv], beta [N, Hv] → (o [N, Hv, Dv], then what the backward
    needs: q̂, 1/|q|, k̂, 1/|k| (L2-normalised, fla's l2norm), the chunk-cumulated gates, fla's A)."""
    from fla.modules.norm.l2norm import l2norm_fwd
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd

    qn, q_rstd = l2norm_fwd(q[None])
    kn, k_rstd = l2norm_fwd(k[None])
    g_cum, o, a, _, _, _ = chunk_gated_delta_rule_fwd(
        q=qn, k=kn, v=v[None], g=g[None], beta=beta[None], scale=q.shape[-1] ** -0.5, initial_state=None,
        output_final_state=False, cu_seqlens=cu_seqlens, chunk_indices=ChunkIndex(chunk_rows, chunk_count).index(),
        chunk_size=CHUNK)
    return o[0].to(q.dtype), qn[0], q_rstd[0], kn[0], k_rstd[0], g_cum[0], a[0]


@fla_fwd.register_fake
def _(q, k, v, g, beta, cu_seqlens, chunk_rows, chunk_count):
    n, hv = v.shape[:2]
    return (torch.empty_like(v, dtype=q.dtype), torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32),
            torch.empty_like(k), k.new_empty(k.shape[:2], dtype=torch.float32),
            g.new_empty(n, hv, dtype=torch.float32), k.new_empty(n, hv, CHUNK))


@torch.library.custom_op("atelier::gated_delta_rule_fla_bwd", mutates_args=())
def fla_bwd(do: torch.Tensor, qn: torch.Tensor, q_rstd: torch.Tensor, kn: torch.Tensor, k_rstd: torch.Tensor,
            v: torch.Tensor, g_cum: torch.Tensor, beta: torch.Tensor, a: torch.Tensor, cu_seqlens: torch.Tensor,
            chunk_rows: torch.Tensor, chunk_count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                          torch.Tensor, torch.Tensor]:
    """do [N, Hv, Dv] and the forward's saved tensors → (dq, dk, dv, dg fp32, dbeta)."""
    from fla.modules.norm.l2norm import l2norm_bwd
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_bwd

    with fla_guard_lifted(qn.shape[-1], qn.device, qn.dtype):
        dq, dk, dv, db, dg, _, _, _ = chunk_gated_delta_rule_bwd(
            q=qn[None], k=kn[None], v=v[None], g=g_cum[None], beta=beta[None], A=a[None],
            scale=qn.shape[-1] ** -0.5, initial_state=None, do=do[None], dht=None, cu_seqlens=cu_seqlens,
            chunk_indices=ChunkIndex(chunk_rows, chunk_count).index(), chunk_size=CHUNK)
    dq = l2norm_bwd(qn[None], q_rstd[None], dq)
    dk = l2norm_bwd(kn[None], k_rstd[None], dk)
    return dq[0].to(qn.dtype), dk[0].to(kn.dtype), dv[0].to(v.dtype), dg[0].float(), db[0].to(beta.dtype)


@fla_bwd.register_fake
def _(do, qn, q_rstd, kn, k_rstd, v, g_cum, beta, a, cu_seqlens, chunk_rows, chunk_count):
    return (torch.empty_like(qn), torch.empty_like(kn), torch.empty_like(v), torch.empty_like(g_cum),
            torch.empty_like(beta))


class FlaGatedDeltaRule(torch.autograd.Function):
    """fla-core's chunked gated delta rule over packed documents (shapes as gated_delta_rule; q, k, v, beta in
    one 16-bit dtype, g fp32, cu_seqlens int64, then chunk_index(cu_seqlens)'s rows and count)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, cu_seqlens, chunk_rows, chunk_count):  # noqa: D102
        o, qn, q_rstd, kn, k_rstd, g_cum, a = fla_fwd(q, k, v, g, beta, cu_seqlens, chunk_rows, chunk_count)
        ctx.save_for_backward(qn, q_rstd, kn, k_rstd, v, g_cum, beta, a, cu_seqlens, chunk_rows, chunk_count)
        return o

    @staticmethod
    def backward(ctx, do):  # noqa: D102
        dq, dk, dv, dg, db = fla_bwd(do.contiguous(), *ctx.saved_tensors)
        return dq, dk, dv, dg, db, None, None, None


# --- reference ------------------------------------------------------------------------------------
def _chunks(cu_seqlens: torch.Tensor, c: int) -> tuple[list[list[int]], list[list[int]], torch.Tensor, torch.Tensor]:
    """Chunk layout of packed documents.

    Returns (steps, docs, index, valid): chunk j of every document that has one is processed at step j, so
    steps[j] lists those chunks and docs[j] their documents; index [Nc, c] is the token of each chunk slot
    (N, a zero row, past a document's end) and valid [Nc, c] marks real tokens.
    """
    bounds = cu_seqlens.tolist()
    index, steps, docs = [], [], []
    for d, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        for j, a in enumerate(range(s, e, c)):
            if j == len(steps):
                steps.append([])
                docs.append([])
            steps[j].append(len(index))
            docs[j].append(d)
            index.append([t if t < e else -1 for t in range(a, a + c)])
    idx = torch.tensor(index, dtype=torch.long, device=cu_seqlens.device).reshape(-1, c)
    valid = idx >= 0
    return steps, docs, torch.where(valid, idx, bounds[-1]), valid


@torch.compiler.disable  # its host loop over chunk positions would be traced into guards on the lengths
def gated_delta_rule_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         cu_seqlens: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """Plain PyTorch chunked gated delta rule in fp32 (the math of the module docstring), cast back to v.dtype.

    The intra-chunk work of all chunks is batched; the state recurrence loops over chunk positions, with
    every document's j-th chunk in one step (documents run side by side, each from its own zero state).
    """
    _check(q, k, v, g, beta, cu_seqlens)
    n, hv, dv = v.shape
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != n or any(b < a for a, b in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"gated_delta_rule_ref: cu_seqlens must rise from 0 to N={n}, got {bounds}")
    rep = hv // q.shape[1]
    with torch.autocast(q.device.type, enabled=False):  # fp32 means fp32, under any autocast
        qf = l2norm(q.float()) * q.shape[-1] ** -0.5
        kf = l2norm(k.float())
        qf, kf = qf.repeat_interleave(rep, dim=1), kf.repeat_interleave(rep, dim=1)  # [N, Hv, Dk]
        steps, docs, idx, valid = _chunks(cu_seqlens, chunk)

        def gather(x: torch.Tensor) -> torch.Tensor:  # [N, Hv, ...] → [Nc, Hv, c, ...], zeros past a doc's end
            x = torch.cat([x, x.new_zeros((1,) + x.shape[1:])])  # row N is the zero row
            x = x[idx]  # [Nc, c, Hv, ...]
            return x.movedim(1, 2)

        qc, kc, vc = gather(qf), gather(kf), gather(v.float())  # [Nc, Hv, c, Dk|Dv]
        gc, bc = gather(g.float()), gather(beta.float())  # [Nc, Hv, c]
        gamma = gc.cumsum(-1)  # [Nc, Hv, c]
        ii = torch.arange(chunk, device=q.device)
        lower = ii[:, None] >= ii[None, :]  # [c, c] incl. the diagonal
        diff = gamma[..., :, None] - gamma[..., None, :]  # [Nc, Hv, c, c]
        decay = _exp(torch.where(lower, diff, float("-inf")))  # Γ, zero above the diagonal (no overflow)
        kb = kc * bc[..., None]
        a = (kb @ kc.transpose(-1, -2)) * decay  # [Nc, Hv, c, c]; the diagonal is ignored (unit triangular)
        u = torch.linalg.solve_triangular(a, vc * bc[..., None], upper=False, unitriangular=True)  # [Nc, Hv, c, Dv]
        w = torch.linalg.solve_triangular(a, kb * _exp(gamma)[..., None], upper=False, unitriangular=True)  # [.., Dk]
        intra = (qc @ kc.transpose(-1, -2)) * decay  # [Nc, Hv, c, c]
        q_dec = qc * _exp(gamma)[..., None]
        last = gamma[..., -1:]  # [Nc, Hv, 1]; padded slots have g = 0, so this is the real last token's
        k_dec = kc * _exp(last - gamma)[..., None]

        state = qf.new_zeros(len(bounds) - 1, hv, qf.shape[-1], dv)  # [S, Hv, Dk, Dv]
        outs, order = [], []
        for ids, ds in zip(steps, docs):
            ci = torch.tensor(ids, device=q.device)
            di = torch.tensor(ds, device=q.device)
            s = state[di]  # [m, Hv, Dk, Dv]
            v_new = u[ci] - w[ci] @ s
            outs.append(q_dec[ci] @ s + intra[ci] @ v_new)  # [m, Hv, c, Dv]
            order.append(ci)
            s = s * _exp(last[ci])[..., None] + k_dec[ci].transpose(-1, -2) @ v_new
            state = state.index_copy(0, di, s)
        o = torch.cat(outs)[torch.cat(order).argsort()]  # [Nc, Hv, c, Dv] in chunk order
        o = o.movedim(2, 1)[valid]  # [N, Hv, Dv]: chunk slots are in token order
    return o.to(v.dtype)


def _exp(x: torch.Tensor) -> torch.Tensor:
    """exp of a log-decay, exactly 0 below e^−60 (≈ 9e−27).

    Strong decays (Qwen3.5's A reaches 16: g ≈ −20 a token) sum to −1000 within a chunk; their exp is an fp32
    denormal or zero, and denormal arithmetic is ~100× slower on CPUs. Flushing at e^−60 keeps every factor
    normal; what it drops is below fp32's resolution next to the O(1) terms it is added to.
    """
    return torch.where(x < -60.0, float("-inf"), x).exp()


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / √(Σx² + eps) over the last dim (fla's and Hugging Face's l2norm)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)
