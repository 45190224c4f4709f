"""The imagegen trainer with `train.precision = "fp8"` on the CPU (the fake-quantised reference): full fine-tuning and
LoRA over FP8 bases learn, the exports hold the same tensors as the model it started from (full) or as a bf16 LoRA
run's adapters (LoRA), and resume is exact."""
from __future__ import annotations

from pathlib import Path

import pytest
from safetensors import safe_open

from atelier_studio.flows.cli import main

from tests.imagegen._world import build_world, cli_args
from tests.imagegen.test_distributed import lora_base
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


# on the world's model with every weight perturbed (tests/imagegen/test_distributed.py lora_base): AdaLN-Zero's zero
# gates would keep the attention, and so the adapters, out of the loss
LORA = ("lora.rank=4", "lora.alpha=8", "lora.targets=to_q,to_k,to_v,ff.net.2")


def test_fp8_lora_learns_and_saves_what_bf16_saves(world, tmp_path, capsys):
    """LoRA over FP8 bases: the LoRA layers' frozen bases and the other block linears run in FP8 (the same 22 swaps as
    full fine-tuning, logged), the adapters learn, and the checkpoint and the exported adapter files hold the same
    tensors (names, dtypes, shapes) as a bf16 LoRA run's."""
    from atelier_studio.imagegen.lora import LORA_FILE

    fp8_out, bf16_out = tmp_path / "fp8", tmp_path / "bf16"
    common = (*LORA, f"model.path={lora_base(world)}", "train.lr=1e-2", "train.warmup_steps=3", "ema.decay=0.9")
    assert main(cli_args(world, fp8_out, *common, "train.max_steps=24", "train.save_every=24",
                         "train.precision=fp8", "train.fp8_recipe=rowwise")) == 0
    assert "fp8 (rowwise): 22 linear layers in FP8" in capsys.readouterr().out
    losses = [l for _, l in train_losses(fp8_out)]
    assert sum(losses[-5:]) / 5 < 0.95 * sum(losses[:5]) / 5, losses  # it learns
    assert main(cli_args(world, bf16_out, *common, "train.max_steps=1", "train.save_every=1",
                         "train.warmup_steps=1")) == 0
    assert train_losses(bf16_out)[0][1] != losses[0]  # the first step's loss differs: the fp8 run really quantised
    for rel in ("checkpoints/step-24/model.safetensors", f"lora/{LORA_FILE}", f"lora_ema/{LORA_FILE}"):
        fp8, bf16 = _tensors(fp8_out / rel), _tensors(bf16_out / rel.replace("step-24", "step-1"))
        assert fp8 == bf16 and all("lora_" in k for k in fp8), rel
    cfg = (fp8_out / "config.toml").read_text()
    assert 'precision = "fp8"' in cfg and 'fp8_recipe = "rowwise"' in cfg


def test_fp8_lora_resume_is_exact(world, tmp_path):
    """Stop at step 2 (a checkpoint), run again to step 4: the losses equal one uninterrupted fp8 LoRA run's."""
    args = (*LORA, f"model.path={lora_base(world)}", "train.schedule=constant", "train.warmup_steps=0",
            "train.precision=fp8", "train.fp8_recipe=tensorwise", "train.save_every=2")
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(cli_args(world, straight, *args, "train.max_steps=4")) == 0
    assert main(cli_args(world, split, *args, "train.max_steps=2")) == 0
    assert main(cli_args(world, split, *args, "train.max_steps=4")) == 0
    assert train_losses(split)[-2:] == train_losses(straight)[-2:]
    assert [s for s, _ in train_losses(straight)] == [1, 2, 3, 4]


def test_fp8_lora_refused_under_torchrun_names_the_key(world, tmp_path, monkeypatch, capsys):
    """LoRA over FP8 bases on several processes: exit 2 with one line naming train.precision and the way out
    (checked before any model is loaded), as the designer's. Full fine-tuning in FP8 runs there
    (tests/imagegen/test_distributed.py)."""
    from atelier_studio.imagegen import task as imagegen_task
    from atelier_studio.pipeline.distributed import DistContext

    real = imagegen_task.ImagegenTask.__init__

    def as_rank(self, cfg, device, dist=None):
        real(self, cfg, device, DistContext(device=device, rank=0, world_size=2, enabled=True))

    monkeypatch.setattr(imagegen_task.ImagegenTask, "__init__", as_rank)
    code = main(cli_args(world, tmp_path / "dist", *LORA, "train.precision=fp8", "train.max_steps=1",
                         "train.warmup_steps=0"))
    assert code == 2
    err = capsys.readouterr().err
    assert 'train.precision = "fp8" with LoRA runs on one process' in err and "lora.rank = 0" in err
