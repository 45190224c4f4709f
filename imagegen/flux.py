"""FLUX.1 (Black Forest Labs 2024; dev and schnell): double-stream MMDiT blocks, then single-stream blocks.

Read top to bottom like the model: config -> RoPE -> attention -> double-stream block -> single-stream block ->
model -> FAMILY. Module and parameter names equal diffusers' ``FluxTransformer2DModel`` so ``state_dict()`` keys
are the diffusers checkpoint keys with no mapping. The pieces FLUX shares with SD3's MMDiT (the timestep sinusoid
and its MLPs, the AdaLN modulation linears, QK RMSNorm, the GELU feed-forward, the SDPA backend choice) are
imagegen/layers.py's (SD3's MMDiT uses them too); what differs is here:

- latents are packed into 2x2 patches by a reshape (``pack``: [B, C, H, W] -> [B, N, 4C], diffusers'
  ``FluxPipeline._pack_latents``) and embedded by a linear (``x_embedder``), not a conv;
- positions are a 3-axis RoPE over ids (axis 0: 0 for every token here, axis 1: the latent patch row, axis 2: the
  column; text tokens have ids (0, 0, 0)), each axis rotating its own slice of the head dim (``axes_dims_rope``);
- the conditioning vector adds a second sinusoid MLP of the distilled guidance scale (``guidance_embeds``: dev) to
  the timestep's and the pooled CLIP vector's (schnell has none);
- a double-stream block is SD3's joint block with RoPE and text first in the joint sequence; a single-stream block
  runs attention and an MLP in parallel on the concatenated [text; image] tokens with one shared set of weights
  (``proj_out`` reads [attention output, GELU(proj_mlp)]).

Shape legend:
    B   batch                     C   latent channels (in), Co out channels
    H,W latent height / width     h = H/2, w = W/2 (2x2 packing)
    N   image tokens (h*w)        L   text tokens
    S   joint tokens (L + N)      D   model dim (num_heads * head_dim)
    Hn  heads                     Dh  head dim (= sum(axes_dims_rope))
    E   joint_attention_dim (T5 width)           P  pooled_projection_dim (CLIP-L projection width)

Time convention: ``timestep`` is Atelier's ``sigma * 1000`` (imagegen/flow.py), the value diffusers computes inside
``FluxTransformer2DModel.forward`` from the sigma it is given. ``guidance`` is the guidance scale itself (3.5 in
FluxPipeline's default); the embedder reads it times 1000, as diffusers does.

Fused ops (``FluxArgs.kernels``, never part of the checkpoint): AdaLN (kernels/adaln.py), the gated residuals
(kernels/gated_residual.py), QK RMSNorm (kernels/rmsnorm.py) and RoPE (kernels/rope.py). FLUX's RoPE rotates
interleaved pairs (x[2i], x[2i+1]); the kernel rotates halves (x[i], x[i + Dh/2]). The same permutation of the
head dim (evens, then odds) applied to q and k turns one into the other and leaves every q.k product, so the
attention, unchanged: q and k are permuted after their RMSNorm and rotated by the kernel (``interleaved_to_half``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from atelier_studio.imagegen.family import Family
from atelier_studio.imagegen.layers import (
    NORM_EPS,
    PACK,
    TIME_FREQ_DIM,
    FeedForward,
    MLPEmbedder,
    Modulation,
    RMSNorm,
    check_rope_args,
    linear_flops,
    merged_diffusers_config,
    pack,
    rope_attention,
    rope_heads,
    timestep_embedding,
    unpack,
)
from atelier_studio.kernels.adaln import adaln_modulate
from atelier_studio.kernels.gated_residual import gated_residual

ROPE_THETA = 10000.0  # FluxPosEmbed(theta=10000) in diffusers
DEFAULT_SAMPLE_SIZE = 128  # FluxPipeline.default_sample_size: 128 latents x the VAE's 8 = 1024 px


@dataclass(frozen=True)
class FluxArgs:
    """FLUX hyper-parameters. ``in_channels`` / ``out_channels`` are the VAE's latent channels (16 for FLUX.1), as in
    MMDiTArgs: config.json's are 4x that (the packed 2x2 patch); from/to_diffusers_config convert."""

    num_layers: int = 2  # double-stream blocks
    num_single_layers: int = 2  # single-stream blocks
    num_heads: int = 2
    head_dim: int = 16
    in_channels: int = 4
    out_channels: int = 4
    joint_attention_dim: int = 32
    pooled_projection_dim: int = 24
    guidance_embeds: bool = True  # FLUX.1-dev: True (guidance-distilled); schnell: False
    axes_dims_rope: tuple[int, ...] = (4, 6, 6)  # head-dim slice per id axis; sums to head_dim
    kernels: str = "auto"  # "auto" | "triton" | "ref": implementation, never written to config.json
    attention: str = "auto"  # SDPA backend (ATTENTION_BACKENDS), like kernels

    def __post_init__(self) -> None:
        check_rope_args(self, ("num_layers", "num_single_layers", "num_heads", "head_dim", "in_channels",
                               "out_channels", "joint_attention_dim", "pooled_projection_dim"), "0, row, column")
        if not isinstance(self.guidance_embeds, bool):
            raise ValueError(f"FluxArgs.guidance_embeds={self.guidance_embeds!r}: must be true or false")

    @property
    def dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def patch_size(self) -> int:
        """The latent patch side one image token covers (the 2x2 packing): what buckets must tile into."""
        return PACK

    @property
    def sample_size(self) -> int:
        """The default latent side (FluxPipeline's default_sample_size; no config field: RoPE has no grid limit)."""
        return DEFAULT_SAMPLE_SIZE

    # FluxTransformer2DModel.__init__ defaults, used for fields a config.json leaves out.
    _DIFFUSERS_DEFAULTS = dict(patch_size=1, in_channels=64, out_channels=None, num_layers=19, num_single_layers=38,
                               attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                               pooled_projection_dim=768, guidance_embeds=False, axes_dims_rope=(16, 56, 56))
    _RENAME = {"attention_head_dim": "head_dim", "num_attention_heads": "num_heads"}

    @classmethod
    def from_diffusers_config(cls, config: dict, source: str = "config", kernels: str = "auto",
                              attention: str = "auto") -> FluxArgs:
        """Build from a diffusers ``FluxTransformer2DModel`` config dict; ``source`` names it in errors."""
        merged = merged_diffusers_config(config, "FluxTransformer2DModel", cls._DIFFUSERS_DEFAULTS, source)
        if merged.pop("patch_size") != 1:
            raise ValueError(f"{source}: patch_size {config['patch_size']!r}: only 1 (FLUX.1's, on 2x2-packed "
                             f"latents) is supported")
        packed_in = merged.pop("in_channels")
        packed_out = merged.pop("out_channels") or packed_in  # diffusers: None means "same as in_channels"
        for key, value in (("in_channels", packed_in), ("out_channels", packed_out)):
            if not isinstance(value, int) or value <= 0 or value % (PACK * PACK):
                raise ValueError(f"{source}: {key} {value!r} must be a positive multiple of {PACK * PACK} "
                                 f"(latent channels x the 2x2 packing)")
        kwargs = {cls._RENAME.get(k, k): v for k, v in merged.items()}
        try:
            return cls(in_channels=packed_in // PACK**2, out_channels=packed_out // PACK**2, kernels=kernels,
                       attention=attention, **kwargs)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from e

    def to_diffusers_config(self) -> dict:
        inverse = {v: k for k, v in self._RENAME.items()}
        out = {"_class_name": "FluxTransformer2DModel", "patch_size": 1}
        for f in fields(self):
            if f.name in ("kernels", "attention"):  # implementation choices, not architecture
                continue
            value = getattr(self, f.name)
            if f.name in ("in_channels", "out_channels"):
                value *= PACK * PACK
            out[inverse.get(f.name, f.name)] = list(value) if isinstance(value, tuple) else value
        return out


# black-forest-labs/FLUX.1-dev and FLUX.1-schnell transformer/config.json: 19 double + 38 single blocks, 24 heads of
# 128 (axes 16 + 56 + 56), T5-XXL states (4096), CLIP-L pooled (768), 16 latent channels (64 packed).
_FLUX1 = dict(num_layers=19, num_single_layers=38, num_heads=24, head_dim=128, in_channels=16, out_channels=16,
              joint_attention_dim=4096, pooled_projection_dim=768, axes_dims_rope=(16, 56, 56))
SIZES: dict[str, FluxArgs] = {
    "flux-tiny": FluxArgs(),
    # The shapes-world demo at FLUX's shape (configs/imagegen/flux-demo.toml): the demo MMDiT's width (4 heads of 32),
    # double then single blocks in FLUX.1's 1:2 ratio, the pixel codec's 12 channels, MiniLM's 384-wide text for the
    # states and the pooled vector; no guidance embedding (a model trained from scratch with caption dropout guides
    # by CFG, as schnell-shaped FLUX models sample above 1)
    "flux-demo": FluxArgs(num_layers=2, num_single_layers=4, num_heads=4, head_dim=32, in_channels=12,
                          out_channels=12, joint_attention_dim=384, pooled_projection_dim=384, guidance_embeds=False,
                          axes_dims_rope=(8, 12, 12)),
    "flux-dev": FluxArgs(guidance_embeds=True, **_FLUX1),
    "flux-schnell": FluxArgs(guidance_embeds=False, **_FLUX1),
}


# ---------------------------------------------------------------------------------------------- RoPE

def position_ids(text_tokens: int, h: int, w: int, device: torch.device | None = None) -> torch.Tensor:
    """[L + N, 3] ids of the joint sequence, text first: text (0, 0, 0), image (0, row, col) (FluxPipeline's
    txt_ids and _prepare_latent_image_ids)."""
    rows = torch.arange(h, device=device).repeat_interleave(w)  # [N]
    cols = torch.arange(w, device=device).repeat(h)  # [N]
    image = torch.stack([torch.zeros_like(rows), rows, cols], dim=1)  # [N, 3]
    return torch.cat([torch.zeros(text_tokens, 3, dtype=image.dtype, device=device), image]).float()  # [S, 3]


def rope_tables(ids: torch.Tensor, axes_dims: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [S, 3] -> (cos, sin) [S, Dh] fp32, in kernels/rope.py's rotate-half layout: pair i of the head dim (axis
    by axis, frequency theta^(-2j/d) within an axis of d dims) at columns i and i + Dh/2. Angles in float64, as
    diffusers' get_1d_rotary_pos_embed."""
    angles = []
    for axis, d in enumerate(axes_dims):
        inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, d, 2, dtype=torch.float64, device=ids.device) / d)  # [d/2]
        angles.append(ids[:, axis].double()[:, None] * inv_freq[None, :])  # [S, d/2]
    a = torch.cat(angles, dim=-1)  # [S, Dh/2]
    a = torch.cat([a, a], dim=-1)  # [S, Dh]
    return a.cos().float(), a.sin().float()


# ----------------------------------------------------------------------------------------- attention

class FluxAttention(nn.Module):
    """Multi-head attention with QK RMSNorm and RoPE. Joint (``joint=True``, double-stream blocks): text and image
    have their own projections and attend together over S = L + N tokens, text first; each stream has its own
    output projection. Single-stream: one set of q/k/v over the joint sequence and no output projection (the
    block's proj_out reads the heads)."""

    def __init__(self, args: FluxArgs, joint: bool):
        super().__init__()
        d = args.dim
        self.num_heads, self.head_dim = args.num_heads, args.head_dim
        self.attention, self.impl, self.joint = args.attention, args.kernels, joint
        self.to_q, self.to_k, self.to_v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.norm_q, self.norm_k = RMSNorm(args.head_dim, args.kernels), RMSNorm(args.head_dim, args.kernels)
        if joint:
            self.to_out = nn.ModuleList([nn.Linear(d, d)])  # key to_out.0 (diffusers' to_out.1 is a Dropout)
            self.add_q_proj, self.add_k_proj, self.add_v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
            self.to_add_out = nn.Linear(d, d)
            self.norm_added_q = RMSNorm(args.head_dim, args.kernels)
            self.norm_added_k = RMSNorm(args.head_dim, args.kernels)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor):
        """Joint: x [B, N, D], ctx [B, L, D] -> (x_out [B, N, D], ctx_out [B, L, D]). Single: x [B, S, D] (the joint
        sequence), ctx None -> heads [B, S, D]. cos/sin [S, Dh] (rope_tables)."""
        q, k, v = rope_heads(x, self.to_q, self.to_k, self.to_v, self.norm_q, self.norm_k, self.head_dim)  # [B,T,Hn,Dh]
        if self.joint:
            cq, ck, cv = rope_heads(ctx, self.add_q_proj, self.add_k_proj, self.add_v_proj, self.norm_added_q,
                                    self.norm_added_k, self.head_dim)
            q, k, v = torch.cat([cq, q], dim=1), torch.cat([ck, k], dim=1), torch.cat([cv, v], dim=1)  # [B, S, Hn, Dh]
        o = rope_attention(q, k, v, cos, sin, self.impl, self.attention)  # [B, S, D]
        if not self.joint:
            return o
        L = ctx.shape[1]
        return self.to_out[0](o[:, L:]), self.to_add_out(o[:, :L])


# -------------------------------------------------------------------------------------------- blocks

def _norm(t: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, impl: str) -> torch.Tensor:
    return adaln_modulate(t, shift, scale, NORM_EPS, impl=impl)  # LN(t) * (1 + scale) + shift


class DoubleStreamBlock(nn.Module):
    """diffusers' FluxTransformerBlock: SD3's joint block (AdaLN-Zero per stream, separate weights, one joint
    attention) with RoPE; every block keeps its text output (FLUX has no context_pre_only block)."""

    def __init__(self, args: FluxArgs):
        super().__init__()
        self.impl = args.kernels
        self.norm1, self.norm1_context = Modulation(args.dim, 6), Modulation(args.dim, 6)
        self.attn = FluxAttention(args, joint=True)
        self.ff, self.ff_context = FeedForward(args.dim), FeedForward(args.dim)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, c: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, N, D], ctx [B, L, D], c [B, D] -> (ctx, x) of the same shapes."""
        impl = self.impl
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(c)
        c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(c)
        x_attn, ctx_attn = self.attn(_norm(x, shift_msa, scale_msa, impl), _norm(ctx, c_shift_msa, c_scale_msa, impl),
                                     cos, sin)
        x = gated_residual(x, x_attn, gate_msa, impl=impl)  # x + gate * attn
        x = gated_residual(x, self.ff(_norm(x, shift_mlp, scale_mlp, impl)), gate_mlp, impl=impl)
        ctx = gated_residual(ctx, ctx_attn, c_gate_msa, impl=impl)
        ctx = gated_residual(ctx, self.ff_context(_norm(ctx, c_shift_mlp, c_scale_mlp, impl)), c_gate_mlp, impl=impl)
        return ctx, x


class SingleStreamBlock(nn.Module):
    """diffusers' FluxSingleTransformerBlock on the joint sequence y = [text; image]: one AdaLN (shift, scale,
    gate), attention and a GELU MLP in parallel on LN(y), y += gate * proj_out([attention, MLP])."""

    def __init__(self, args: FluxArgs):
        super().__init__()
        d = args.dim
        self.impl = args.kernels
        self.norm = Modulation(d, 3)
        self.proj_mlp = nn.Linear(d, 4 * d)
        self.attn = FluxAttention(args, joint=False)
        self.proj_out = nn.Linear(d + 4 * d, d)

    def forward(self, y: torch.Tensor, c: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """y [B, S, D], c [B, D] -> y [B, S, D]."""
        shift, scale, gate = self.norm(c)
        h = _norm(y, shift, scale, self.impl)  # [B, S, D]
        mlp = F.gelu(self.proj_mlp(h), approximate="tanh")  # [B, S, 4D]
        out = self.proj_out(torch.cat([self.attn(h, None, cos, sin), mlp], dim=-1))  # [B, S, 5D] -> [B, S, D]
        return gated_residual(y, out, gate, impl=self.impl)


# --------------------------------------------------------------------------------------------- model

class TimeGuidanceTextEmbed(nn.Module):
    """c = MLP(sinusoid(t)) [+ MLP(sinusoid(1000 * guidance))] + MLP(pooled): [B], [B] | None, [B, P] -> [B, D]
    (diffusers' CombinedTimestep[Guidance]TextProjEmbeddings)."""

    def __init__(self, args: FluxArgs):
        super().__init__()
        self.timestep_embedder = MLPEmbedder(TIME_FREQ_DIM, args.dim)
        self.guidance_embedder = MLPEmbedder(TIME_FREQ_DIM, args.dim) if args.guidance_embeds else None
        self.text_embedder = MLPEmbedder(args.pooled_projection_dim, args.dim)

    def forward(self, timestep: torch.Tensor, guidance: torch.Tensor | None, pooled: torch.Tensor) -> torch.Tensor:
        c = self.timestep_embedder(timestep_embedding(timestep).to(pooled.dtype))
        if self.guidance_embedder is not None:
            c = c + self.guidance_embedder(timestep_embedding(guidance * 1000).to(pooled.dtype))
        return c + self.text_embedder(pooled)


class Flux(nn.Module):
    """FLUX.1: (latents [B,C,H,W], text_states [B,L,E], pooled [B,P], timestep [B], guidance [B]) -> [B,Co,H,W]."""

    def __init__(self, args: FluxArgs):
        super().__init__()
        self.args = args
        d = args.dim
        self.time_text_embed = TimeGuidanceTextEmbed(args)
        self.context_embedder = nn.Linear(args.joint_attention_dim, d)
        self.x_embedder = nn.Linear(args.in_channels * PACK * PACK, d)
        self.transformer_blocks = nn.ModuleList(DoubleStreamBlock(args) for _ in range(args.num_layers))
        self.single_transformer_blocks = nn.ModuleList(SingleStreamBlock(args) for _ in range(args.num_single_layers))
        self.norm_out = Modulation(d, 2)  # AdaLayerNormContinuous: (scale, shift)
        self.proj_out = nn.Linear(d, PACK * PACK * args.out_channels)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """All initialisation (DiT's, as imagegen/model.py's MMDiT).

        | parameter                                                | init                               |
        |----------------------------------------------------------|------------------------------------|
        | every nn.Linear weight / bias (unless below)             | xavier_uniform / 0                 |
        | time_text_embed.*.linear_{1,2}.weight                    | normal(0, 0.02)                    |
        | norm1.linear, norm1_context.linear, single blocks' norm  | 0 (AdaLN-Zero: blocks start as id) |
        | norm_out.linear, proj_out                                | 0 (DiT final layer: output 0)      |
        | attention RMSNorm weights                                | 1                                  |
        """
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
        for emb in self.time_text_embed.children():
            nn.init.normal_(emb.linear_1.weight, std=0.02)
            nn.init.normal_(emb.linear_2.weight, std=0.02)
        zero = [self.norm_out.linear, self.proj_out]
        zero += [lin for b in self.transformer_blocks for lin in (b.norm1.linear, b.norm1_context.linear)]
        zero += [b.norm.linear for b in self.single_transformer_blocks]
        for lin in zero:
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)

    def _check_inputs(self, latents, text_states, pooled, timestep, guidance) -> None:
        a = self.args
        if latents.ndim != 4 or latents.shape[1] != a.in_channels:
            raise ValueError(f"Flux.forward: latents must be [B, {a.in_channels}, H, W], got {tuple(latents.shape)}")
        B, _, H, W = latents.shape
        if H % PACK or W % PACK:
            raise ValueError(f"Flux.forward: latent H, W = {H}, {W} must be even (2x2 packing)")
        if text_states.ndim != 3 or text_states.shape[0] != B or text_states.shape[2] != a.joint_attention_dim:
            raise ValueError(f"Flux.forward: text_states must be [{B}, L, {a.joint_attention_dim}], "
                             f"got {tuple(text_states.shape)}")
        if pooled.shape != (B, a.pooled_projection_dim):
            raise ValueError(f"Flux.forward: pooled must be [{B}, {a.pooled_projection_dim}], "
                             f"got {tuple(pooled.shape)}")
        if timestep.shape != (B,):
            raise ValueError(f"Flux.forward: timestep must be [{B}] (sigma*1000), got {tuple(timestep.shape)}")
        if a.guidance_embeds and (guidance is None or guidance.shape != (B,)):
            raise ValueError(f"Flux.forward: this model embeds the guidance scale (guidance_embeds, FLUX.1-dev): "
                             f"guidance must be [{B}], got {None if guidance is None else tuple(guidance.shape)}")
        if not a.guidance_embeds and guidance is not None:
            raise ValueError("Flux.forward: this model has no guidance embedding (FLUX.1-schnell): pass guidance=None")

    def forward(self, latents: torch.Tensor, text_states: torch.Tensor, pooled: torch.Tensor, timestep: torch.Tensor,
                guidance: torch.Tensor | None = None) -> torch.Tensor:
        """latents [B,C,H,W], text_states [B,L,E], pooled [B,P], timestep [B] (sigma*1000), guidance [B] (the
        guidance scale; guidance-embedded models only) -> v [B,Co,H,W]."""
        self._check_inputs(latents, text_states, pooled, timestep, guidance)
        H, W = latents.shape[-2:]
        L = text_states.shape[1]
        x = self.x_embedder(pack(latents))  # [B, N, D]
        c = self.time_text_embed(timestep, guidance, pooled)  # [B, D]
        ctx = self.context_embedder(text_states)  # [B, L, D]
        cos, sin = rope_tables(position_ids(L, H // PACK, W // PACK, latents.device), self.args.axes_dims_rope)
        for block in self.transformer_blocks:
            ctx, x = block(x, ctx, c, cos, sin)
        y = torch.cat([ctx, x], dim=1)  # [B, S, D]
        for block in self.single_transformer_blocks:
            y = block(y, c, cos, sin)
        scale, shift = self.norm_out(c)
        x = self.proj_out(_norm(y[:, L:], shift, scale, self.args.kernels))  # [B, N, 4Co]
        return unpack(x, H, W)

    def _matmul_flops(self, image_tokens: int, text_tokens: int, weight_grad: bool) -> int:
        """Matmul FLOPs of one image, walking the model's modules (the forward's, or with ``weight_grad`` those of
        the trainable weights' gradients): double blocks run each stream's linears on its own tokens, single
        blocks run theirs on all S = N + L; modulation and conditioning linears run once per image."""
        N, L = image_tokens, text_tokens
        mm = linear_flops(self.time_text_embed, 1, weight_grad) + linear_flops(self.norm_out, 1, weight_grad)
        mm += linear_flops(self.x_embedder, N, weight_grad) + linear_flops(self.proj_out, N, weight_grad)
        mm += linear_flops(self.context_embedder, L, weight_grad)
        for b in self.transformer_blocks:
            a = b.attn
            mm += linear_flops(b.norm1, 1, weight_grad) + linear_flops(b.norm1_context, 1, weight_grad)
            mm += sum(linear_flops(m, N, weight_grad) for m in (a.to_q, a.to_k, a.to_v, a.to_out, b.ff))
            mm += sum(linear_flops(m, L, weight_grad)
                      for m in (a.add_q_proj, a.add_k_proj, a.add_v_proj, a.to_add_out, b.ff_context))
        for b in self.single_transformer_blocks:
            mm += linear_flops(b.norm, 1, weight_grad)
            mm += sum(linear_flops(m, N + L, weight_grad) for m in (b.attn, b.proj_mlp, b.proj_out))
        return mm

    def forward_flops(self, batch_size: int, image_tokens: int, text_tokens: int) -> tuple[int, int]:
        """(forward matmul FLOPs, forward attention FLOPs) of a batch: attention is 4*S^2*D per block (QK^T, PV)."""
        S, D = image_tokens + text_tokens, self.args.dim
        blocks = len(self.transformer_blocks) + len(self.single_transformer_blocks)
        return batch_size * self._matmul_flops(image_tokens, text_tokens, False), batch_size * blocks * 4 * S * S * D

    def train_flops(self, batch_size: int, image_tokens: int, text_tokens: int) -> int:
        """Useful FLOPs of one training step, as MMDiT.train_flops: 2 x the forward matmuls, the trainable weights'
        gradients only, 3 x the forward attention. Padded T5 tokens count (FLUX uses no text mask)."""
        mm, attn = self.forward_flops(batch_size, image_tokens, text_tokens)
        return 2 * mm + batch_size * self._matmul_flops(image_tokens, text_tokens, True) + 3 * attn


def diffusers_forward(ref: nn.Module, latents: torch.Tensor, text_states: torch.Tensor, pooled: torch.Tensor,
                      timestep: torch.Tensor, guidance: torch.Tensor | None = None) -> torch.Tensor:
    """diffusers' FluxTransformer2DModel on Flux.forward's arguments, as FluxPipeline calls it: packed latents, the
    ids, sigma (diffusers multiplies by 1000 inside) -> v [B, Co, H, W]."""
    H, W = latents.shape[-2:]
    L = text_states.shape[1]
    ids = position_ids(L, H // PACK, W // PACK, latents.device)  # [L + N, 3]
    out = ref(hidden_states=pack(latents), encoder_hidden_states=text_states, pooled_projections=pooled,
              timestep=timestep / 1000, img_ids=ids[L:], txt_ids=ids[:L], guidance=guidance, return_dict=False)[0]
    return unpack(out, H, W)


# LoRA targets by diffusers' module paths inside a block (PEFT's target_modules, the names diffusers'
# train_dreambooth_lora_flux.py --lora_layers takes). A block gets those it has: attn.to_q/k/v exist in both block
# types, the rest in one. Default: every attention projection of both block types; the MLPs are opt-in.
LORA_ATTENTION = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                  "attn.add_v_proj", "attn.to_add_out")
LORA_MLP = ("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp", "proj_out")

FAMILY = Family(
    name="FLUX.1", class_names=("FluxTransformer2DModel",), args_cls=FluxArgs, model_cls=Flux, sizes=SIZES,
    tiny_size="flux-tiny", train_flops=Flux.train_flops,
    blocks=lambda model: [*model.transformer_blocks, *model.single_transformer_blocks],
    diffusers_class="diffusers:FluxTransformer2DModel", lora_targets=LORA_ATTENTION + LORA_MLP,
    default_lora_targets=LORA_ATTENTION, sigma_grid="linspace", guidance_input=lambda args: args.guidance_embeds,
    cfg_above_one=True,
    # BFL's original layout (fused qkv, double_blocks.*) and its kohya LoRA names are not written yet
    export_forms=("diffusers", "merge"), diffusers_forward=diffusers_forward,
    # kept out of FP8, as the MMDiT's: what runs once per image (the conditioning MLPs, every AdaLN modulation) and
    # the final projection (4C = 64 outputs, next to the loss)
    fp8_skip=("time_text_embed.*", "transformer_blocks.*.norm1.linear", "transformer_blocks.*.norm1_context.linear",
              "single_transformer_blocks.*.norm.linear", "norm_out.linear", "proj_out"),
)
