"""The layers the MMDiT families share (imagegen/model.py's SD3 MMDiT, imagegen/flux.py's FLUX.1,
imagegen/qwen_image.py's Qwen-Image): constants diffusers hard-codes, the SDPA backend choice, the timestep sinusoid
and its MLP, QK RMSNorm, the AdaLN modulation linear, the GELU feed-forward, what FLUX.1 and Qwen-Image share (the
2x2 latent packing; q/k/v heads RMS-normed and permuted from RoPE's interleaved pairs to the kernel's halves, then
RoPE and SDPA over the joint sequence: imagegen/flux.py says why), and the linear-FLOP walk each model's FLOP count
is built from. Names and keys are diffusers'.

Shape legend: B batch, T tokens, D model dim, Dh head dim.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from atelier_studio.kernels.rmsnorm import rmsnorm
from atelier_studio.kernels.rope import rope
from atelier_studio.pipeline.shared_input import shared_input_linears

# diffusers' SD3 layers hard-code these: LayerNorm/RMSNorm eps and the sinusoidal timestep width.
NORM_EPS = 1e-6
TIME_FREQ_DIM = 256
KERNEL_IMPLS = ("auto", "triton", "ref")
# SDPA backends for the joint attention (MMDiTArgs.attention): "auto" leaves the choice to PyTorch; the others
# pin one, so the fastest exact backend measured on a card (bench/imagegen.py's sdpa_* rows) can be chosen.
ATTENTION_BACKENDS = ("auto", "flash", "cudnn", "efficient", "math")
# FLUX.1 and Qwen-Image pack latents into 2x2 patches (FluxPipeline / QwenImagePipeline._pack_latents).
PACK = 2  # diffusers' FLUX config says patch_size 1 on packed tokens, Qwen-Image's says 2


def sdpa_backend(name: str, cudnn_in_auto: bool = True) -> contextlib.AbstractContextManager:
    """The SDPA backend context for MMDiTArgs.attention ("auto": none, PyTorch chooses; with `cudnn_in_auto` False,
    PyTorch chooses among the others). Traced by torch.compile."""
    if name == "auto" and cudnn_in_auto:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if name == "auto":
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
    return sdpa_kernel([{"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                         "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]])


def timestep_embedding(t: torch.Tensor, dim: int = TIME_FREQ_DIM, max_period: float = 10000.0) -> torch.Tensor:
    """[B] timesteps (sigma*1000) -> [B, dim] fp32 features [cos, sin] (DDPM/DiT, flip_sin_to_cos)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None, :]  # [B, half]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class MLPEmbedder(nn.Module):
    """Linear -> SiLU -> Linear (diffusers TimestepEmbedding / PixArtAlphaTextProjection)."""

    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class RMSNorm(nn.Module):
    """QK-norm over the head dim (SD3.5): x / rms(x) * weight in fp32, rounded once to x.dtype (kernels/rmsnorm.py)."""

    def __init__(self, dim: int, impl: str = "auto"):
        super().__init__()
        self.impl = impl
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rmsnorm(x, self.weight, NORM_EPS, impl=self.impl)


class Modulation(nn.Module):
    """AdaLN: SiLU(c) -> Linear -> k chunks of [B, D] (shift/scale/gate vectors for one stream)."""

    def __init__(self, dim: int, chunks: int):
        super().__init__()
        self.chunks = chunks
        self.linear = nn.Linear(dim, chunks * dim)

    def forward(self, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(F.silu(c)).chunk(self.chunks, dim=1)


class FeedForward(nn.Module):
    """Linear(D, 4D) -> GELU(tanh) -> Linear(4D, D). Keys net.0.proj / net.2 as in diffusers."""

    def __init__(self, dim: int):
        super().__init__()
        proj = nn.Module()
        proj.proj = nn.Linear(dim, 4 * dim)
        # Index 1 is diffusers' parameter-free Dropout; Identity keeps the Linear at net.2.
        self.net = nn.Sequential(proj, nn.Identity(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](F.gelu(self.net[0].proj(x), approximate="tanh"))


def pack(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, N, 4C]: 2x2 patches row-major, channels (c, dy, dx) (FluxPipeline's and QwenImagePipeline's
    _pack_latents)."""
    B, C, H, W = latents.shape
    x = latents.view(B, C, H // PACK, PACK, W // PACK, PACK)  # [B, C, h, 2, w, 2]
    return x.permute(0, 2, 4, 1, 3, 5).reshape(B, (H // PACK) * (W // PACK), C * PACK * PACK)  # [B, N, 4C]


def unpack(x: torch.Tensor, H: int, W: int) -> torch.Tensor:
    """[B, N, 4C] -> [B, C, H, W], the inverse of `pack` (their _unpack_latents, one frame)."""
    B, _, packed = x.shape
    C = packed // (PACK * PACK)
    x = x.view(B, H // PACK, W // PACK, C, PACK, PACK)  # [B, h, w, C, 2, 2]
    return x.permute(0, 3, 1, 4, 2, 5).reshape(B, C, H, W)


def interleaved_to_half(x: torch.Tensor) -> torch.Tensor:
    """[..., Dh] -> [..., Dh] with the even channels first, then the odd: interleaved pairs become halves."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)  # [..., Dh/2, 2] -> [..., 2, Dh/2] -> [..., Dh]


def rope_heads(y: torch.Tensor, q: nn.Linear, k: nn.Linear, v: nn.Linear, norm_q: RMSNorm, norm_k: RMSNorm,
               head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One stream [B, T, D] through its q/k/v linears (one read of y) -> q, k, v [B, T, Hn, Dh]: q and k RMS-normed
    over the head dim, then permuted from RoPE's interleaved pairs to the kernel's halves (FLUX.1, Qwen-Image)."""
    B, T, _ = y.shape
    q, k, v = (t.view(B, T, -1, head_dim) for t in shared_input_linears(y, q, k, v))
    return interleaved_to_half(norm_q(q)), interleaved_to_half(norm_k(k)), v


def rope_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   impl: str, backend: str, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """q, k, v [B, S, Hn, Dh] (half layout), cos/sin [S, Dh] -> RoPE (kernels/rope.py), then SDPA over the joint
    sequence (key_mask [B, S] bool, True = attend, or None) -> [B, S, Hn * Dh]."""
    B, S, Hn, Dh = q.shape
    q, k = rope(q, k, cos.expand(B, S, -1), sin.expand(B, S, -1), impl=impl)
    attn_mask = None if key_mask is None else key_mask[:, None, None, :]  # [B, 1, 1, S]: keys only
    # "auto" without a mask (FLUX.1) on a GPU leaves cuDNN out: its backward fails at FLUX.1-dev's 1024 px shape
    # ([B, 24, 4608, 128], bf16; torch 2.11 + CUDA 13 on an H100): "mha_graph.execute(...).is_good()", or an illegal
    # memory access without CUDA_LAUNCH_BLOCKING; diffusers' FluxTransformer2DModel as well (docs/performance.md).
    # Masked (Qwen-Image's padded text) it ran; attention = "cudnn" still pins it. On the CPU nothing changes (an
    # outer sdpa_kernel choice stays in force there).
    with sdpa_backend(backend, cudnn_in_auto=key_mask is not None or q.device.type == "cpu"):
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=attn_mask)  # [B, Hn, S, Dh]
    return o.transpose(1, 2).reshape(B, S, Hn * Dh)


def linear_flops(module: nn.Module | None, tokens: int, weight_grad: bool = False) -> int:
    """Forward matmul FLOPs of every nn.Linear inside ``module`` applied to ``tokens`` rows; with ``weight_grad``,
    only of those whose weight trains (the FLOPs of their weight gradients: a frozen weight gets none)."""
    if module is None:
        return 0
    return sum(2 * tokens * m.in_features * m.out_features for m in module.modules()
               if isinstance(m, nn.Linear) and (not weight_grad or m.weight.requires_grad))


def check_rope_args(args: object, positive: tuple[str, ...], axes_meaning: str) -> None:
    """The checks FluxArgs and QwenImageArgs share, from their __post_init__: the `positive` fields are positive ints,
    axes_dims_rope is 3 positive even ints summing to head_dim (stored as a tuple; `axes_meaning` names the axes),
    kernels and attention are known names. Raises ValueError naming the class, the field and its value."""
    def bad(name: str, why: str) -> ValueError:
        return ValueError(f"{type(args).__name__}.{name}={getattr(args, name)!r}: {why}")

    for name in positive:
        value = getattr(args, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise bad(name, "must be a positive int")
    object.__setattr__(args, "axes_dims_rope", tuple(args.axes_dims_rope))
    axes = args.axes_dims_rope
    if len(axes) != 3 or any(not isinstance(d, int) or isinstance(d, bool) or d <= 0 or d % 2 for d in axes):
        raise bad("axes_dims_rope", f"must be 3 positive even ints (the id axes: {axes_meaning})")
    if sum(axes) != args.head_dim:
        raise bad("axes_dims_rope", f"must sum to head_dim = {args.head_dim}")
    if args.kernels not in KERNEL_IMPLS:
        raise bad("kernels", f"must be one of {KERNEL_IMPLS}")
    if args.attention not in ATTENTION_BACKENDS:
        raise bad("attention", f"must be one of {ATTENTION_BACKENDS}")


def merged_diffusers_config(config: dict, class_name: str, defaults: dict, source: str) -> dict:
    """A diffusers transformer's config.json over its class's __init__ defaults (private `_` keys dropped), after
    checking it names `class_name` and has no field `defaults` lacks; ``source`` names the config in errors."""
    name = config.get("_class_name", class_name)
    if name != class_name:
        raise ValueError(f"{source}: _class_name is {name!r}, expected {class_name!r}")
    unknown = sorted(k for k in config if not k.startswith("_") and k not in defaults)
    if unknown:
        raise ValueError(f"{source}: unknown {class_name} field(s) {unknown}")
    return {**defaults, **{k: v for k, v in config.items() if not k.startswith("_")}}
