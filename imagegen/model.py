"""SD3-style MMDiT (Esser et al. 2024, "Scaling Rectified Flow Transformers", arXiv:2403.03206).

Read top to bottom like the paper: config → embeddings → norms/modulation → attention → MLP →
joint block → model. Module and parameter names equal diffusers' ``SD3Transformer2DModel`` so
``state_dict()`` keys are the diffusers checkpoint keys with no mapping.
diffusers is the reference the tests compare against; it is never imported here. FAMILY (at the end) is
the registry record (imagegen/registry.py): SD3's MMDiT and SD3.5's MMDiT-X are sizes of this one family.

Shape legend:
    B   batch                     C   latent channels (in), Co out channels
    H,W latent height / width     p   patch size, h = H/p, w = W/p
    N   image tokens (h*w)        L   text tokens
    S   joint tokens (N + L)      D   model dim (num_heads * head_dim)
    Hn  heads                     Dh  head dim
    E   joint_attention_dim (text-encoder width)    P  pooled_projection_dim
    M   pos_embed_max_size (side of the stored positional grid)

Time convention: ``timestep`` is diffusers' ``sigma * 1000`` (see imagegen/flow.py).

Fused ops (``MMDiTArgs.kernels``, never part of the checkpoint config): the AdaLN norms
(kernels/adaln.py), the gated residuals (kernels/gated_residual.py) and QK-RMSNorm (kernels/rmsnorm.py)
run their Triton kernels with "triton", their plain-PyTorch references with "ref"; "auto" picks Triton
on CUDA and the references elsewhere. Both give the same numbers (tests/imagegen/test_model.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from atelier_studio.imagegen.family import Family
from atelier_studio.imagegen.layers import (
    ATTENTION_BACKENDS,
    KERNEL_IMPLS,
    NORM_EPS,
    TIME_FREQ_DIM,
    FeedForward,
    MLPEmbedder,
    Modulation,
    RMSNorm,
    linear_flops,
    merged_diffusers_config,
    sdpa_backend,
    timestep_embedding,
)
from atelier_studio.kernels.adaln import adaln_modulate
from atelier_studio.kernels.gated_residual import gated_residual
from atelier_studio.pipeline.shared_input import shared_input_linears


@dataclass(frozen=True)
class MMDiTArgs:
    """MMDiT hyper-parameters; field names shared with the designer's config plus diffusers' SD3 fields."""

    num_layers: int = 2
    num_heads: int = 2
    head_dim: int = 32
    sample_size: int = 32  # latent side the pos-embed grid is scaled to (base_size = sample_size // p)
    patch_size: int = 2
    in_channels: int = 16
    out_channels: int = 16
    joint_attention_dim: int = 48
    caption_projection_dim: int = 64  # must equal dim: text tokens enter the blocks at width D
    pooled_projection_dim: int = 40
    pos_embed_max_size: int = 32
    qk_norm: str | None = None  # None | "rms_norm"
    dual_attention_layers: tuple[int, ...] = field(default_factory=tuple)
    # Implementation of the fused ops (module docstring), not an architecture field: it is never written to
    # config.json, and checkpoints are the same with either choice.
    kernels: str = "auto"  # "auto" | "triton" | "ref"
    attention: str = "auto"  # SDPA backend, ATTENTION_BACKENDS (like kernels: not in config.json)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"MMDiTArgs.{name}={getattr(self, name)!r}: {why}")

        for name in ("num_layers", "num_heads", "head_dim", "sample_size", "patch_size", "in_channels",
                     "out_channels", "joint_attention_dim", "caption_projection_dim",
                     "pooled_projection_dim", "pos_embed_max_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise bad(name, "must be a positive int")
        if self.dim % 2:
            raise bad("head_dim", f"dim = num_heads*head_dim = {self.dim} must be even (2-D sincos pos-embed)")
        if self.caption_projection_dim != self.dim:
            raise bad("caption_projection_dim", f"must equal dim = num_heads*head_dim = {self.dim}")
        if self.qk_norm not in (None, "rms_norm"):
            raise bad("qk_norm", 'must be None or "rms_norm"')
        if self.kernels not in KERNEL_IMPLS:
            raise bad("kernels", f"must be one of {KERNEL_IMPLS}")
        if self.attention not in ATTENTION_BACKENDS:
            raise bad("attention", f"must be one of {ATTENTION_BACKENDS}")
        object.__setattr__(self, "dual_attention_layers", tuple(self.dual_attention_layers))
        for i in self.dual_attention_layers:
            if not isinstance(i, int) or not 0 <= i < self.num_layers:
                raise bad("dual_attention_layers", f"layer index {i!r} not in [0, {self.num_layers})")
        if self.sample_size % self.patch_size:
            raise bad("sample_size", f"must be a multiple of patch_size = {self.patch_size} (whole patches)")
        if self.sample_size // self.patch_size > self.pos_embed_max_size:
            raise bad("sample_size", f"sample_size/patch_size exceeds pos_embed_max_size={self.pos_embed_max_size}")

    @property
    def dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def max_seq_len(self) -> int:
        """Most image tokens one sample can have: the stored positional grid is M x M."""
        return self.pos_embed_max_size**2

    # diffusers config.json <-> MMDiTArgs. Names that differ: attention_head_dim, num_attention_heads.
    _RENAME = {"attention_head_dim": "head_dim", "num_attention_heads": "num_heads"}
    # SD3Transformer2DModel.__init__ defaults, used for fields a config.json leaves out.
    _DIFFUSERS_DEFAULTS = dict(
        sample_size=128, patch_size=2, in_channels=16, num_layers=18, attention_head_dim=64,
        num_attention_heads=18, joint_attention_dim=4096, caption_projection_dim=1152,
        pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=96, dual_attention_layers=(),
        qk_norm=None,
    )

    @classmethod
    def from_diffusers_config(cls, config: dict, source: str = "config", kernels: str = "auto",
                              attention: str = "auto") -> MMDiTArgs:
        """Build from a diffusers ``SD3Transformer2DModel`` config dict; ``source`` names it in errors."""
        merged = merged_diffusers_config(config, "SD3Transformer2DModel", cls._DIFFUSERS_DEFAULTS, source)
        if merged["out_channels"] is None:  # diffusers: None means "same as in_channels"
            merged["out_channels"] = merged["in_channels"]
        kwargs = {cls._RENAME.get(k, k): v for k, v in merged.items()}
        kwargs["dual_attention_layers"] = tuple(kwargs["dual_attention_layers"] or ())
        kwargs["kernels"], kwargs["attention"] = kernels, attention
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from e

    def to_diffusers_config(self) -> dict:
        inverse = {v: k for k, v in self._RENAME.items()}
        out = {"_class_name": "SD3Transformer2DModel"}
        for f in fields(self):
            if f.name in ("kernels", "attention"):  # implementation choices, not architecture
                continue
            value = getattr(self, f.name)
            out[inverse.get(f.name, f.name)] = list(value) if isinstance(value, tuple) else value
        return out


def _args(num_layers: int, num_heads: int, pos_embed_max_size: int, **kw) -> MMDiTArgs:
    base = dict(head_dim=64, sample_size=128, patch_size=2, in_channels=16, out_channels=16,
                joint_attention_dim=4096, pooled_projection_dim=2048)
    return MMDiTArgs(num_layers=num_layers, num_heads=num_heads, pos_embed_max_size=pos_embed_max_size,
                     caption_projection_dim=num_heads * 64, **{**base, **kw})


# Real sizes are the transformer/config.json of the stabilityai diffusers repos (pos-embed grid
# sizes cross-checked with diffusers' single-file detection: 192^2 = 36864 for SD3, 384^2 for SD3.5-M).
SIZES: dict[str, MMDiTArgs] = {
    "tiny": MMDiTArgs(),
    # The shapes-world demo on the CPU: the pixel codec's 12 channels at 16x16 (32-px images), MiniLM text (384 wide).
    # pos_embed_max_size = the 8x8 token grid itself: with a larger grid, SD3's crop squeezes the 8 positions into
    # a span of 1.75 sincos units and the trained model ignored position (scattered blocks instead of one shape).
    "demo": MMDiTArgs(num_layers=4, num_heads=4, head_dim=32, sample_size=16, in_channels=12, out_channels=12,
                      joint_attention_dim=384, caption_projection_dim=128, pooled_projection_dim=384,
                      pos_embed_max_size=8),
    "sd3-medium": _args(24, 24, 192),
    "sd3.5-medium": _args(24, 24, 384, qk_norm="rms_norm", dual_attention_layers=tuple(range(13))),
    "sd3.5-large": _args(38, 38, 192, qk_norm="rms_norm"),
}


# ---------------------------------------------------------------------------------------- embeddings

def sincos_1d(dim: int, pos: torch.Tensor) -> torch.Tensor:
    """[M] positions -> [M, dim]: [sin(pos*w), cos(pos*w)], w_i = 10000^(-2i/dim), in float64."""
    omega = torch.arange(dim // 2, dtype=torch.float64, device=pos.device) / (dim / 2.0)
    out = torch.outer(pos.reshape(-1).double(), 1.0 / 10000**omega)  # [M, dim/2]
    return torch.cat([out.sin(), out.cos()], dim=1)


def sincos_2d_grid(dim: int, grid_size: int, base_size: int) -> torch.Tensor:
    """The stored M x M positional grid -> [1, M*M, dim] (fp32), positions scaled to base_size.

    Row-major over (row, col); the first dim/2 channels encode the column, the rest the row
    (diffusers builds the grid with meshgrid(w, h, indexing="xy"), so "emb_h" is the column).
    """
    pos = torch.arange(grid_size, dtype=torch.float32) / (grid_size / base_size)  # [M]
    col = pos[None, :].expand(grid_size, grid_size)  # [M, M]
    row = pos[:, None].expand(grid_size, grid_size)  # [M, M]
    emb = torch.cat([sincos_1d(dim // 2, col), sincos_1d(dim // 2, row)], dim=1)  # [M*M, dim]
    return emb.float().unsqueeze(0)


class PatchEmbed(nn.Module):
    """[B, C, H, W] -> [B, N, D]: p x p patches, plus the centre crop h x w of the M x M sincos grid."""

    def __init__(self, args: MMDiTArgs):
        super().__init__()
        self.patch_size, self.max_size = args.patch_size, args.pos_embed_max_size
        self.proj = nn.Conv2d(args.in_channels, args.dim, kernel_size=args.patch_size, stride=args.patch_size)
        # Persistent: SD3 checkpoints store it (key pos_embed.pos_embed), so a loaded grid wins.
        grid = sincos_2d_grid(args.dim, args.pos_embed_max_size, args.sample_size // args.patch_size)
        self.register_buffer("pos_embed", grid, persistent=True)  # [1, M*M, D]

    def cropped_pos_embed(self, h: int, w: int) -> torch.Tensor:
        top, left = (self.max_size - h) // 2, (self.max_size - w) // 2
        grid = self.pos_embed.reshape(1, self.max_size, self.max_size, -1)  # [1, M, M, D]
        return grid[:, top:top + h, left:left + w, :].reshape(1, h * w, -1)  # [1, N, D]

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        h, w = latents.shape[-2] // self.patch_size, latents.shape[-1] // self.patch_size
        x = self.proj(latents).flatten(2).transpose(1, 2)  # [B, D, h, w] -> [B, N, D]
        return (x + self.cropped_pos_embed(h, w)).to(x.dtype)


class TimeTextEmbed(nn.Module):
    """Conditioning vector c = MLP(sinusoid(t)) + MLP(pooled text): [B], [B, P] -> [B, D]."""

    def __init__(self, args: MMDiTArgs):
        super().__init__()
        self.timestep_embedder = MLPEmbedder(TIME_FREQ_DIM, args.dim)
        self.text_embedder = MLPEmbedder(args.pooled_projection_dim, args.dim)

    def forward(self, timestep: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        t_emb = self.timestep_embedder(timestep_embedding(timestep).to(pooled.dtype))
        return t_emb + self.text_embedder(pooled)


# ------------------------------------------------------------------------------ norms and modulation

# AdaLN itself is kernels/adaln.py: parameter-free LayerNorm(x) * (1 + scale) + shift, [B, D] vectors
# broadcast over tokens; its residual partner x + gate * y is kernels/gated_residual.py.


# ----------------------------------------------------------------------------------------- attention

class Attention(nn.Module):
    """Multi-head attention. Joint (``context=True``): image and text tokens have their own
    projections and attend together over S = N + L tokens, image first (diffusers' order). Without
    context it is plain self-attention over image tokens (SD3.5's second, "dual" attention).
    ``context_pre_only``: the last block drops the text output, so it has no ``to_add_out`` and
    its ``add_q_proj`` (kept for diffusers' layout) is never applied.
    """

    def __init__(self, args: MMDiTArgs, context: bool, context_pre_only: bool = False):
        super().__init__()
        d = args.dim
        self.num_heads, self.head_dim = args.num_heads, args.head_dim
        self.attention = args.attention
        self.to_q, self.to_k, self.to_v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        # ModuleList so the key is to_out.0.* as in diffusers (its to_out.1 is a parameter-free Dropout).
        self.to_out = nn.ModuleList([nn.Linear(d, d)])
        rms = args.qk_norm == "rms_norm"
        self.norm_q = RMSNorm(args.head_dim, args.kernels) if rms else None
        self.norm_k = RMSNorm(args.head_dim, args.kernels) if rms else None
        self.context = context
        if context:
            self.add_q_proj, self.add_k_proj, self.add_v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
            self.to_add_out = None if context_pre_only else nn.Linear(d, d)
            self.norm_added_q = RMSNorm(args.head_dim, args.kernels) if rms else None
            self.norm_added_k = RMSNorm(args.head_dim, args.kernels) if rms else None

    def _heads(self, y: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
        B, T, _ = y.shape
        y = y.view(B, T, self.num_heads, self.head_dim)  # [B, T, D] -> [B, T, Hn, Dh]
        if norm is not None:  # over Dh, before the transpose: rows stay contiguous for the kernel
            y = norm(y)
        return y.transpose(1, 2)  # [B, Hn, T, Dh]

    def forward(self, x: torch.Tensor, ctx: torch.Tensor | None = None):
        """x [B, N, D], ctx [B, L, D] or None -> (x_out [B, N, D], ctx_out [B, L, D] | None) or x_out."""
        B, N, _ = x.shape
        # The projections of one stream read one input: FP8 layers quantise it once for all of them
        # (pipeline/shared_input.py); plain layers run one by one.
        q, k, v = shared_input_linears(x, self.to_q, self.to_k, self.to_v)
        q, k, v = self._heads(q, self.norm_q), self._heads(k, self.norm_k), self._heads(v, None)  # [B, Hn, N, Dh]
        if self.context:
            # With context_pre_only the text outputs are discarded, so text queries would be dead
            # work (diffusers computes them anyway): only image rows query. Each softmax row is
            # independent, so the image output is unchanged; add_q_proj stays for the checkpoint.
            if self.to_add_out is not None:
                cq, ck, cv = shared_input_linears(ctx, self.add_q_proj, self.add_k_proj, self.add_v_proj)
                q = torch.cat([q, self._heads(cq, self.norm_added_q)], dim=2)  # [B, Hn, S, Dh]
            else:
                ck, cv = shared_input_linears(ctx, self.add_k_proj, self.add_v_proj)
            k = torch.cat([k, self._heads(ck, self.norm_added_k)], dim=2)
            v = torch.cat([v, self._heads(cv, None)], dim=2)
        with sdpa_backend(self.attention):
            o = F.scaled_dot_product_attention(q, k, v)  # [B, Hn, S or N, Dh]
        o = o.transpose(1, 2).reshape(B, -1, self.num_heads * self.head_dim)  # [B, S or N, D]
        x_out = self.to_out[0](o[:, :N])
        if not self.context:
            return x_out
        ctx_out = self.to_add_out(o[:, N:]) if self.to_add_out is not None else None
        return x_out, ctx_out


# ------------------------------------------------------------------------------------------- blocks

class JointBlock(nn.Module):
    """One MMDiT block: two streams (image x, text ctx) with separate weights, one joint attention.

    AdaLN-Zero per stream: x += gate * f(LN(x) * (1 + scale) + shift). A dual-attention block adds a
    second, image-only self-attention with its own shift/scale/gate (9 modulation chunks, SD3.5-M).
    The last block (``context_pre_only``) only reads the text: its text stream gets a 2-chunk AdaLN
    (scale, shift) and no output projection or MLP.
    """

    def __init__(self, args: MMDiTArgs, context_pre_only: bool, dual_attention: bool):
        super().__init__()
        d = args.dim
        self.context_pre_only, self.dual_attention = context_pre_only, dual_attention
        self.impl = args.kernels
        self.norm1 = Modulation(d, 9 if dual_attention else 6)
        self.norm1_context = Modulation(d, 2 if context_pre_only else 6)
        self.attn = Attention(args, context=True, context_pre_only=context_pre_only)
        self.attn2 = Attention(args, context=False) if dual_attention else None
        self.ff = FeedForward(d)
        self.ff_context = None if context_pre_only else FeedForward(d)

    @property
    def unused_linears(self) -> tuple[str, ...]:
        """Linears kept for diffusers' layout that the forward never applies: the last block's text queries."""
        return ("attn.add_q_proj",) if self.context_pre_only else ()

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, c: torch.Tensor):
        """x [B, N, D], ctx [B, L, D], c [B, D] -> (ctx [B, L, D] or None, x [B, N, D])."""
        impl = self.impl

        def norm(t: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return adaln_modulate(t, shift, scale, NORM_EPS, impl=impl)  # LN(t) * (1 + scale) + shift

        def add(t: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return gated_residual(t, y, gate, impl=impl)  # t + gate * y

        mods = self.norm1(c)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mods[:6]
        if self.context_pre_only:
            c_scale, c_shift = self.norm1_context(c)  # AdaLayerNormContinuous order: scale first
            ctx_in = norm(ctx, c_shift, c_scale)
        else:
            c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(c)
            ctx_in = norm(ctx, c_shift_msa, c_scale_msa)

        x_attn, ctx_attn = self.attn(norm(x, shift_msa, scale_msa), ctx_in)
        if self.attn2 is not None:
            shift_msa2, scale_msa2, gate_msa2 = mods[6:]
            # Both image attentions read LN(x) of the x from before the first residual (diffusers).
            x_attn2 = self.attn2(norm(x, shift_msa2, scale_msa2))
            x = add(add(x, gate_msa, x_attn), gate_msa2, x_attn2)
        else:
            x = add(x, gate_msa, x_attn)
        x = add(x, gate_mlp, self.ff(norm(x, shift_mlp, scale_mlp)))

        if self.context_pre_only:
            return None, x
        ctx = add(ctx, c_gate_msa, ctx_attn)
        ctx = add(ctx, c_gate_mlp, self.ff_context(norm(ctx, c_shift_mlp, c_scale_mlp)))
        return ctx, x


class MMDiT(nn.Module):
    """SD3 MMDiT: (latents [B,C,H,W], text_states [B,L,E], pooled [B,P], timestep [B]) -> [B,Co,H,W]."""

    def __init__(self, args: MMDiTArgs):
        super().__init__()
        self.args = args
        self.pos_embed = PatchEmbed(args)
        self.time_text_embed = TimeTextEmbed(args)
        self.context_embedder = nn.Linear(args.joint_attention_dim, args.caption_projection_dim)
        self.transformer_blocks = nn.ModuleList(
            JointBlock(args, context_pre_only=i == args.num_layers - 1, dual_attention=i in args.dual_attention_layers)
            for i in range(args.num_layers)
        )
        self.norm_out = Modulation(args.dim, 2)  # AdaLayerNormContinuous: (scale, shift)
        self.proj_out = nn.Linear(args.dim, args.patch_size**2 * args.out_channels)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """All initialisation (DiT, Peebles & Xie 2023, sec. 3.2).

        | parameter                                         | init                              |
        |---------------------------------------------------|-----------------------------------|
        | every nn.Linear weight / bias (unless below)      | xavier_uniform / 0                |
        | pos_embed.proj (patch conv) weight / bias         | xavier_uniform on [D, C*p*p] / 0  |
        | time_text_embed.*.linear_{1,2}.weight             | normal(0, 0.02)                   |
        | blocks' norm1.linear, norm1_context.linear        | 0 (AdaLN-Zero: blocks start as id)|
        | norm_out.linear, proj_out                         | 0 (DiT final layer: output 0)     |
        | attention RMSNorm weights (qk_norm)               | 1                                 |
        | pos_embed.pos_embed buffer                        | fixed 2-D sincos grid, not learned|
        """
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
        w = self.pos_embed.proj.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.zeros_(self.pos_embed.proj.bias)
        for emb in (self.time_text_embed.timestep_embedder, self.time_text_embed.text_embedder):
            nn.init.normal_(emb.linear_1.weight, std=0.02)
            nn.init.normal_(emb.linear_2.weight, std=0.02)
        zero = [self.norm_out.linear, self.proj_out]
        zero += [lin for b in self.transformer_blocks for lin in (b.norm1.linear, b.norm1_context.linear)]
        for lin in zero:
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)

    def _check_inputs(self, latents, text_states, pooled, timestep) -> None:
        a, p = self.args, self.args.patch_size
        if latents.ndim != 4 or latents.shape[1] != a.in_channels:
            raise ValueError(f"MMDiT.forward: latents must be [B, {a.in_channels}, H, W], got {tuple(latents.shape)}")
        B, _, H, W = latents.shape
        if H % p or W % p:
            raise ValueError(f"MMDiT.forward: latent H, W = {H}, {W} must be multiples of patch_size={p}")
        if H // p > a.pos_embed_max_size or W // p > a.pos_embed_max_size:
            raise ValueError(f"MMDiT.forward: latent grid {H // p}x{W // p} exceeds pos_embed_max_size="
                             f"{a.pos_embed_max_size}")
        if text_states.ndim != 3 or text_states.shape[0] != B or text_states.shape[2] != a.joint_attention_dim:
            raise ValueError(f"MMDiT.forward: text_states must be [{B}, L, {a.joint_attention_dim}], "
                             f"got {tuple(text_states.shape)}")
        if pooled.shape != (B, a.pooled_projection_dim):
            raise ValueError(f"MMDiT.forward: pooled must be [{B}, {a.pooled_projection_dim}], "
                             f"got {tuple(pooled.shape)}")
        if timestep.shape != (B,):
            raise ValueError(f"MMDiT.forward: timestep must be [{B}] (sigma*1000), got {tuple(timestep.shape)}")

    def forward(self, latents: torch.Tensor, text_states: torch.Tensor, pooled: torch.Tensor,
                timestep: torch.Tensor) -> torch.Tensor:
        """latents [B,C,H,W], text_states [B,L,E], pooled [B,P], timestep [B] (sigma*1000) -> v [B,Co,H,W]."""
        self._check_inputs(latents, text_states, pooled, timestep)
        B, _, H, W = latents.shape
        p, co = self.args.patch_size, self.args.out_channels
        x = self.pos_embed(latents)  # [B, N, D]
        c = self.time_text_embed(timestep, pooled)  # [B, D]
        ctx = self.context_embedder(text_states)  # [B, L, D]
        for block in self.transformer_blocks:
            ctx, x = block(x, ctx, c)
        scale, shift = self.norm_out(c)
        x = self.proj_out(adaln_modulate(x, shift, scale, NORM_EPS, impl=self.args.kernels))  # [B, N, p*p*Co]
        x = x.reshape(B, H // p, W // p, p, p, co)  # [B, h, w, p, p, Co]
        x = torch.einsum("nhwpqc->nchpwq", x)  # [B, Co, h, p, w, p]
        return x.reshape(B, co, H, W)

    def _matmul_flops(self, image_tokens: int, text_tokens: int, weight_grad: bool) -> int:
        """Matmul FLOPs of one image, walking the model's modules: the forward's, or (``weight_grad``) those of
        the weight gradients, which only trainable weights get. Each token passes only its own stream's weights;
        modulation and conditioning linears run once per image."""
        N, L = image_tokens, text_tokens
        conv = self.pos_embed.proj
        mm = linear_flops(self.time_text_embed, 1, weight_grad) + linear_flops(self.norm_out, 1, weight_grad)
        if not weight_grad or conv.weight.requires_grad:
            mm += 2 * N * conv.in_channels * conv.kernel_size[0] * conv.kernel_size[1] * conv.out_channels
        mm += linear_flops(self.context_embedder, L, weight_grad) + linear_flops(self.proj_out, N, weight_grad)
        for b in self.transformer_blocks:
            mm += linear_flops(b.norm1, 1, weight_grad) + linear_flops(b.norm1_context, 1, weight_grad)
            a = b.attn
            mm += sum(linear_flops(m, N, weight_grad) for m in (a.to_q, a.to_k, a.to_v, a.to_out))
            text_q = a.add_q_proj if a.to_add_out is not None else None  # see Attention.forward
            mm += sum(linear_flops(m, L, weight_grad) for m in (text_q, a.add_k_proj, a.add_v_proj, a.to_add_out))
            mm += sum(linear_flops(m, N, weight_grad) for m in (b.attn2, b.ff))
            mm += linear_flops(b.ff_context, L, weight_grad)
        return mm

    def forward_flops(self, batch_size: int, image_tokens: int, text_tokens: int) -> tuple[int, int]:
        """(forward matmul FLOPs, forward attention FLOPs) for a batch, walking the model's modules.

        Attention is 4*Q*S*D per joint layer (QK^T and PV, Q query rows: S, or N in the last block, which has
        no text queries) plus 4*N^2*D per dual-attention layer. A LoRA layer's A and B are linears of their own
        and count themselves.
        """
        N, S, D = image_tokens, image_tokens + text_tokens, self.args.dim
        attn = 0
        for b in self.transformer_blocks:
            queries = S if b.attn.to_add_out is not None else N
            attn += 4 * queries * S * D + (4 * N * N * D if b.attn2 is not None else 0)
        return batch_size * self._matmul_flops(image_tokens, text_tokens, False), batch_size * attn

    def train_flops(self, batch_size: int, image_tokens: int, text_tokens: int) -> int:
        """Useful FLOPs of one training step: the forward matmuls, as many again for the input gradients, the
        weight gradients of the trainable weights only (full fine-tuning: 3 x forward; LoRA: 4 x N + 6 x N_lora,
        the frozen base gets no weight gradient), and 3 x the forward attention (12*S^2*D per joint layer,
        12*N*S*D for the last one). Padded text tokens count: they are real work (SD3 uses no text mask)."""
        mm, attn = self.forward_flops(batch_size, image_tokens, text_tokens)
        weight_grads = batch_size * self._matmul_flops(image_tokens, text_tokens, True)
        return 2 * mm + weight_grads + 3 * attn


# LoRA targets: the linears of a joint block by diffusers' module paths, which are PEFT's target_modules (and the
# names diffusers' train_dreambooth_lora_sd3.py --lora_layers takes). The default is every attention projection:
# both streams' q, k, v and outputs, and SD3.5's second (image-only) attention; the feed-forwards are opt-in.
LORA_ATTENTION = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                  "attn.add_v_proj", "attn.to_add_out", "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0")
LORA_FEED_FORWARD = ("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")



def block_linear_rows(name: str, images: int, image_tokens: int, text_tokens: int) -> int:
    """The rows a joint block's linear reads: an AdaLN modulation (`norm1.linear`, `norm1_context.linear`) one per
    image, the text stream's (`*_context`, `attn.add_*_proj`, `attn.to_add_out`) the text tokens, every other (the
    image stream's, SD3.5's image-only `attn2`) the image tokens."""
    if name.startswith("norm") and name.endswith(".linear"):
        return images
    if "_context" in name or name.startswith(("attn.add_", "attn.to_add_out")):
        return images * text_tokens
    return images * image_tokens


def diffusers_forward(ref: nn.Module, latents: torch.Tensor, text_states: torch.Tensor, pooled: torch.Tensor,
                      timestep: torch.Tensor) -> torch.Tensor:
    """diffusers' SD3Transformer2DModel on MMDiT.forward's arguments (the same ones) -> v [B, Co, H, W]."""
    return ref(hidden_states=latents, encoder_hidden_states=text_states, pooled_projections=pooled,
               timestep=timestep, return_dict=False)[0]


FAMILY = Family(
    name="MMDiT", class_names=("SD3Transformer2DModel",), args_cls=MMDiTArgs, model_cls=MMDiT, sizes=SIZES,
    tiny_size="tiny", train_flops=MMDiT.train_flops, blocks=lambda model: list(model.transformer_blocks),
    diffusers_class="diffusers:SD3Transformer2DModel", lora_targets=LORA_ATTENTION + LORA_FEED_FORWARD,
    default_lora_targets=LORA_ATTENTION,
    # kept out of FP8: the linears that run once per image (the timestep and pooled-text embedders, every AdaLN
    # modulation: M = the batch, so quantising their weight each step costs more than their matmul) and the final
    # projection (N = p²·C = 64 outputs, next to the loss)
    fp8_skip=("time_text_embed.*", "transformer_blocks.*.norm1.linear", "transformer_blocks.*.norm1_context.linear",
              "norm_out.linear", "proj_out"),
    linear_rows=block_linear_rows, diffusers_forward=diffusers_forward,
)
