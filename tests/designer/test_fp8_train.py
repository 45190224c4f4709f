"""The designer trainer with `train.precision = "fp8"` on the CPU (the fake-quantised reference): full fine-tuning
and LoRA learn, the checkpoint and the exports hold the same tensors as a bf16 run's, and resume is exact."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from atelier_studio.flows.cli import main

from tests.designer.test_train import train_args, train_losses


def _tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name → (dtype, shape) of a safetensors file."""
    with safe_open(str(path), framework="pt") as f:
        return {k: (str(f.get_slice(k).get_dtype()), tuple(f.get_slice(k).get_shape())) for k in f.keys()}


@pytest.mark.parametrize("lora, drop", [("0", 0.8), ("4", 0.95)])  # 24 steps: rank 4 learns more slowly
def test_fp8_run_learns_and_saves_what_bf16_saves(world, tmp_path, lora, drop):
    fp8_out, bf16_out = tmp_path / "fp8", tmp_path / "bf16"
    common = ("--set", f"lora.rank={lora}", "--set", "train.lr=3e-3", "--set", "train.warmup_steps=3",
              "--set", "train.save_every=24")
    assert main(train_args(world, fp8_out, *common, "--set", "train.max_steps=24", "--set", "train.precision=fp8",
                           "--set", "train.fp8_recipe=rowwise")) == 0
    losses = [l for _, l in train_losses(fp8_out)]
    assert sum(losses[-5:]) / 5 < drop * sum(losses[:5]) / 5, losses  # it learns
    assert main(train_args(world, bf16_out, *common, "--set", "train.max_steps=1",
                           "--set", "train.warmup_steps=1")) == 0
    bf16_losses = [l for _, l in train_losses(bf16_out)]
    assert bf16_losses[0] != losses[0]  # the first step's loss differs: the fp8 run really quantised
    for rel in ("checkpoints/step-24/model.safetensors", "adapter/adapter_model.safetensors" if lora != "0"
                else "model/model.safetensors"):
        other = rel.replace("step-24", "step-1")
        assert _tensors(fp8_out / rel) == _tensors(bf16_out / other), rel
    cfg = (fp8_out / "config.toml").read_text()
    assert 'precision = "fp8"' in cfg and 'fp8_recipe = "rowwise"' in cfg
    # said in the log and the summary: no FP8 hardware here, the run is an emulation for tests
    emulated = 'train.precision = "fp8": emulated (no FP8 hardware): for tests only'
    assert emulated in json.loads((fp8_out / "summary.json").read_text())["fallbacks"]["precision"]
    assert "precision" not in json.loads((bf16_out / "summary.json").read_text()).get("fallbacks", {})


def test_fp8_lora_on_a_cpu_quantises_nothing_with_triton(world, monkeypatch):
    """A CPU runs the reference path, which quantises from the weight itself: the bases' fp8 copies (a Triton pass,
    which without a GPU died with Triton's "0 active drivers" outside the tests' interpreter) are never made."""
    import torch

    from atelier_studio.designer.lora import LoRALinear
    from atelier_studio.pipeline import float8, lora_fp8
    from atelier_studio.pipeline.lora import LoraArgs

    def no_triton(*args, **kwargs):
        raise AssertionError("quantize_frozen_weight called on a CPU")

    monkeypatch.setattr(lora_fp8, "quantize_frozen_weight", no_triton)
    lora = LoRALinear(torch.nn.Linear(32, 16, bias=False), LoraArgs(rank=4, alpha=4))
    layer = lora_fp8.Float8LoRALinear.from_lora(lora, "rowwise")
    assert layer.fp8_weight() is None and layer.shared_input_operands() is None  # alone, on the reference path
    x = torch.randn(3, 32, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and layer.lora_A.weight.grad is not None
    frozen = torch.nn.Linear(32, 16).requires_grad_(False)
    monkeypatch.setattr("atelier_studio.pipeline.float8.quantize_frozen_weight", no_triton)
    assert float8.Float8Linear.from_linear(frozen, "rowwise")(x).shape == (3, 16)


def test_fp8_resume_is_exact(world, tmp_path):
    """Stop at step 2 (a checkpoint), run again to step 4: the losses equal one uninterrupted fp8 run's (constant
    schedule, so the stop does not change the learning rates)."""
    args = ("--set", "lora.rank=4", "--set", "train.schedule=constant", "--set", "train.warmup_steps=0",
            "--set", "train.precision=fp8", "--set", "train.fp8_recipe=tensorwise", "--set", "train.save_every=2")
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(train_args(world, straight, *args, "--set", "train.max_steps=4")) == 0
    assert main(train_args(world, split, *args, "--set", "train.max_steps=2")) == 0
    assert main(train_args(world, split, *args, "--set", "train.max_steps=4")) == 0
    assert train_losses(split)[-2:] == train_losses(straight)[-2:]
    assert [s for s, _ in train_losses(straight)] == [1, 2, 3, 4]


def test_fp8_lora_refused_under_torchrun_names_the_key(world, tmp_path, monkeypatch, capsys):
    """LoRA over FP8 bases on several processes: exit 2 with one line naming train.precision and the way out
    (checked before any model is loaded). Full fine-tuning in FP8 runs there (tests/designer/test_distributed.py)."""
    from atelier_studio.designer import task as designer_task
    from atelier_studio.pipeline.distributed import DistContext

    real = designer_task.DesignerTask.__init__

    def as_rank(self, cfg, device, dist=None):
        real(self, cfg, device, DistContext(device=device, rank=0, world_size=2, enabled=True))

    monkeypatch.setattr(designer_task.DesignerTask, "__init__", as_rank)
    code = main(train_args(world, tmp_path / "dist", "--set", "train.precision=fp8", "--set", "train.max_steps=1",
                           "--set", "lora.rank=4"))
    assert code == 2
    err = capsys.readouterr().err
    assert 'train.precision = "fp8" with LoRA runs on one process' in err and "lora.rank = 0" in err
