"""Rectified flow for the MMDiT: timestep sampling, noising, loss, and the Euler sampler.

THE time convention (the only place it is written; diffusers' FlowMatchEulerDiscreteScheduler):

    x_t = (1 - t) * x0 + t * noise,    t in [0, 1],  t = 0 is data, t = 1 is pure noise
    v   = dx_t/dt = noise - x0          the velocity target; the model predicts v
    the model is called with timestep = t * 1000 ("sigma * 1000" in diffusers)
    sampling integrates dx = v dt from t = 1 down to t = 0 (Euler, dt < 0)

(minRF and lucidrains' code use the opposite end for noise; SD3 and diffusers use this one.)

Choices, each written down once (SD3 paper, arXiv:2403.03206, sec. 3.1 and 5.3.2):
    timesteps     u ~ logit-normal(mean 0, std 1) by default, then the shift below
    shift         t = s*u / (1 + (s-1)*u), s = 3.0 for SD3 (more steps near noise at high res);
                  or, with dynamic shifting, t = e^mu / (e^mu + 1/u - 1), mu linear in image tokens
    loss          per-sample mean over C,H,W of w(t) * (v_pred - v)^2, w from ``loss_weighting``;
                  ``precondition_outputs`` adds diffusers' default factor t^2 (its x0-space loss)
    masked loss   with a mask m [B,H,W] in [0, 1] (``data.mask``, cached at latent resolution): per sample
                  sum(m * err) / (C * sum(m)), the mean over the masked positions, normalised PER SAMPLE: each
                  image keeps the weight of one loss unit whatever its masked area (the loop averages over images,
                  pipeline/task.py), so a small subject is not drowned by a large one, accumulation and ranks
                  stay exact (a per-batch normalisation would need the global sum of m), and an all-ones mask is
                  the unmasked loss. An all-zero mask gives 0 (the image then adds nothing but still counts).

Shape legend: B batch, C channels, H/W latent height/width, L text tokens, E text width, P pooled width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

NUM_TRAIN_TIMESTEPS = 1000  # diffusers' scale for model timesteps and the scheduler's sigma grid
_T_EPS = 1e-5  # keeps t inside (0, 1): sigma_sqrt weighting is 1/t^2


@dataclass(frozen=True)
class FlowArgs:
    """Training-time flow settings (diffusers' SD3 script names in comments)."""

    timestep_sampling: str = "logit_normal"  # weighting_scheme: "logit_normal" | "mode" | "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    shift: float = 3.0  # scheduler shift; 1.0 = none
    use_dynamic_shifting: bool = False  # resolution-dependent shift instead of ``shift``
    base_image_seq_len: int = 256
    max_image_seq_len: int = 4096
    base_shift: float = 0.5
    max_shift: float = 1.15
    loss_weighting: str = "none"  # "none" | "sigma_sqrt" | "cosmap"
    precondition_outputs: bool = False

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise ValueError(f"FlowArgs.{name}={getattr(self, name)!r}: {why}")

        check(self.timestep_sampling in ("logit_normal", "mode", "uniform"), "timestep_sampling",
              'must be "logit_normal", "mode" or "uniform"')
        check(self.logit_std > 0, "logit_std", "must be > 0")
        check(self.shift > 0, "shift", "must be > 0")
        check(self.loss_weighting in ("none", "sigma_sqrt", "cosmap"), "loss_weighting",
              'must be "none", "sigma_sqrt" or "cosmap"')
        check(self.max_image_seq_len != self.base_image_seq_len, "max_image_seq_len",
              "must differ from base_image_seq_len (the shift is linear between them)")


def calculate_shift(image_seq_len: int, args: FlowArgs) -> float:
    """mu for dynamic shifting: linear in image tokens from (base_len, base_shift) to (max_len, max_shift)."""
    m = (args.max_shift - args.base_shift) / (args.max_image_seq_len - args.base_image_seq_len)
    b = args.base_shift - m * args.base_image_seq_len
    return image_seq_len * m + b


def shift_timesteps(u, shift: float = 1.0, mu: float | None = None):
    """Map uniform-grid t to shifted t: static s*t/(1+(s-1)*t), or e^mu/(e^mu + 1/t - 1) given mu.
    Works on tensors and numpy arrays alike (the sampler grid is built in numpy as diffusers does)."""
    if mu is not None:
        return math.exp(mu) / (math.exp(mu) + (1 / u - 1) ** 1.0)
    return shift * u / (1 + (shift - 1) * u)


def _mu(args: FlowArgs, image_seq_len: int | None, where: str) -> float | None:
    if not args.use_dynamic_shifting:
        return None
    if image_seq_len is None:
        raise ValueError(f"{where}: FlowArgs.use_dynamic_shifting needs image_seq_len (image tokens per sample)")
    return calculate_shift(image_seq_len, args)


def sample_timesteps(batch: int, generator: torch.Generator | None, args: FlowArgs,
                     image_seq_len: int | None = None, device: str | torch.device = "cpu") -> torch.Tensor:
    """[B] training times t in (0, 1) (1 = noise): density from ``timestep_sampling``, then shifted.

    Same densities as diffusers' ``compute_density_for_timestep_sampling``; diffusers then snaps u to
    the scheduler's 1000-step grid, here t stays continuous.
    """
    if args.timestep_sampling == "logit_normal":
        u = torch.normal(args.logit_mean, args.logit_std, (batch,), generator=generator, device=device).sigmoid()
    else:
        u = torch.rand((batch,), generator=generator, device=device)
        if args.timestep_sampling == "mode":
            u = 1 - u - args.mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    u = u.clamp(_T_EPS, 1 - _T_EPS)
    return shift_timesteps(u, args.shift, _mu(args, image_seq_len, "sample_timesteps")).clamp(_T_EPS, 1 - _T_EPS)


def _expand(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if t.ndim != 1 or t.shape[0] != like.shape[0]:
        raise ValueError(f"t must be [B] with B = {like.shape[0]} (batch of x0 {tuple(like.shape)}), "
                         f"got {tuple(t.shape)}")
    return t.reshape(-1, *([1] * (like.ndim - 1)))  # [B, 1, 1, 1]


def add_noise(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t = (1 - t) x0 + t noise; x0, noise [B, C, H, W], t [B]."""
    if x0.shape != noise.shape:
        raise ValueError(f"add_noise: x0 {tuple(x0.shape)} and noise {tuple(noise.shape)} differ")
    t = _expand(t, x0).to(x0.dtype)
    return (1 - t) * x0 + t * noise


def velocity_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """v = noise - x0 (d x_t / dt)."""
    return noise - x0


def loss_weight(t: torch.Tensor, args: FlowArgs) -> torch.Tensor:
    """[B] fp32 weights, diffusers' ``compute_loss_weighting_for_sd3`` (+ t^2 if preconditioned)."""
    t = t.float()
    if args.loss_weighting == "sigma_sqrt":
        w = t**-2.0
    elif args.loss_weighting == "cosmap":
        w = 2 / (math.pi * (1 - 2 * t + 2 * t**2))
    else:
        w = torch.ones_like(t)
    if args.precondition_outputs:
        # diffusers' default: loss on x0_pred = x_t - t*v_pred against x0, i.e. t^2 (v_pred - v)^2.
        w = w * t**2
    return w


def flow_loss(pred: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor,
              args: FlowArgs, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sample loss [B] (fp32): w(t) * mean over C, H, W of (pred - (noise - x0))^2; with `mask` [B, H, W] the
    mask-weighted mean, sum(m * err) / (C * sum(m)) per sample (the module docstring says why per sample)."""
    if pred.shape != x0.shape:
        raise ValueError(f"flow_loss: pred {tuple(pred.shape)} and x0 {tuple(x0.shape)} differ")
    _expand(t, x0)
    err = (pred.float() - velocity_target(x0.float(), noise.float())).square()  # [B, C, H, W]
    if mask is None:
        return loss_weight(t, args) * err.reshape(err.shape[0], -1).mean(dim=1)
    if mask.shape != (x0.shape[0], *x0.shape[2:]):
        raise ValueError(f"flow_loss: mask {tuple(mask.shape)} does not match latents {tuple(x0.shape)} ([B, H, W])")
    m = mask.float()
    weighted = (err * m[:, None]).reshape(err.shape[0], -1).sum(dim=1)  # [B]
    area = m.reshape(m.shape[0], -1).sum(dim=1) * err.shape[1]  # [B]: C * sum(m)
    return loss_weight(t, args) * weighted / area.clamp_min(torch.finfo(torch.float32).tiny)


SIGMA_GRIDS = ("scheduler", "linspace")


def sampler_sigmas(num_steps: int, shift: float = 3.0, image_seq_len: int | None = None,
                   args: FlowArgs | None = None, grid: str = "scheduler") -> torch.Tensor:
    """[num_steps + 1] fp32 times from ~1 down to 0, equal to diffusers'
    ``FlowMatchEulerDiscreteScheduler(shift=shift).set_timesteps(num_steps).sigmas``.

    With ``args.use_dynamic_shifting`` the shift comes from ``image_seq_len`` instead (the
    scheduler's ``use_dynamic_shifting=True`` with ``mu = calculate_shift(image_seq_len)``).
    ``grid`` "scheduler" (StableDiffusion3Pipeline): the scheduler's own grid, whose quirk is kept on
    purpose: the last point is the *shifted* 1/1000, and the linspace between the ends is shifted again.
    "linspace" (FluxPipeline): the pipeline passes ``sigmas = linspace(1, 1/n, n)``, shifted once.
    """
    if num_steps < 1:
        raise ValueError(f"sampler_sigmas: num_steps must be >= 1, got {num_steps}")
    if grid not in SIGMA_GRIDS:
        raise ValueError(f"sampler_sigmas: grid must be one of {SIGMA_GRIDS}, got {grid!r}")
    mu = _mu(args, image_seq_len, "sampler_sigmas") if args is not None else None
    if grid == "linspace":  # set_timesteps(sigmas=...): float32, shifted (dynamic or static), then 0 appended
        sigmas = shift_timesteps(np.linspace(1.0, 1 / num_steps, num_steps).astype(np.float32), shift, mu)
        return torch.cat([torch.from_numpy(np.asarray(sigmas)).to(torch.float32), torch.zeros(1)])
    # Scheduler __init__: the 1000-step training grid (float32), shifted unless shifting is dynamic.
    grid = torch.arange(NUM_TRAIN_TIMESTEPS, 0, -1, dtype=torch.float32) / NUM_TRAIN_TIMESTEPS
    if mu is None:
        grid = shift * grid / (1 + (shift - 1) * grid)
    sigma_max, sigma_min = grid[0].item(), grid[-1].item()
    # set_timesteps: float64 numpy linspace between the ends, shifted, cast to float32, then 0 appended.
    sigmas = np.linspace(sigma_max * NUM_TRAIN_TIMESTEPS, sigma_min * NUM_TRAIN_TIMESTEPS, num_steps)
    sigmas = shift_timesteps(sigmas / NUM_TRAIN_TIMESTEPS, shift, mu)
    return torch.cat([torch.from_numpy(sigmas).to(torch.float32), torch.zeros(1)])


ModelFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@torch.no_grad()
def euler_sample(model_fn: ModelFn, noise: torch.Tensor, text: torch.Tensor, pooled: torch.Tensor,
                 neg_text: torch.Tensor | None = None, neg_pooled: torch.Tensor | None = None,
                 num_steps: int = 28, guidance_scale: float = 7.0, shift: float = 3.0,
                 image_seq_len: int | None = None, args: FlowArgs | None = None, grid: str = "scheduler",
                 model_kwargs: dict | None = None,
                 cfg_rescale: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Integrate from ``noise`` (t = 1) to x0 (t = 0) with Euler steps on ``sampler_sigmas`` (``grid``).

    model_fn(latents [B,C,H,W], text [B,L,E], pooled [B,P], timestep [B] = t*1000, **model_kwargs) -> v [B,C,H,W]
    (``model_kwargs``: e.g. FLUX.1-dev's embedded guidance [B]).
    With ``guidance_scale != 1`` classifier-free guidance runs one batched call on
    [uncond; cond] (diffusers' order): v = v_u + g (v_c - v_u), then ``cfg_rescale(v, v_c)`` where the family's
    pipeline corrects it (Family.cfg_rescale). The state stays fp32 between steps
    (diffusers' ``step`` adds in fp32 but casts back to the model dtype each step; in fp32 the two
    are identical, in bf16 ours rounds less). The model sees the state in ``noise.dtype``.
    """
    B = noise.shape[0]
    if text.shape[0] != B or pooled.shape[0] != B:
        raise ValueError(f"euler_sample: text {tuple(text.shape)} / pooled {tuple(pooled.shape)} batch != "
                         f"noise batch {B}")
    cfg = guidance_scale != 1.0
    if cfg:
        if neg_text is None or neg_pooled is None:
            raise ValueError(f"euler_sample: guidance_scale={guidance_scale} needs neg_text and neg_pooled")
        if neg_text.shape != text.shape or neg_pooled.shape != pooled.shape:
            raise ValueError(f"euler_sample: neg_text {tuple(neg_text.shape)} / neg_pooled "
                             f"{tuple(neg_pooled.shape)} must match text {tuple(text.shape)} / "
                             f"pooled {tuple(pooled.shape)}")
        text, pooled = torch.cat([neg_text, text]), torch.cat([neg_pooled, pooled])  # [2B, L, E], [2B, P]
    model_kwargs = {k: torch.cat([v, v]) if cfg else v for k, v in (model_kwargs or {}).items()}  # [B or 2B]
    sigmas = sampler_sigmas(num_steps, shift, image_seq_len, args, grid).to(noise.device)
    x = noise.float()
    for i in range(num_steps):
        x_in = x.to(noise.dtype)
        if cfg:
            x_in = torch.cat([x_in, x_in])  # [2B, C, H, W]
        timestep = (sigmas[i] * NUM_TRAIN_TIMESTEPS).expand(x_in.shape[0])  # [B or 2B]
        v = model_fn(x_in, text, pooled, timestep, **model_kwargs)
        if cfg:
            v_uncond, v_cond = v.chunk(2)
            v = v_uncond + guidance_scale * (v_cond - v_uncond)
            if cfg_rescale is not None:
                v = cfg_rescale(v, v_cond)
        x = x + (sigmas[i + 1] - sigmas[i]) * v.float()
    return x.to(noise.dtype)
