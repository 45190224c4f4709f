"""The imagegen trainer end to end through the CLI: it learns, samples, exports diffusers weights, resumes exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from atelier_studio.flows.cli import main
from atelier_studio.imagegen.ema import EMA, ema_decay, ema_update_ref

from tests.imagegen._world import ROOT, build_world, cli_args


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    return build_world(tmp_path_factory.getbasetemp() / "imagegen-world")


def records(out: Path, kind: str) -> list[dict]:
    return [r for r in (json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def train_losses(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in records(out, "train")]


def test_learns_samples_and_exports(world, tmp_path):
    out = tmp_path / "run"
    code = main(cli_args(world, out, "train.max_steps=40", "train.lr=2e-3", "train.warmup_steps=5",
                         "train.eval_every=20", "sample.every=20", "sample.steps=4", "train.save_every=20"))
    assert code == 0
    losses = [l for _, l in train_losses(out)]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.6 * first, (first, last)
    assert (out / "samples" / "step-20.png").is_file() and (out / "samples" / "step-40.png").is_file()
    evals = records(out, "eval")
    assert [r["step"] for r in evals] == [20, 40]
    for key in ("loss", "ema_loss", "loss_t00", "loss_t75", "train_loss_t50"):
        assert key in evals[-1], key
    assert evals[-1]["loss"] < evals[0]["loss"] * 1.05  # held-out loss does not blow up
    meta = json.loads((out / "imagegen.json").read_text())
    assert meta["autoencoder"] == "pixel:2" and meta["resolution"] == 32

    from diffusers import SD3Transformer2DModel

    from atelier_studio.imagegen.hf import load_pretrained

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 12, 16, 16, generator=g)
    text, pooled = torch.randn(2, 24, 384, generator=g), torch.randn(2, 384, generator=g)
    t = torch.tensor([250.0, 800.0])
    for name in ("transformer", "ema"):
        ref = SD3Transformer2DModel.from_pretrained(out / name, torch_dtype=torch.float32).eval()
        ours = load_pretrained(out / name)
        with torch.no_grad():
            want = ref(hidden_states=x, encoder_hidden_states=text, pooled_projections=pooled, timestep=t).sample
            got = ours(x, text, pooled, t)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    a, b = load_file(out / "transformer" / "diffusion_pytorch_model.safetensors"), \
        load_file(out / "ema" / "diffusion_pytorch_model.safetensors")
    assert any(not torch.equal(a[k], b[k]) for k in a)  # the EMA is its own set of weights


def _spawn(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "atelier_studio.flows.cli", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def kill_after_checkpoint(args: list[str], out: Path, step: int, max_steps: int) -> None:
    """Run the CLI with `args` in a subprocess and kill -9 it once checkpoints/step-`step` exists (before the end)."""
    proc = _spawn(args)
    deadline = time.time() + 120
    while not (out / "checkpoints" / f"step-{step}").is_dir():
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert max(s for s, _ in train_losses(out)) < max_steps, "the run finished before it could be killed"


@pytest.mark.parametrize("optimizer", [
    "adamw",
    # schedule-free: its averaged weights go in and out around the samples, evaluations and export, and its state
    # (z, the second moment, the average's weight sum) must come back from the checkpoint
    pytest.param("schedulefree_adamw", marks=pytest.mark.slow),
])
def test_sigkill_then_resume_is_exact(world, tmp_path, optimizer):
    """Kill -9 after a checkpoint; the resumed run's losses, eval metrics and EMA equal the uninterrupted run's.

    Samples and evaluation run on the way (their private generators must not move the training RNG), and
    caption dropout is on (it draws from the checkpointed RNG)."""
    common = ["train.max_steps=32", "train.save_every=8", "train.eval_every=16", "sample.every=8", "sample.steps=2",
              "text.caption_dropout=0.3", "ema.decay=0.9", "ema.update_every=2", "train.micro_batch=4",
              f"train.optimizer={optimizer}"]
    if optimizer == "schedulefree_adamw":
        common.append("train.schedule=constant")
    ref = tmp_path / "ref"
    assert main(cli_args(world, ref, *common)) == 0

    out = tmp_path / "killed"
    kill_after_checkpoint(cli_args(world, out, *common), out, step=8, max_steps=32)
    assert main(cli_args(world, out, *common)) == 0
    assert train_losses(out) == train_losses(ref)
    assert records(out, "eval")[-1] == records(ref, "eval")[-1]
    for name in ("transformer", "ema"):
        a = load_file(ref / name / "diffusion_pytorch_model.safetensors")
        b = load_file(out / name / "diffusion_pytorch_model.safetensors")
        assert all(torch.equal(a[k], b[k]) for k in a), name


def test_ema_decay_warms_up():
    assert [ema_decay(0.999, n) for n in range(3)] == [0.1, 2 / 11, 0.25]
    assert ema_decay(0.999, 10**6) == 0.999


def test_ema_update_matches_formula_and_round_trips():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    model[1].bias.requires_grad_(False)  # frozen weights are not averaged
    ema = EMA(model, decay=0.8, update_every=2)
    ref = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    for step in range(1, 6):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ema.update(step)
        if step % 2 == 0:
            ema_update_ref(ref, dict(model.named_parameters()), ema_decay(0.8, step // 2 - 1))
    state = ema.state_tensors()
    assert sorted(state) == sorted(f"ema.{n}" for n in ref)
    for n, want in ref.items():
        torch.testing.assert_close(state[f"ema.{n}"], want, rtol=1e-6, atol=1e-6)

    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    with ema.swapped_in():
        for n in ref:
            assert torch.equal(dict(model.named_parameters())[n], state[f"ema.{n}"])
    assert all(torch.equal(p, trained[n]) for n, p in model.named_parameters())

    other = EMA(model, decay=0.8)
    other.load_state_tensors({k: v.clone() for k, v in state.items()})
    assert all(torch.equal(a, b) for a, b in zip(other.shadow, ema.shadow))
    with pytest.raises(ValueError, match="no EMA weights"):
        other.load_state_tensors({})


def test_text_width_mismatch_names_both_numbers(world, tmp_path, capsys):
    from atelier_studio.imagegen.hf import init_random

    init_random("tiny", tmp_path / "m48", dtype=torch.float32, in_channels=12, out_channels=12)  # 48 / 40 wide
    code = main(cli_args(world, tmp_path / "run", f"model.path={tmp_path / 'm48'}", "train.max_steps=1",
                         "train.warmup_steps=0"))
    assert code == 2
    err = capsys.readouterr().err
    assert "384" in err and "joint_attention_dim 48" in err and "pooled_projection_dim 40" in err
