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

Implementations (argument `impl`, from the model config — never an environment variable):
  "fla"  fla-core's chunk_gated_delta_rule with cu_seqlens (CUDA, bf16/fp16; `pip install fla-core`, the
         package's `gpu` extra). Imported lazily; asking for it without fla installed raises.
  "ref"  gated_delta_rule_ref below: plain PyTorch in fp32, any device.
  "auto" fla on CUDA with bf16/fp16 (raising if fla-core is missing — PITFALLS.md "Silent slow paths": the
         fp32 path is about twice the step time; pass impl="ref" to accept it), the reference elsewhere.
"""
from __future__ import annotations

import importlib.util

import torch

IMPLS = ("auto", "fla", "ref")
CHUNK = 64  # fla's chunk size (BT); the FLOP count in designer/qwen35.py uses the same
FLA_MISSING = ("gated_delta_rule: the fast path needs fla-core, which is not installed: `pip install fla-core` "
               "(or `pip install 'atelier[gpu]'`); pass impl='ref' to run the slow fp32 PyTorch reference instead")

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
def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     cu_seqlens: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """The gated delta rule within each document of a packed batch. See the module docstring for shapes."""
    _check(q, k, v, g, beta, cu_seqlens)
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
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    rep = v.shape[1] // q.shape[1]
    if rep > 1:  # fla's chunk kernel takes one head count: give every value head its key head
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)  # [N, Hv, Dk]
    o, _ = chunk_gated_delta_rule(q[None], k[None], v[None].to(q.dtype), g[None].float(), beta[None].to(q.dtype),
                                  scale=q.shape[-1] ** -0.5, use_qk_l2norm_in_kernel=True,
                                  cu_seqlens=cu_seqlens.long())  # [1, N, Hv, Dv]
    return o[0].to(v.dtype)


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
        qf = _l2norm(q.float()) * q.shape[-1] ** -0.5
        kf = _l2norm(k.float())
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


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / √(Σx² + eps) over the last dim (fla's and Hugging Face's l2norm)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)
