"""Qwen-Image (Qwen team 2025): a 60-block double-stream MMDiT conditioned on Qwen2.5-VL hidden states.

Read top to bottom like the model: config -> RoPE -> attention -> block -> model -> FAMILY. Module and parameter names
equal diffusers' ``QwenImageTransformer2DModel`` so ``state_dict()`` keys are the diffusers checkpoint keys with no
mapping. The pieces Qwen-Image shares with SD3's MMDiT and FLUX.1 (the timestep MLP, QK RMSNorm, the GELU
feed-forward, the final AdaLN, the SDPA backend choice, FLUX.1's 2x2 latent packing and its RoPE pair permutation:
imagegen/layers.py) are reused; what differs is here:

- every block is double-stream (image and text keep their own weights and attend jointly, text first); there is no
  single-stream block and no pooled text vector: the conditioning vector is the timestep's embedding alone;
- the text states are RMS-normed over their width (``txt_norm``, a learned weight) before ``txt_in``;
- each stream's AdaLN is ``nn.Sequential(SiLU, Linear)`` (keys ``img_mod.1`` / ``txt_mod.1``), six vectors in
  SD3's order (shift, scale, gate of the attention, then of the MLP);
- the text is masked: padded text tokens are never attended to (the pipeline pads each batch's prompts);
- a 3-axis RoPE (frame, row, column) whose image positions are centred (``scale_rope``: rows -h/2 .. h/2-1 in
  tokens) and whose text tokens sit on the diagonal after the image, at max(h/2, w/2) + i on all three axes.

Shape legend:
    B   batch                     C   latent channels (in), Co out channels
    H,W latent height / width     h = H/2, w = W/2 (2x2 packing)
    N   image tokens (h*w)        L   text tokens (padded)
    S   joint tokens (L + N)      D   model dim (num_heads * head_dim)
    Hn  heads                     Dh  head dim (= sum(axes_dims_rope))
    E   joint_attention_dim (Qwen2.5-VL's hidden size, 3584 for the 7B)

Forward arguments: ``(latents, text_states, text_mask, timestep)``. The third is where SD3 and FLUX.1 take the pooled
text vector: Qwen-Image has none, and takes the text mask [B, L] (1 for a prompt token, 0 for padding) instead, so
the generic code (task, sampler, bench) passes a cached per-caption vector in the same slot for every family.
``timestep`` is Atelier's ``sigma * 1000`` (imagegen/flow.py); diffusers is given sigma and scales it by 1000 inside
its sinusoid, which ``time_features`` reproduces op for op.

Fused ops (``QwenImageArgs.kernels``, never part of the checkpoint): AdaLN (kernels/adaln.py), the gated residuals
(kernels/gated_residual.py), QK and text RMSNorm (kernels/rmsnorm.py) and RoPE (kernels/rope.py). Qwen-Image's RoPE
multiplies interleaved pairs as complex numbers, FLUX's layout: q and k are permuted to the kernel's rotate-half
layout after their RMSNorm (layers.interleaved_to_half), which leaves every q.k product unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn

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
    unpack,
)
from atelier_studio.kernels.adaln import adaln_modulate
from atelier_studio.kernels.gated_residual import gated_residual

ROPE_THETA = 10000  # QwenEmbedRope(theta=10000)
TIME_SCALE = 1000.0  # QwenTimestepProjEmbeddings: Timesteps(scale=1000) on sigma
DEFAULT_SAMPLE_SIZE = 128  # QwenImagePipeline.default_sample_size: 128 latents x the VAE's 8 = 1024 px


@dataclass(frozen=True)
class QwenImageArgs:
    """Qwen-Image hyper-parameters. ``in_channels`` / ``out_channels`` are the VAE's latent channels (16), as in
    MMDiTArgs and FluxArgs. diffusers' config.json is asymmetric: its in_channels is the packed 2x2 patch (64) and its
    out_channels the latent channels (16; proj_out writes patch_size^2 of them); from/to_diffusers_config convert."""

    num_layers: int = 2
    num_heads: int = 2
    head_dim: int = 16
    in_channels: int = 4
    out_channels: int = 4
    joint_attention_dim: int = 32
    axes_dims_rope: tuple[int, ...] = (4, 6, 6)  # head-dim slice per position axis (frame, row, column)
    kernels: str = "auto"  # "auto" | "triton" | "ref": implementation, never written to config.json
    attention: str = "auto"  # SDPA backend (ATTENTION_BACKENDS), like kernels

    def __post_init__(self) -> None:
        check_rope_args(self, ("num_layers", "num_heads", "head_dim", "in_channels", "out_channels",
                               "joint_attention_dim"), "frame, row, column")

    @property
    def dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def patch_size(self) -> int:
        """The latent patch side one image token covers (the 2x2 packing): what buckets must tile into."""
        return PACK

    @property
    def sample_size(self) -> int:
        """The default latent side (QwenImagePipeline's default_sample_size; no config field)."""
        return DEFAULT_SAMPLE_SIZE

    # QwenImageTransformer2DModel.__init__ defaults, used for fields a config.json leaves out.
    _DIFFUSERS_DEFAULTS = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                               num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False,
                               axes_dims_rope=(16, 56, 56), zero_cond_t=False, use_additional_t_cond=False,
                               use_layer3d_rope=False)
    # config fields of the model's later variants (Qwen-Image-Edit-2511, Qwen-Image-Layered) this family does not
    # build: each must be false. guidance_embeds is diffusers' unused TODO (its forward cannot run with it).
    _UNSUPPORTED = ("guidance_embeds", "zero_cond_t", "use_additional_t_cond", "use_layer3d_rope")
    _RENAME = {"attention_head_dim": "head_dim", "num_attention_heads": "num_heads"}

    @classmethod
    def from_diffusers_config(cls, config: dict, source: str = "config", kernels: str = "auto",
                              attention: str = "auto") -> QwenImageArgs:
        """Build from a diffusers ``QwenImageTransformer2DModel`` config dict; ``source`` names it in errors."""
        merged = merged_diffusers_config(config, "QwenImageTransformer2DModel", cls._DIFFUSERS_DEFAULTS, source)
        on = [k for k in cls._UNSUPPORTED if merged.pop(k)]
        if on:
            raise ValueError(f"{source}: {on} must be false: only the Qwen-Image text-to-image transformer is "
                             f"supported")
        if merged.pop("patch_size") != PACK:
            raise ValueError(f"{source}: patch_size {config['patch_size']!r}: only {PACK} (Qwen-Image's 2x2 "
                             f"packing) is supported")
        packed_in = merged.pop("in_channels")
        if not isinstance(packed_in, int) or packed_in <= 0 or packed_in % (PACK * PACK):
            raise ValueError(f"{source}: in_channels {packed_in!r} must be a positive multiple of {PACK * PACK} "
                             f"(latent channels x the 2x2 packing)")
        if merged["out_channels"] is None:
            raise ValueError(f"{source}: out_channels null is not supported: set it to the latent channels "
                             f"({packed_in // PACK**2})")
        kwargs = {cls._RENAME.get(k, k): v for k, v in merged.items()}
        try:
            return cls(in_channels=packed_in // PACK**2, kernels=kernels, attention=attention, **kwargs)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from e

    def to_diffusers_config(self) -> dict:
        inverse = {v: k for k, v in self._RENAME.items()}
        out = {"_class_name": "QwenImageTransformer2DModel", "patch_size": PACK}
        for f in fields(self):
            if f.name in ("kernels", "attention"):  # implementation choices, not architecture
                continue
            value = getattr(self, f.name)
            if f.name == "in_channels":
                value *= PACK * PACK
            out[inverse.get(f.name, f.name)] = list(value) if isinstance(value, tuple) else value
        return out


# Qwen/Qwen-Image transformer/config.json: 60 blocks, 24 heads of 128 (axes 16 + 56 + 56), Qwen2.5-VL-7B states
# (3584), 16 latent channels (64 packed).
SIZES: dict[str, QwenImageArgs] = {
    "qwen-image-tiny": QwenImageArgs(),
    "qwen-image": QwenImageArgs(num_layers=60, num_heads=24, head_dim=128, in_channels=16, out_channels=16,
                                joint_attention_dim=3584, axes_dims_rope=(16, 56, 56)),
}


# ------------------------------------------------------------------------------------- time and RoPE

def time_features(timestep: torch.Tensor) -> torch.Tensor:
    """[B] timesteps (sigma*1000) -> [B, 256] fp32 [cos, sin] features, computed as diffusers' Timesteps(scale=1000)
    computes them from sigma: 1000 * (sigma * freq) (the same products in the same order)."""
    half = TIME_FREQ_DIM // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=timestep.device) / half)
    sigma = timestep.float() / TIME_SCALE
    args = TIME_SCALE * (sigma[:, None] * freqs[None, :])  # [B, half]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def positions(text_tokens: int, h: int, w: int, device: torch.device | None = None) -> torch.Tensor:
    """[L + N, 3] positions of the joint sequence, text first (QwenEmbedRope, scale_rope=True, one frame): image
    (0, row - (h - h//2), col - (w - w//2)); text token i at max(h//2, w//2) + i on every axis."""
    rows = torch.arange(h, device=device).repeat_interleave(w) - (h - h // 2)  # [N]
    cols = torch.arange(w, device=device).repeat(h) - (w - w // 2)  # [N]
    image = torch.stack([torch.zeros_like(rows), rows, cols], dim=1)  # [N, 3]
    text = (max(h // 2, w // 2) + torch.arange(text_tokens, device=device))[:, None].expand(-1, 3)  # [L, 3]
    return torch.cat([text, image]).float()  # [S, 3]


def rope_tables(pos: torch.Tensor, axes_dims: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """pos [S, 3] -> (cos, sin) [S, Dh] fp32 in kernels/rope.py's rotate-half layout (pair i at columns i and
    i + Dh/2, axis by axis). Angles in fp32 as diffusers' rope_params: position * theta^(-2j/d)."""
    angles = []
    for axis, d in enumerate(axes_dims):
        inv_freq = 1.0 / torch.pow(ROPE_THETA, torch.arange(0, d, 2, device=pos.device).float().div(d))  # [d/2]
        angles.append(pos[:, axis, None] * inv_freq[None, :])  # [S, d/2]
    a = torch.cat(angles, dim=-1)  # [S, Dh/2]
    a = torch.cat([a, a], dim=-1)  # [S, Dh]
    return a.cos(), a.sin()


# ----------------------------------------------------------------------------------------- attention

class QwenImageAttention(nn.Module):
    """Joint attention: image (to_q/k/v, to_out.0) and text (add_q/k/v_proj, to_add_out) project separately, with
    QK RMSNorm per stream and RoPE, and attend together over S = L + N tokens, text first; padded text keys masked."""

    def __init__(self, args: QwenImageArgs):
        super().__init__()
        d = args.dim
        self.num_heads, self.head_dim = args.num_heads, args.head_dim
        self.attention, self.impl = args.attention, args.kernels
        self.to_q, self.to_k, self.to_v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.norm_q, self.norm_k = RMSNorm(args.head_dim, args.kernels), RMSNorm(args.head_dim, args.kernels)
        self.to_out = nn.ModuleList([nn.Linear(d, d)])  # key to_out.0 (diffusers' to_out.1 is a Dropout)
        self.add_q_proj, self.add_k_proj, self.add_v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.to_add_out = nn.Linear(d, d)
        self.norm_added_q = RMSNorm(args.head_dim, args.kernels)
        self.norm_added_k = RMSNorm(args.head_dim, args.kernels)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, N, D], ctx [B, L, D], mask [B, S] bool (True: attend) or None, cos/sin [S, Dh] -> (x_out, ctx_out)."""
        q, k, v = rope_heads(x, self.to_q, self.to_k, self.to_v, self.norm_q, self.norm_k, self.head_dim)  # [B,N,Hn,Dh]
        cq, ck, cv = rope_heads(ctx, self.add_q_proj, self.add_k_proj, self.add_v_proj, self.norm_added_q,
                                self.norm_added_k, self.head_dim)
        q, k, v = torch.cat([cq, q], dim=1), torch.cat([ck, k], dim=1), torch.cat([cv, v], dim=1)  # [B, S, Hn, Dh]
        o = rope_attention(q, k, v, cos, sin, self.impl, self.attention, mask)  # [B, S, D]
        L = ctx.shape[1]
        return self.to_out[0](o[:, L:]), self.to_add_out(o[:, :L])


# --------------------------------------------------------------------------------------------- block

def _norm(t: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, impl: str) -> torch.Tensor:
    return adaln_modulate(t, shift, scale, NORM_EPS, impl=impl)  # LN(t) * (1 + scale) + shift


class QwenImageBlock(nn.Module):
    """diffusers' QwenImageTransformerBlock: AdaLN-Zero per stream (SiLU -> Linear -> 6 vectors), one joint
    attention, a GELU(tanh) MLP per stream."""

    def __init__(self, args: QwenImageArgs):
        super().__init__()
        d = args.dim
        self.impl = args.kernels
        self.img_mod = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))
        self.txt_mod = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))
        self.attn = QwenImageAttention(args)
        self.img_mlp, self.txt_mlp = FeedForward(d), FeedForward(d)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor | None, c: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, N, D], ctx [B, L, D], mask [B, S] | None, c [B, D] -> (ctx, x) of the same shapes."""
        impl = self.impl
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.img_mod(c).chunk(6, dim=1)
        c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.txt_mod(c).chunk(6, dim=1)
        x_attn, ctx_attn = self.attn(_norm(x, shift_msa, scale_msa, impl), _norm(ctx, c_shift_msa, c_scale_msa, impl),
                                     mask, cos, sin)
        x = gated_residual(x, x_attn, gate_msa, impl=impl)  # x + gate * attn
        x = gated_residual(x, self.img_mlp(_norm(x, shift_mlp, scale_mlp, impl)), gate_mlp, impl=impl)
        ctx = gated_residual(ctx, ctx_attn, c_gate_msa, impl=impl)
        ctx = gated_residual(ctx, self.txt_mlp(_norm(ctx, c_shift_mlp, c_scale_mlp, impl)), c_gate_mlp, impl=impl)
        return ctx, x


# --------------------------------------------------------------------------------------------- model

class TimestepEmbed(nn.Module):
    """c = MLP(sinusoid(t)): [B] -> [B, D] (diffusers' QwenTimestepProjEmbeddings; key timestep_embedder)."""

    def __init__(self, args: QwenImageArgs):
        super().__init__()
        self.timestep_embedder = MLPEmbedder(TIME_FREQ_DIM, args.dim)

    def forward(self, timestep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.timestep_embedder(time_features(timestep).to(dtype))


class QwenImage(nn.Module):
    """Qwen-Image: (latents [B,C,H,W], text_states [B,L,E], text_mask [B,L] | None, timestep [B]) -> [B,Co,H,W]."""

    def __init__(self, args: QwenImageArgs):
        super().__init__()
        self.args = args
        d = args.dim
        self.time_text_embed = TimestepEmbed(args)
        self.txt_norm = RMSNorm(args.joint_attention_dim, args.kernels)
        self.img_in = nn.Linear(args.in_channels * PACK * PACK, d)
        self.txt_in = nn.Linear(args.joint_attention_dim, d)
        self.transformer_blocks = nn.ModuleList(QwenImageBlock(args) for _ in range(args.num_layers))
        self.norm_out = Modulation(d, 2)  # AdaLayerNormContinuous: (scale, shift)
        self.proj_out = nn.Linear(d, PACK * PACK * args.out_channels)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """All initialisation (DiT's, as imagegen/model.py's MMDiT and imagegen/flux.py).

        | parameter                                  | init                               |
        |--------------------------------------------|------------------------------------|
        | every nn.Linear weight / bias (unless below) | xavier_uniform / 0               |
        | time_text_embed.timestep_embedder.*.weight | normal(0, 0.02)                    |
        | img_mod.1, txt_mod.1                        | 0 (AdaLN-Zero: blocks start as id) |
        | norm_out.linear, proj_out                  | 0 (DiT final layer: output 0)      |
        | RMSNorm weights (QK, txt_norm)             | 1                                  |
        """
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
        emb = self.time_text_embed.timestep_embedder
        nn.init.normal_(emb.linear_1.weight, std=0.02)
        nn.init.normal_(emb.linear_2.weight, std=0.02)
        zero = [self.norm_out.linear, self.proj_out]
        zero += [b.img_mod[1] for b in self.transformer_blocks] + [b.txt_mod[1] for b in self.transformer_blocks]
        for lin in zero:
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)

    def _check_inputs(self, latents, text_states, text_mask, timestep) -> None:
        a = self.args
        if latents.ndim != 4 or latents.shape[1] != a.in_channels:
            raise ValueError(f"QwenImage.forward: latents must be [B, {a.in_channels}, H, W], "
                             f"got {tuple(latents.shape)}")
        B, _, H, W = latents.shape
        if H % PACK or W % PACK:
            raise ValueError(f"QwenImage.forward: latent H, W = {H}, {W} must be even (2x2 packing)")
        if text_states.ndim != 3 or text_states.shape[0] != B or text_states.shape[2] != a.joint_attention_dim:
            raise ValueError(f"QwenImage.forward: text_states must be [{B}, L, {a.joint_attention_dim}], "
                             f"got {tuple(text_states.shape)}")
        if text_mask is not None and text_mask.shape != text_states.shape[:2]:
            raise ValueError(f"QwenImage.forward: text_mask must be [{B}, {text_states.shape[1]}] (1: prompt token, "
                             f"0: padding) or None, got {tuple(text_mask.shape)}")
        if timestep.shape != (B,):
            raise ValueError(f"QwenImage.forward: timestep must be [{B}] (sigma*1000), got {tuple(timestep.shape)}")

    def forward(self, latents: torch.Tensor, text_states: torch.Tensor, text_mask: torch.Tensor | None,
                timestep: torch.Tensor) -> torch.Tensor:
        """latents [B,C,H,W], text_states [B,L,E], text_mask [B,L] (1: attend, 0: padding; None: every token),
        timestep [B] (sigma*1000) -> v [B,Co,H,W]."""
        self._check_inputs(latents, text_states, text_mask, timestep)
        B, _, H, W = latents.shape
        L = text_states.shape[1]
        x = self.img_in(pack(latents))  # [B, N, D]
        ctx = self.txt_in(self.txt_norm(text_states))  # [B, L, D]
        c = self.time_text_embed(timestep, x.dtype)  # [B, D]
        mask = None
        if text_mask is not None:  # image keys always attend
            mask = torch.cat([text_mask.bool(), text_mask.new_ones(B, x.shape[1], dtype=torch.bool)], dim=1)  # [B, S]
        cos, sin = rope_tables(positions(L, H // PACK, W // PACK, latents.device), self.args.axes_dims_rope)
        for block in self.transformer_blocks:
            ctx, x = block(x, ctx, mask, c, cos, sin)
        scale, shift = self.norm_out(c)
        return unpack(self.proj_out(_norm(x, shift, scale, self.args.kernels)), H, W)  # [B, N, 4Co] -> [B,Co,H,W]

    def _matmul_flops(self, image_tokens: int, text_tokens: int, weight_grad: bool) -> int:
        """Matmul FLOPs of one image, walking the model's modules (the forward's, or with ``weight_grad`` those of
        the trainable weights' gradients): each stream's linears run on its own tokens, modulation and the timestep
        MLP once per image."""
        N, L = image_tokens, text_tokens
        mm = linear_flops(self.time_text_embed, 1, weight_grad) + linear_flops(self.norm_out, 1, weight_grad)
        mm += linear_flops(self.img_in, N, weight_grad) + linear_flops(self.proj_out, N, weight_grad)
        mm += linear_flops(self.txt_in, L, weight_grad)
        for b in self.transformer_blocks:
            a = b.attn
            mm += linear_flops(b.img_mod, 1, weight_grad) + linear_flops(b.txt_mod, 1, weight_grad)
            mm += sum(linear_flops(m, N, weight_grad) for m in (a.to_q, a.to_k, a.to_v, a.to_out, b.img_mlp))
            mm += sum(linear_flops(m, L, weight_grad)
                      for m in (a.add_q_proj, a.add_k_proj, a.add_v_proj, a.to_add_out, b.txt_mlp))
        return mm

    def forward_flops(self, batch_size: int, image_tokens: int, text_tokens: int) -> tuple[int, int]:
        """(forward matmul FLOPs, forward attention FLOPs) of a batch: attention is 4*S^2*D per block (QK^T, PV)."""
        S, D = image_tokens + text_tokens, self.args.dim
        return (batch_size * self._matmul_flops(image_tokens, text_tokens, False),
                batch_size * len(self.transformer_blocks) * 4 * S * S * D)

    def _text_tail(self) -> list[nn.Module]:
        """The last block's linears that only make its text output, which nothing reads (only the image stream
        reaches proj_out): they run forward, as in diffusers, but get no gradient, of their input or weight."""
        b = self.transformer_blocks[-1]
        return [b.attn.add_q_proj, b.attn.to_add_out, b.txt_mlp]

    def train_flops(self, batch_size: int, image_tokens: int, text_tokens: int) -> int:
        """Useful FLOPs of one training step, as MMDiT.train_flops: 2 x the forward matmuls, the trainable weights'
        gradients only, 3 x the forward attention; the last block's text tail only forward. Padded text tokens
        count (the kernels compute them)."""
        mm, attn = self.forward_flops(batch_size, image_tokens, text_tokens)
        L = text_tokens
        tail = sum(linear_flops(m, L) + linear_flops(m, L, True) for m in self._text_tail())  # backward not run
        return (2 * mm + batch_size * (self._matmul_flops(image_tokens, text_tokens, True) - tail) + 3 * attn)


def diffusers_forward(ref: nn.Module, latents: torch.Tensor, text_states: torch.Tensor,
                      text_mask: torch.Tensor | None, timestep: torch.Tensor) -> torch.Tensor:
    """diffusers' QwenImageTransformer2DModel on QwenImage.forward's arguments, as QwenImagePipeline calls it: packed
    latents, the text mask, sigma (diffusers scales it by 1000 inside), one frame of h x w tokens -> v [B,Co,H,W]."""
    B, _, H, W = latents.shape
    out = ref(hidden_states=pack(latents), encoder_hidden_states=text_states, encoder_hidden_states_mask=text_mask,
              timestep=timestep / TIME_SCALE, img_shapes=[[(1, H // PACK, W // PACK)]] * B, return_dict=False)[0]
    return unpack(out, H, W)


def cfg_rescale(v: torch.Tensor, v_cond: torch.Tensor) -> torch.Tensor:
    """QwenImagePipeline's correction of the guided prediction: each image token's packed vector [4C] rescaled to the
    conditional prediction's norm. v, v_cond [B, C, H, W] -> [B, C, H, W]."""
    H, W = v.shape[-2:]
    guided, cond = pack(v), pack(v_cond)  # [B, N, 4C]
    return unpack(guided * (cond.norm(dim=-1, keepdim=True) / guided.norm(dim=-1, keepdim=True)), H, W)


# LoRA targets by diffusers' module paths inside a block (PEFT's target_modules). Default: every attention
# projection of both streams (diffusers' train_dreambooth_lora_qwen_image.py wraps the image stream's to_q/k/v/out);
# the MLPs and the modulation are opt-in.
LORA_ATTENTION = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                  "attn.add_v_proj", "attn.to_add_out")
LORA_MLP = ("img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2")
LORA_MODULATION = ("img_mod.1", "txt_mod.1")

FAMILY = Family(
    name="Qwen-Image", class_names=("QwenImageTransformer2DModel",), args_cls=QwenImageArgs, model_cls=QwenImage,
    sizes=SIZES, tiny_size="qwen-image-tiny", train_flops=QwenImage.train_flops,
    blocks=lambda model: list(model.transformer_blocks),
    diffusers_class="diffusers:QwenImageTransformer2DModel", lora_targets=LORA_ATTENTION + LORA_MLP + LORA_MODULATION,
    default_lora_targets=LORA_ATTENTION, sigma_grid="linspace",  # QwenImagePipeline: linspace(1, 1/n, n), shifted
    cfg_rescale=cfg_rescale, text_mask_input=True,
    export_forms=("diffusers", "merge"), diffusers_forward=diffusers_forward,
    # kept out of FP8, as FLUX's: what runs once per image (the timestep MLP, every AdaLN modulation) and the final
    # projection (4C = 64 outputs, next to the loss)
    fp8_skip=("time_text_embed.*", "transformer_blocks.*.img_mod.1", "transformer_blocks.*.txt_mod.1",
              "norm_out.linear", "proj_out"),
)
