"""A tiny FLUX-shaped model on the shapes world through the CLI (`imagegen train` on the demo config with model.path
a flux-tiny transformer: the family comes from its config.json), on one process and under FSDP2 on two (torchrun,
gloo, CPU): full fine-tuning, activation checkpointing and a sharded (meta-device) init, the sample grid (its
embedded-guidance sampling runs on every rank), and the same losses, gradient norms and exported weights as one
process on the same global batch.

The world is tests/imagegen/_world.py's (the pixel codec's 12 channels, MiniLM's 384-wide states); the model is
flux-tiny at those widths with every weight perturbed (AdaLN-Zero's zero gates would keep the blocks out of the
loss). The bounds are tests/imagegen/test_distributed.py's: two processes add the same gradients in another order.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import FluxTransformer2DModel

from atelier_studio.flows.cli import main

from tests.imagegen._world import build_world, cli_args
from tests.imagegen.test_distributed import TOL, assert_same_export, assert_same_losses, launch_two

pytestmark = pytest.mark.multigpu

COMMON = ("train.max_steps=4", "train.save_every=2", "train.eval_every=4", "train.warmup_steps=1", "train.lr=2e-3",
          "train.device=cpu", "text.caption_dropout=0.3", "ema.decay=0", "sample.every=4", "sample.steps=2",
          "data.max_eval_images=13", "data.streams=2", "model.guidance=2.0")


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    return build_world(tmp_path_factory.getbasetemp() / "imagegen-world")


@pytest.fixture(scope="module")
def flux_model(world) -> Path:
    """flux-tiny at the world's widths, every weight perturbed."""
    from atelier_studio.imagegen.hf import init_random, load_pretrained, save_pretrained

    out = world / "flux-model"
    if not (out / "config.json").is_file():
        init_random("flux-tiny", world / "flux-init", in_channels=12, out_channels=12, joint_attention_dim=384,
                    pooled_projection_dim=384)
        model = load_pretrained(world / "flux-init")
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        save_pretrained(model, out, dtype=torch.float32)
    return out


def test_flux_trains_on_two_processes_as_on_one(world, flux_model, tmp_path):
    two, one = tmp_path / "two", tmp_path / "one"
    launch_two({"run": cli_args(world, two, *COMMON, "train.micro_batch=4", f"model.path={flux_model}",
                                "train.distributed.activation_checkpointing=full")}, tmp_path)
    assert main(cli_args(world, one, *COMMON, "train.micro_batch=8", f"model.path={flux_model}")) == 0
    assert_same_losses(one, two, range(1, 5))
    ev1, ev2 = (next(json.loads(r) for r in (d / "metrics.jsonl").read_text().splitlines()
                     if json.loads(r)["kind"] == "eval") for d in (one, two))
    assert abs(ev1["loss"] - ev2["loss"]) <= TOL
    assert_same_export(one, two, "transformer")
    assert (two / "samples" / "step-4.png").is_file()
    model, info = FluxTransformer2DModel.from_pretrained(two / "transformer", output_loading_info=True)
    assert info["missing_keys"] == [] and info["unexpected_keys"] == [] and model.config.guidance_embeds


def test_flux_trains_with_fp8_linears(world, flux_model, tmp_path, capsys):
    """train.precision = "fp8" on FLUX: every block linear of both types and the two input embedders run in FP8; what
    the family's fp8_skip names (the conditioning MLPs, the AdaLN modulations, the final proj_out) stays."""
    out = tmp_path / "fp8"
    assert main(cli_args(world, out, *COMMON, "train.micro_batch=8", f"model.path={flux_model}", "sample.every=0",
                         "train.eval_every=0", "train.precision=fp8", "train.fp8_recipe=tensorwise")) == 0
    # double blocks: q, k, v, out, add_q/k/v, add_out, ff x2, ff_context x2 (12 each); single blocks: q, k, v,
    # proj_mlp, proj_out (5 each); plus context_embedder and x_embedder
    assert "fp8 (tensorwise): 36 linear layers in FP8" in capsys.readouterr().out
    losses = [json.loads(r)["loss"] for r in (out / "metrics.jsonl").read_text().splitlines()
              if json.loads(r)["kind"] == "train"]
    assert len(losses) == 4 and all(0 < loss < 10 for loss in losses)
