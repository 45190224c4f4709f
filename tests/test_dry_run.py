"""`train --dry-run` on every shipped config: the model's config.json alone (a config-only directory of the size the
config is written for: no weights anywhere), the report printed, exit 0, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest

from atelier_studio.bench.dry_run_memory import config_only_model
from atelier_studio.flows.cli import main

ROOT = Path(__file__).parents[1]
# each shipped config and the registered size its model.path holds (the init command in its header comment)
SIZES = {"designer/demo.toml": "tiny", "designer/demo-dpo.toml": "tiny", "designer/qwen3-8b-lora.toml": "8b",
         "designer/qwen3-8b-qlora.toml": "8b", "designer/qwen3.5-9b-lora.toml": "qwen3.5-9b",
         "imagegen/demo.toml": "demo", "imagegen/flux-demo.toml": "flux-demo", "imagegen/sd3-medium.toml": "sd3-medium",
         "imagegen/sd3-medium-lora.toml": "sd3-medium", "imagegen/flux-dev-lora.toml": "flux-dev",
         "imagegen/qwen-image-lora.toml": "qwen-image"}


def config_only(trainer: str, size: str, out: Path) -> Path:
    """A model directory holding config.json alone (the bench's comparison builds the same)."""
    return config_only_model(trainer, size, out)


def test_every_shipped_config_is_listed():
    shipped = {str(p.relative_to(ROOT / "configs")) for p in (ROOT / "configs").glob("*/*.toml")}
    assert shipped == set(SIZES)


@pytest.mark.parametrize("name", sorted(SIZES))
def test_dry_run_reports_every_shipped_config(name, tmp_path, capsys):
    trainer = name.split("/")[0]
    model = config_only(trainer, SIZES[name], tmp_path / "model")
    out = tmp_path / "run"
    assert main([trainer, "train", "--config", str(ROOT / "configs" / name), "--dry-run", "--set",
                 f"model.path={model}", "--set", f"output.dir={out}"]) == 0
    report = capsys.readouterr().out
    rows = {line.split()[0]: line for line in report.splitlines() if line.startswith("  ")}
    assert rows["model.path"].endswith("--set") and repr(str(model)) in rows["model.path"]
    assert rows["output.trackers"].endswith("default")
    assert rows["train.max_steps"].endswith(str(ROOT / "configs" / name))  # every shipped config sets it
    for line in ("parameters: ", " per optimizer step: ", "model FLOPs per step: ", "dataset: ",
                 "peak GPU memory (estimate, one process): "):
        assert line in report, line
    assert not out.exists()  # nothing written, nothing trained


def imagegen_plan(capsys, config: str, model: Path, *sets: str) -> tuple[int, float]:
    """`imagegen train --dry-run` of `config` on `model` with `--set`s: (parameters, peak GiB) of its report."""
    assert main(["imagegen", "train", "--config", config, "--dry-run", "--set", f"model.path={model}",
                 *(a for s in sets for a in ("--set", s))]) == 0
    report = capsys.readouterr().out
    total = int(next(l for l in report.splitlines() if l.startswith("parameters: ")).split()[1].replace(",", ""))
    peak = next(l for l in report.splitlines() if l.startswith("peak GPU memory"))
    return total, float(peak.split(": ")[1].split()[0])


@pytest.mark.parametrize("size, config, base, adapters", [
    # FLUX.1-dev (11.9B: its 19 double- and 38 single-stream blocks): FluxTransformer2DModel's count + the adapters
    ("flux-dev", "flux-dev-lora.toml", 11_901_408_320, 26_148_864),
    # Qwen-Image (20.4B: 60 double-stream blocks; the bf16 base is 38 GiB, the plan ~42 GiB: no FP8 or NF4 base
    # needed): QwenImageTransformer2DModel's count + the adapters on both streams' attention projections
    ("qwen-image", "qwen-image-lora.toml", 20_430_401_088, 47_185_920),
], ids=["flux-dev", "qwen-image"])
def test_lora_at_1024_px_plans_one_80_gb_card(size, config, base, adapters, tmp_path, capsys):
    """The shipped 1024 px LoRA config of each family: the bf16 base, rank-16 adapters on every attention projection
    and activation checkpointing fit one 80 GB card; without the checkpointing the plan does not."""
    model = config_only("imagegen", size, tmp_path / "model")
    path = str(ROOT / "configs" / "imagegen" / config)
    total, peak = imagegen_plan(capsys, path, model)
    assert total == base + adapters and peak < 80
    assert imagegen_plan(capsys, path, model, "train.distributed.activation_checkpointing=none")[1] > 80


def test_dry_run_of_the_8b_lora_counts_what_the_bench_reports(tmp_path, capsys):
    """Qwen3-8B with rank-16 LoRA on q k v o gate up down: 8.19e9 parameters, 43.6M trainable (PEFT's count)."""
    model = config_only("designer", "8b", tmp_path / "model")
    assert main(["designer", "train", "--config", str(ROOT / "configs" / "designer" / "qwen3-8b-lora.toml"),
                 "--dry-run", "--set", f"model.path={model}", "--set", "lora.rank=16",
                 "--set", "lora.targets=q,k,v,o,gate,up,down"]) == 0
    report = capsys.readouterr().out
    line = next(l for l in report.splitlines() if l.startswith("parameters: "))
    total, trainable = (int(x.replace(",", "")) for x in (line.split()[1], line.split()[3]))
    assert trainable == 36 * 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 12288)) == 43_646_976
    assert total == 8_190_735_360 + trainable


def test_dry_run_of_8b_bf16_adapters_in_fp8_counts_their_dtype_and_the_fp8_copies(tmp_path):
    """bf16 adapters: bf16 gradients and AdamW moments (torch keeps both in the parameter's dtype); FP8: two one-byte
    copies of each of the 252 frozen LoRA bases and an fp32 scale per row of each (rowwise)."""
    from atelier_studio.designer.config import DesignerConfig
    from atelier_studio.designer.dry_run import designer_plan
    from atelier_studio.pipeline.config import load_config

    model = config_only("designer", "8b", tmp_path / "model")
    cfg = load_config(DesignerConfig, ROOT / "configs" / "designer" / "qwen3-8b-lora.toml",
                      [f"model.path={model}", f"data.train={tmp_path / 'none'}", "lora.dtype=bfloat16",
                       "train.precision=fp8", "train.fp8_recipe=rowwise"])
    memory = designer_plan(cfg).memory
    trainable = 43_646_976
    assert memory["gradients"] == 2 * trainable and memory["optimizer"] == 4 * trainable
    shapes = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (12288, 4096), (12288, 4096), (4096, 12288)]
    assert memory["fp8 copies"] == 36 * sum(2 * n * k + 4 * (n + k) for n, k in shapes)


def test_dry_run_of_several_resolutions_sizes_the_largest_and_counts_each(tmp_path, capsys):
    """data.resolutions: the memory and FLOPs are the largest resolution's (its images are the longest sequences), the
    dataset line names each resolution's latent folder (<shards>/r<px>)."""
    model = config_only("imagegen", "sd3-medium", tmp_path / "model")
    assert main(["imagegen", "train", "--config", str(ROOT / "configs" / "imagegen" / "sd3-medium.toml"), "--dry-run",
                 "--set", f"model.path={model}", "--set", "data.resolution=0", "--set", "data.resolutions=512,1024",
                 "--set", f"data.shards={tmp_path / 'lat'}", "--set", f"output.dir={tmp_path / 'run'}"]) == 0
    report = capsys.readouterr().out
    assert "4096 image tokens (1024 px" in report
    dataset = next(line for line in report.splitlines() if line.startswith("dataset: "))
    assert str(tmp_path / "lat" / "r512") in dataset and str(tmp_path / "lat" / "r1024") in dataset, dataset
