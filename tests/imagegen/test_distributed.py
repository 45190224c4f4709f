"""The imagegen trainer on two processes (torchrun, gloo, CPU) against one process on the same global batch.

One torchrun launch (the `two` fixture, through the designer's generic worker tests/designer/dist_worker.py)
trains, with 2 ranks x micro_batch 4 (global micro-batch 8), caption dropout and the EMA on, a sample grid
every 2 steps (its forwards are collectives: every rank samples, rank 0 writes):
  run        4 steps, checkpoints at 2 and 4, activation checkpointing on, sharded (meta-device) init
  cut        the same run stopped at step 2, then resumed with 2 processes to step 4
  full_init  as run, but every rank loads the whole model before sharding (init = "full")
  streams4   as run, with the data read as 4 streams: each rank holds 2 and runs their chunks one by one
  fp8        as run, train.precision = "fp8" (full fine-tuning, rowwise)
  fp8_cut    the same stopped at step 2, then resumed with 2 processes to step 4
  lora       as run, LoRA rank 4 on a frozen base (meta-device init: every rank draws the adapters as one
             process does and keeps its rows); the base is the world's model with every weight perturbed, since
             AdaLN-Zero's zero gates would keep the attention, and so the adapters, out of the loss
and the tests run the one-process twins here (1 rank x micro_batch 8 over the same 2 data streams: the same
images and draws each step, as 2 chunks of 4)
and compare losses and gradient norms (fp32, 1e-5), evaluation metrics, the exported transformer/ and ema/,
and resumes of the 2-process checkpoint with 1 and with 2 processes.

The bounds are the designer's (tests/designer/test_distributed.py derives them: two processes add the same
gradients in another order, and 4 gentle steps keep that rounding-sized): losses and gradient norms 1e-5,
weights 1e-5 + 1e-4 · |w|, which at lr 2e-3 is 0.5% of one Adam step. Measured: loss 4.8e-7, weights 2.3e-7
(norm_out.linear) on AVX-512 and on DEFAULT kernels with one thread.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from atelier_studio.flows.cli import main

from tests.imagegen._world import ROOT, build_world, cli_args

pytestmark = pytest.mark.multigpu

TOL = 1e-5
COMMON = ("train.max_steps=4", "train.save_every=2", "train.eval_every=0", "train.warmup_steps=1", "train.lr=2e-3",
          "train.device=cpu", "text.caption_dropout=0.3", "ema.decay=0.9", "sample.every=2", "sample.steps=2",
          "data.max_eval_images=13",  # 13: a short last eval batch, one rank's share empty in the 2-process run
          "data.streams=2")  # the data is read as 2 streams on 1 process and on 2: the same batches
TWO = ("train.micro_batch=4",)
ONE = ("train.micro_batch=8",)
LORA = ("lora.rank=4", "lora.alpha=8")
FP8 = ("train.precision=fp8", "train.fp8_recipe=rowwise")


def lora_base(world: Path) -> Path:
    """The world's tiny MMDiT with every weight perturbed (non-zero gates: the attention reaches the loss)."""
    from atelier_studio.imagegen.hf import load_pretrained, save_pretrained

    out = world / "model-perturbed"
    if not (out / "config.json").is_file():
        model = load_pretrained(world / "model")
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        save_pretrained(model, out, dtype=torch.float32)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    return build_world(tmp_path_factory.getbasetemp() / "imagegen-world")


def launch_two(runs: dict[str, list[str]], tmp: Path) -> None:
    """`torchrun --nproc-per-node 2` over the worker, which runs `runs` (name → atelier argv) in order."""
    spec = tmp / "runs.json"
    spec.write_text(json.dumps(runs))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "tests.designer.dist_worker", str(spec)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:]


@pytest.fixture(scope="module")
def two(world, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("imagegen-two")
    launch_two({
        "run": cli_args(world, d / "run", *COMMON, *TWO, "train.distributed.activation_checkpointing=full"),
        "cut": cli_args(world, d / "cut", *COMMON, *TWO, "train.max_steps=2"),
        "cut_resumed": cli_args(world, d / "cut", *COMMON, *TWO),
        "full_init": cli_args(world, d / "full_init", *COMMON, *TWO, "train.distributed.init=full"),
        "streams4": cli_args(world, d / "streams4", *COMMON, *TWO, "data.streams=4"),
        "lora": cli_args(world, d / "lora", *COMMON, *TWO, *LORA, f"model.path={lora_base(world)}"),
        "fp8": cli_args(world, d / "fp8", *COMMON, *TWO, *FP8),
        "fp8_cut": cli_args(world, d / "fp8_cut", *COMMON, *TWO, *FP8, "train.max_steps=2"),
        "fp8_cut_resumed": cli_args(world, d / "fp8_cut", *COMMON, *TWO, *FP8),
    }, d)
    return d


@pytest.fixture(scope="module")
def one(world, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("imagegen-one") / "run"
    assert main(cli_args(world, out, *COMMON, *ONE)) == 0
    return out


def records(out: Path, kind: str = "train") -> dict[int, dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if r["kind"] == kind}


def assert_same_losses(a: Path, b: Path, steps: range) -> None:
    ra, rb = records(a), records(b)
    for s in steps:
        assert ra[s]["loss_weight"] == rb[s]["loss_weight"] == 8, f"step {s}: different global batches"
        assert abs(ra[s]["loss"] - rb[s]["loss"]) <= TOL, f"step {s}: loss {ra[s]['loss']} vs {rb[s]['loss']}"
        assert abs(ra[s]["grad_norm"] - rb[s]["grad_norm"]) <= TOL * max(1.0, ra[s]["grad_norm"]), f"step {s}"
    print(f"{a.name} vs {b.name}, steps {steps.start}-{steps.stop - 1}: largest loss difference "
          f"{max(abs(ra[s]['loss'] - rb[s]['loss']) for s in steps):.2e}, grad norm "
          f"{max(abs(ra[s]['grad_norm'] - rb[s]['grad_norm']) for s in steps):.2e} (bound {TOL:g})")


def assert_same_export(a: Path, b: Path, name: str) -> None:
    assert json.loads((a / name / "config.json").read_text()) == json.loads((b / name / "config.json").read_text())
    ta = load_file(str(a / name / "diffusion_pytorch_model.safetensors"))
    tb = load_file(str(b / name / "diffusion_pytorch_model.safetensors"))
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape, k
        torch.testing.assert_close(ta[k], tb[k], rtol=1e-4, atol=TOL, msg=lambda m: f"{name} {k}: {m}")
    worst = max(((ta[k].double() - tb[k].double()).abs().max().item(), k) for k in ta)
    print(f"{a.name} vs {b.name} {name}: largest weight difference {worst[0]:.2e} ({worst[1]})")


def test_two_processes_equal_one(two, one):
    assert_same_losses(one, two / "run", range(1, 5))
    ev1, ev2 = records(one, "eval")[4], records(two / "run", "eval")[4]
    assert sorted(ev1) == sorted(ev2) and "ema_loss" in ev1 and "train_loss_t50" in ev1
    for k in (k for k in ev1 if k not in ("kind", "step")):
        assert abs(ev1[k] - ev2[k]) <= TOL, f"eval {k}: {ev1[k]} vs {ev2[k]}"
    for name in ("transformer", "ema"):
        assert_same_export(one, two / "run", name)
    a = load_file(str(two / "run" / "transformer" / "diffusion_pytorch_model.safetensors"))
    b = load_file(str(two / "run" / "ema" / "diffusion_pytorch_model.safetensors"))
    assert any(not torch.equal(a[k], b[k]) for k in a)  # the EMA export is the average, not the weights
    # the sample grid was rendered by both ranks and written once
    assert sorted(p.name for p in (two / "run" / "samples").iterdir()) == ["step-2.png", "step-4.png"]


def test_two_ranks_holding_two_streams_each_equal_one_process(world, two, tmp_path):
    """data.streams = 4 on 2 processes: each rank runs its 2 chunks of 2 images as 2 micro-batches of the step
    (every rank the same number of forwards under FSDP); one process runs all 4 and trains the same."""
    out = tmp_path / "one-streams4"
    assert main(cli_args(world, out, *COMMON, *ONE, "data.streams=4")) == 0
    assert_same_losses(out, two / "streams4", range(1, 5))


def test_full_init_trains_the_same(two):
    assert_same_losses(two / "run", two / "full_init", range(1, 5))


def test_sharded_checkpoint_holds_the_ema(two):
    ckpt = two / "run" / "checkpoints" / "step-2"
    names = {p.name for p in ckpt.iterdir()}
    assert {"shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors",
            "rank-1.json"} <= names and ".metadata" not in names
    state = json.loads((ckpt / "state.json").read_text())
    assert state["world_size"] == 2 and state["task"]["sampler"]["world_size"] == 2
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    keys = set(HuggingFaceStorageReader(str(ckpt)).read_metadata().state_dict_metadata)  # the headers: JSON
    assert any(k.startswith("task.ema.transformer_blocks.0.") for k in keys), sorted(keys)[:10]


def test_resume_with_two_processes_is_exact(two):
    assert_same_losses(two / "run", two / "cut", range(1, 5))
    for name in ("transformer", "ema"):
        assert_same_export(two / "run", two / "cut", name)


def test_resume_two_process_checkpoint_with_one_process(world, two, tmp_path):
    out = tmp_path / "resumed1"
    shutil.copytree(two / "run", out, ignore=shutil.ignore_patterns("step-4", "transformer", "ema"))
    assert main(cli_args(world, out, *COMMON, *ONE)) == 0
    assert_same_losses(two / "run", out, range(3, 5))
    for name in ("transformer", "ema"):
        assert_same_export(two / "run", out, name)


def test_resume_with_another_global_batch_is_refused(world, two, tmp_path, capsys):
    out = tmp_path / "resumed-wrong"
    shutil.copytree(two / "run", out, ignore=shutil.ignore_patterns("step-4", "transformer", "ema"))
    assert main(cli_args(world, out, *COMMON, "train.micro_batch=4")) == 2
    err = capsys.readouterr().err
    assert "global batch is 2 ranks x 4 = 8" in err and "processes x micro_batch = 8" in err


def test_lora_on_two_processes_equals_one(world, two, tmp_path):
    """The adapters start from the same draws (sharded init), train the same and export the same LoRA files."""
    from atelier_studio.imagegen.lora import LORA_FILE

    out = tmp_path / "one-lora"
    assert main(cli_args(world, out, *COMMON, *ONE, *LORA, f"model.path={lora_base(world)}")) == 0
    assert_same_losses(out, two / "lora", range(1, 5))
    for name in ("lora", "lora_ema"):
        ta, tb = load_file(str(out / name / LORA_FILE)), load_file(str(two / "lora" / name / LORA_FILE))
        assert sorted(ta) == sorted(tb) and any("lora_B" in k and ta[k].abs().max() > 0 for k in ta)
        for k in ta:  # the module docstring's weight bound
            torch.testing.assert_close(ta[k], tb[k], rtol=1e-4, atol=TOL, msg=lambda m: f"{name} {k}: {m}")
    assert not (two / "lora" / "transformer").exists()


def test_fp8_on_two_processes_equals_one(world, two, tmp_path):
    """FP8 full fine-tuning under FSDP2: the blocks' weights gathered whole and quantised as one process quantises
    them; one process runs the step as the same 2 chunks of 4 (data.streams = 2), so the recipe's scales, taken
    over a chunk's tokens, are the same. Step 1 within TOL; then a weight that the gradients' rounding moved across
    an E4M3 rounding boundary can move the losses by more than rounding (tests/designer/test_distributed.py's
    full_fp8 test derives the bounds: losses 1e-3, weights 3 lr)."""
    out = tmp_path / "one-fp8"
    assert main(cli_args(world, out, *COMMON, *ONE, *FP8)) == 0
    assert_same_losses(out, two / "fp8", range(1, 2))
    ra, rb = records(out), records(two / "fp8")
    for step in range(2, 5):
        assert abs(ra[step]["loss"] - rb[step]["loss"]) <= 1e-3, (step, ra[step]["loss"], rb[step]["loss"])
    ta = load_file(str(out / "transformer" / "diffusion_pytorch_model.safetensors"))
    tb = load_file(str(two / "fp8" / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert sorted(ta) == sorted(tb)
    for k in ta:
        torch.testing.assert_close(ta[k], tb[k], rtol=0, atol=3 * 2e-3, msg=lambda m: f"{k}: {m}")


def test_fp8_resume_with_two_processes_is_exact(two):
    """Stopped at step 2 and resumed on 2 processes: the sharded checkpoint loads into the FP8 linears (the frozen
    one, the last block's text-query projection, makes its fp8 copies from the gathered weight, not its shard) and
    the run equals the uninterrupted one."""
    assert_same_losses(two / "fp8", two / "fp8_cut", range(1, 5))
    assert_same_export(two / "fp8", two / "fp8_cut", "transformer")
