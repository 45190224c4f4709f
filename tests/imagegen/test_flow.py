"""imagegen/flow.py: the time convention, loss, timestep densities, and diffusers' sampler grid."""

import dataclasses
import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift as calculate_shift_ref
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

from atelier_studio.imagegen.flow import (
    FlowArgs,
    add_noise,
    calculate_shift,
    euler_sample,
    flow_loss,
    loss_weight,
    sample_timesteps,
    sampler_sigmas,
    velocity_target,
)


def pair(B=3, C=4, H=6, W=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, C, H, W, generator=g), torch.randn(B, C, H, W, generator=g)


def test_add_noise_ends_and_convention():
    x0, noise = pair()
    assert torch.equal(add_noise(x0, noise, torch.zeros(3)), x0)  # t = 0 is data
    assert torch.equal(add_noise(x0, noise, torch.ones(3)), noise)  # t = 1 is pure noise
    t = torch.tensor([0.1, 0.5, 0.9])
    xt = add_noise(x0, noise, t)
    # The velocity target is d x_t / dt along the straight path.
    h = 1e-3
    fd = (add_noise(x0, noise, t + h) - add_noise(x0, noise, t - h)) / (2 * h)
    torch.testing.assert_close(fd, velocity_target(x0, noise), atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(xt[1], 0.5 * (x0[1] + noise[1]))


@pytest.mark.parametrize("weighting", ["none", "sigma_sqrt", "cosmap"])
def test_oracle_velocity_has_zero_loss(weighting):
    x0, noise = pair()
    args = FlowArgs(loss_weighting=weighting)
    t = sample_timesteps(3, torch.Generator().manual_seed(1), args)
    loss = flow_loss(noise - x0, x0, noise, t, args)
    assert loss.shape == (3,) and torch.equal(loss, torch.zeros(3))
    bad = flow_loss(noise - x0 + 0.1, x0, noise, t, args)
    torch.testing.assert_close(bad, loss_weight(t, args) * 0.01)


@pytest.mark.parametrize("weighting", ["none", "sigma_sqrt", "cosmap"])
@pytest.mark.parametrize("precondition", [False, True])
def test_loss_matches_diffusers_sd3_script(weighting, precondition):
    """diffusers' train_dreambooth_sd3 loss, re-typed from the script (it is not importable)."""
    x0, noise = pair(seed=2)
    pred = torch.randn_like(x0)
    sigmas = torch.tensor([0.2, 0.55, 0.93])
    args = FlowArgs(loss_weighting=weighting, precondition_outputs=precondition)
    s = sigmas.reshape(-1, 1, 1, 1)
    noisy = (1.0 - s) * x0 + s * noise
    model_pred, target = (pred * (-s) + noisy, x0) if precondition else (pred, noise - x0)
    w = compute_loss_weighting_for_sd3(weighting, sigmas=s)
    expected = torch.mean((w.float() * (model_pred.float() - target.float()) ** 2).reshape(3, -1), 1)
    torch.testing.assert_close(flow_loss(pred, x0, noise, sigmas, args), expected, rtol=1e-5, atol=1e-6)


def test_euler_with_oracle_velocity_recovers_x0():
    x0, noise = pair()
    text, pooled = torch.randn(3, 7, 8), torch.randn(3, 5)
    calls = []

    def oracle(x, txt, pool, timestep):
        calls.append(timestep.clone())
        return torch.cat([noise - x0] * (x.shape[0] // 3))

    for g, shift in [(1.0, 3.0), (4.5, 1.0)]:
        calls.clear()
        out = euler_sample(oracle, noise, text, pooled, torch.zeros_like(text), torch.zeros_like(pooled),
                           num_steps=6, guidance_scale=g, shift=shift)
        torch.testing.assert_close(out, x0, atol=1e-5, rtol=1e-5)
        assert len(calls) == 6 and calls[0].shape == ((6,) if g != 1.0 else (3,))
        torch.testing.assert_close(calls[0], torch.full_like(calls[0], 1000.0))  # t = 1 -> timestep 1000


def test_euler_cfg_matches_diffusers_scheduler_loop():
    """A non-trivial velocity field, integrated here and by diffusers' scheduler + SD3 pipeline CFG."""
    torch.manual_seed(0)
    B, C, H, W, L, E, P = 2, 3, 4, 4, 5, 6, 7
    noise, text, pooled = torch.randn(B, C, H, W), torch.randn(B, L, E), torch.randn(B, P)
    neg_text, neg_pooled = torch.randn(B, L, E), torch.randn(B, P)
    mix = torch.randn(C, C)

    def model_fn(x, txt, pool, timestep):
        cond = txt.mean(dim=(1, 2)) + pool.mean(dim=1)  # [B]
        scale = (timestep / 1000)[:, None, None, None]
        return torch.einsum("dc,bchw->bdhw", mix, x) * scale + cond[:, None, None, None]

    steps, g, shift = 7, 5.0, 3.0
    sched = FlowMatchEulerDiscreteScheduler(shift=shift)
    sched.set_timesteps(steps)
    x = noise.clone()
    for t in sched.timesteps:
        v = model_fn(torch.cat([x, x]), torch.cat([neg_text, text]), torch.cat([neg_pooled, pooled]),
                     t.expand(2 * B))
        v_u, v_c = v.chunk(2)
        x = sched.step(v_u + g * (v_c - v_u), t, x).prev_sample
    out = euler_sample(model_fn, noise, text, pooled, neg_text, neg_pooled, num_steps=steps, guidance_scale=g,
                       shift=shift)
    torch.testing.assert_close(out, x, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("steps", [1, 2, 4, 28, 50])
@pytest.mark.parametrize("shift", [1.0, 3.0, 6.0])
def test_sigmas_equal_diffusers_scheduler(steps, shift):
    sched = FlowMatchEulerDiscreteScheduler(shift=shift)
    sched.set_timesteps(steps)
    # exact: sampler_sigmas runs diffusers' own sequence of numpy and torch ops, in the same dtypes
    assert torch.equal(sampler_sigmas(steps, shift), sched.sigmas)


@pytest.mark.parametrize("image_seq_len", [64, 256, 1024, 4096])
@pytest.mark.parametrize("steps", [4, 28])
def test_sigmas_with_dynamic_shifting_equal_diffusers(image_seq_len, steps):
    args = FlowArgs(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.16)
    sched = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.16)
    mu = calculate_shift_ref(image_seq_len, 256, 4096, 0.5, 1.16)
    assert calculate_shift(image_seq_len, args) == mu
    sched.set_timesteps(steps, mu=mu)
    assert torch.equal(  # exact: the same ops as diffusers' scheduler, in the same order (above)
        sampler_sigmas(steps, image_seq_len=image_seq_len, args=args), sched.sigmas)


def test_logit_normal_median_and_spread():
    n, g = 20_000, torch.Generator().manual_seed(0)
    for mean, std in [(0.0, 1.0), (0.5, 0.6)]:
        t = sample_timesteps(n, g, FlowArgs(logit_mean=mean, logit_std=std, shift=1.0))
        assert 0 < t.min() and t.max() < 1
        logit = torch.logit(t.double())
        assert abs(t.median().item() - 1 / (1 + math.exp(-mean))) < 0.01
        assert abs(logit.std().item() - std) < 0.03 * std
    # shift 3 moves the median from 1/2 to 3*0.5/(1+2*0.5) = 0.75 (more time near noise).
    t = sample_timesteps(n, g, FlowArgs(shift=3.0))
    assert abs(t.median().item() - 0.75) < 0.01


@pytest.mark.parametrize("scheme", ["logit_normal", "mode", "uniform"])
def test_unshifted_density_equals_diffusers(scheme):
    """With shift 1 the draw is diffusers' compute_density_for_timestep_sampling on the same RNG."""
    args = FlowArgs(timestep_sampling=scheme, shift=1.0, logit_mean=0.3, logit_std=0.8, mode_scale=1.29)
    ours = sample_timesteps(64, torch.Generator().manual_seed(7), args)
    ref = compute_density_for_timestep_sampling(scheme, 64, logit_mean=0.3, logit_std=0.8, mode_scale=1.29,
                                                generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(ours, ref.clamp(1e-5, 1 - 1e-5), rtol=0, atol=1e-7)


def test_dynamic_shift_grows_with_resolution():
    args = FlowArgs(use_dynamic_shifting=True)
    g = torch.Generator().manual_seed(0)
    small = sample_timesteps(4000, g, args, image_seq_len=256).median()
    large = sample_timesteps(4000, torch.Generator().manual_seed(0), args, image_seq_len=4096).median()
    assert abs(small - 1 / (1 + math.exp(-0.5))) < 0.02 and large > small  # mu = 0.5 at 256 tokens
    with pytest.raises(ValueError, match="needs image_seq_len"):
        sample_timesteps(4, g, args)


def test_bad_inputs_say_what():
    x0, noise = pair()
    with pytest.raises(ValueError, match=r"FlowArgs.timestep_sampling='lognorm'"):
        FlowArgs(timestep_sampling="lognorm")
    with pytest.raises(ValueError, match=r"FlowArgs.loss_weighting='sigma'"):
        dataclasses.replace(FlowArgs(), loss_weighting="sigma")
    with pytest.raises(ValueError, match=r"t must be \[B\] with B = 3"):
        add_noise(x0, noise, torch.zeros(2))
    with pytest.raises(ValueError, match="pred .* and x0 .* differ"):
        flow_loss(x0[:2], x0, noise, torch.zeros(3), FlowArgs())
    with pytest.raises(ValueError, match="needs neg_text and neg_pooled"):
        euler_sample(lambda *a: a[0], noise, torch.randn(3, 2, 4), torch.randn(3, 4), num_steps=2,
                     guidance_scale=3.0)
    with pytest.raises(ValueError, match="num_steps must be >= 1"):
        sampler_sigmas(0)
