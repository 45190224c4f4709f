"""bench/first_runs_imagegen.py: the tiny run end to end on CPU (the GPU run's exact code path), the real
run's data layout at SD3-medium shapes, the stand-ins passing the task's startup checks, and the OOM fallback."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

import atelier_studio.bench.first_runs_imagegen as fri
from atelier_studio.bench.first_runs_imagegen import SD3M, TINY, imagegen_run, write_config, write_random_latents


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[Path, dict]:
    work = tmp_path_factory.mktemp("ig-first-run")
    return work, imagegen_run(work, work / "log.txt", tiny=True, dtype="float32")


def test_tiny_run_trains_through_the_cli(tiny_run):
    work, report = tiny_run
    assert report["init_code"] == 0 and report["init_seconds"] > 0
    assert list(report["runs"]) == ["bs2"]
    run = report["runs"]["bs2"]
    assert run["code"] == 0 and not run["oom"], (work / "log.txt").read_text()[-3000:]
    s = run["summary"]
    assert s["step"] == TINY.max_steps and not s["interrupted"] and math.isfinite(s["final_loss"])
    assert s["units_per_s"] > 0 and s["step_time"] > 0
    train = [m for m in run["metrics"] if m["kind"] == "train"]
    assert [m["step"] for m in train] == [1, 2, 3]
    assert all(m["loss_weight"] == 2 and math.isfinite(m["loss"]) and m["grad_norm"] > 0 for m in train)
    # the run used the settings the bench promises (the trainer saves the resolved config)
    cfg = (work / "imagegen-tiny-bs2" / "config.toml").read_text()
    for line in ('decay = 0.9999', 'shift = 3.0', 'timestep_sampling = "logit_normal"', 'every = 0',
                 'kind = "causal-lm"', 'max_length = 16', 'micro_batch = 2', 'tensorboard = false'):
        assert line in cfg, line
    # weights deleted after the run, and said so
    out = work / "imagegen-tiny-bs2"
    assert run["weights_deleted"] and not (out / "checkpoints").exists() and not (out / "transformer").exists()
    assert (out / "summary.json").is_file()
    assert report["deviations"] and any("pooled_projection_dim" in d for d in report["deviations"])


def test_tiny_latents_have_the_cache_layout(tiny_run):
    from atelier_studio.data.buckets import LatentDataset
    from atelier_studio.data.shards import read_index

    work, _ = tiny_run
    index = read_index(work / "latents-tiny")
    assert index["kind"] == "latent" and index["total"] == TINY.num_samples == 3 * 2 + 2
    meta = json.loads((work / "latents-tiny" / "cache.json").read_text())
    assert meta["latent_channels"] == 16 and meta["downsample_factor"] == 8 and meta["hidden_size"] == 64
    ds = LatentDataset(work / "latents-tiny")
    assert ds.buckets == [(128, 128)] and ds[0]["latent"].shape == (16, 16, 16)


def test_rerun_reuses_setup_and_falls_back_only_on_oom(tiny_run, monkeypatch):
    """A second call skips init and setup; micro-batch 2 "runs out of memory" -> 1 is tried; a non-OOM failure
    of 1 stops there. The train command is faked (the real one is covered above)."""
    work, _ = tiny_run
    monkeypatch.setattr(fri, "TINY", dataclasses.replace(TINY, micro_batches=(2, 1, 1)))
    calls: list[tuple[str, ...]] = []

    def fake_atelier(*args: str, log: Path) -> tuple[int, float]:
        calls.append(args)
        assert args[:2] == ("imagegen", "train"), args  # init, tokenizer: already done
        mb = int(args[args.index("--set") + 1].split("=")[1])
        with open(log, "a") as fh:
            fh.write("torch.OutOfMemoryError: CUDA out of memory\n" if mb == 2 else "ValueError: something else\n")
        return 1, 0.5

    monkeypatch.setattr(fri, "atelier", fake_atelier)
    report = fri.imagegen_run(work, work / "log.txt", tiny=True, dtype="float32")
    assert report["init_seconds"] == 0.0 and report["setup_seconds"] < 5
    assert len(calls) == 2 and list(report["runs"]) == ["bs2", "bs1"]
    assert report["runs"]["bs2"]["oom"] and not report["runs"]["bs1"]["oom"]
    # the stale output of the real bs2 run was removed before the new attempt: no summary passes for it
    assert "summary" not in report["runs"]["bs2"]


def test_real_shape_latents(tmp_path):
    """Two samples at SD3-medium shapes: what the GPU run writes, read back as the task reads it."""
    from atelier_studio.data.buckets import LatentDataset

    shape = dataclasses.replace(SD3M, max_steps=1, micro_batches=(1,), extra_samples=1, shard_size=1)
    out = write_random_latents(tmp_path / "lat", shape, torch.bfloat16, tmp_path / "te", tmp_path / "vae")
    ds = LatentDataset(out)
    assert len(ds) == 2 and ds.buckets == [(1024, 1024)]
    s = ds[1]
    assert s["latent"].shape == (16, 128, 128) and s["text_states"].shape == (333, 4096)
    assert s["pooled"].shape == (4096,) and s["latent"].dtype == torch.bfloat16
    for name in ("latent", "text_states", "pooled"):  # random normal, never zeros
        assert 0.9 < s[name].float().std() < 1.1, name
    assert not torch.equal(ds[0]["latent"], ds[1]["latent"])
    stamp = (out / "shard-000000.tar").stat().st_mtime_ns
    write_random_latents(tmp_path / "lat", shape, torch.bfloat16, tmp_path / "te", tmp_path / "vae")
    assert (out / "shard-000000.tar").stat().st_mtime_ns == stamp  # identical set: kept
    write_random_latents(tmp_path / "lat", dataclasses.replace(shape, extra_samples=2), torch.bfloat16,
                         tmp_path / "te", tmp_path / "vae")
    assert len(LatentDataset(out)) == 3  # different set: rewritten


def test_sd3m_stand_ins_pass_the_task_startup_checks(tmp_path):
    """The real run's text encoder, VAE, MMDiT args and config agree the way ImagegenTask checks at startup."""
    from atelier_studio.imagegen.autoencoder import load_autoencoder
    from atelier_studio.imagegen.config import ImagegenConfig
    from atelier_studio.imagegen.model import SIZES, MMDiT
    from atelier_studio.imagegen.text import TextEncoder
    from atelier_studio.pipeline.config import load_config

    text_dir = fri.write_text_encoder(tmp_path / "text-enc", SD3M, torch.bfloat16, tmp_path / "log.txt")
    text = TextEncoder(text_dir, "causal-lm", max_length=SD3M.max_length, pooled="mean")
    states, pooled, mask = text.encode(["a small red circle in the center on a white background"])
    assert states.shape == (1, 333, 4096) and pooled.shape == (1, 4096) and 0 < mask.sum() < 333
    assert text.model.config.num_hidden_layers == 1 and text.model.config.head_dim == 128

    vae = load_autoencoder(str(fri.write_vae(tmp_path / "vae", SD3M)))
    assert vae.latent_channels == 16 and vae.downsample_factor == 8
    assert (vae.scaling_factor, vae.shift_factor) == (1.5305, 0.0609)

    args = dataclasses.replace(SIZES["sd3-medium"], pooled_projection_dim=SD3M.text_width)  # = the init flags
    assert args.joint_attention_dim == args.pooled_projection_dim == text.hidden_size
    assert args.in_channels == vae.latent_channels
    assert SD3M.latent_side % args.patch_size == 0 and SD3M.latent_side // args.patch_size <= args.pos_embed_max_size
    with torch.device("meta"):
        n = sum(p.numel() for p in MMDiT(args).parameters())
    assert 2.0e9 < n < 2.1e9  # SD3-medium's ~2B (+6M for the wider pooled projection)

    path = write_config(tmp_path / "ig.toml", SD3M, tmp_path / "m", text_dir, tmp_path / "vae", tmp_path / "lat",
                        "bfloat16")
    cfg = load_config(ImagegenConfig, path, ["train.micro_batch=16", f"output.dir={tmp_path / 'o'}"])
    assert cfg.data.resolution == 1024 and cfg.text.max_length == 333 and cfg.ema.decay == 0.9999
    assert cfg.flow.shift == 3.0 and cfg.sample.every == 0 and cfg.train.max_steps == 20
    assert SD3M.num_samples == 20 * 16 + 32
