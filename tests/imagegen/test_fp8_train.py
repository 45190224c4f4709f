"""The imagegen trainer with `train.precision = "fp8"` on the CPU (the fake-quantised reference): the MMDiT learns,
its exports hold the same tensors as the model it started from, and resume is exact."""
from __future__ import annotations

from pathlib import Path

import pytest
from safetensors import safe_open

from atelier_studio.flows.cli import main
from tests.imagegen._world import build_world, cli_args
from tests.imagegen.test_task import train_losses


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    return build_world(tmp_path_factory.getbasetemp() / "imagegen-world")


def _tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    with safe_open(str(path), framework="pt") as f:
        return {k: (str(f.get_slice(k).get_dtype()), tuple(f.get_slice(k).get_shape())) for k in f.keys()}


def test_fp8_mmdit_learns_and_exports_the_same_tensors(world, tmp_path, capsys):
    """The blocks' linears run in FP8 (the swap is logged; AdaLN-Zero makes the first steps' losses equal to a bf16
    run's to the printed digits, so they prove nothing); the per-image ones stay as they are."""
    out = tmp_path / "fp8"
    assert main(cli_args(world, out, "train.max_steps=40", "train.lr=2e-3", "train.warmup_steps=5",
                         "train.precision=fp8", "train.fp8_recipe=tensorwise", "train.save_every=40")) == 0
    # 2 blocks: q, k, v, out, add_q/k/v, add_out, ff ×2, ff_context ×2 (12), less the last block's add_out and
    # ff_context (3: it only reads the text), plus the caption projection
    assert "fp8 (tensorwise): 22 linear layers in FP8" in capsys.readouterr().out
    losses = [l for _, l in train_losses(out)]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.7 * first, (first, last)
    name = "diffusion_pytorch_model.safetensors"
    init = _tensors(world / "model" / name)
    assert _tensors(out / "transformer" / name) == init and _tensors(out / "ema" / name) == init


def test_fp8_resume_is_exact(world, tmp_path):
    args = ("train.schedule=constant", "train.warmup_steps=0", "train.precision=fp8", "train.save_every=2")
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(cli_args(world, straight, *args, "train.max_steps=4")) == 0
    assert main(cli_args(world, split, *args, "train.max_steps=2")) == 0
    assert main(cli_args(world, split, *args, "train.max_steps=4")) == 0
    assert train_losses(split)[-2:] == train_losses(straight)[-2:]
