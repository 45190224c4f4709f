"""A tiny shapes world for the imagegen tests, built once per pytest session (shared by the test modules).

    <base>/world        synthetic images + captions (32 px)
    <base>/shards       image shards (train, 2 shards), <base>/shards-eval (eval)
    <base>/model        a random tiny MMDiT for the pixel codec (12 channels) and MiniLM (384)
    <base>/latents      cached latents (+ latents/eval)
"""

from __future__ import annotations

from pathlib import Path

import torch

from atelier_studio.data.shards import write_image_shards
from atelier_studio.data.synthetic import generate_world
from atelier_studio.imagegen.hf import init_random

ROOT = Path(__file__).parents[2]
DEMO = ROOT / "configs" / "imagegen" / "demo.toml"
MODEL_OVERRIDES = dict(in_channels=12, out_channels=12, joint_attention_dim=384, pooled_projection_dim=384,
                       sample_size=16)


def build_world(base: Path, cache: bool = True) -> Path:
    """Idempotent: returns `base` with everything above present."""
    base = Path(base)
    if (base / "ready").is_file():
        return base
    generate_world(base / "world", n=120, seed=0, image_size=32, eval_fraction=0.15)
    write_image_shards(base / "world", base / "world" / "captions.jsonl", base / "shards", 52, progress=False)
    write_image_shards(base / "world", base / "world" / "eval.jsonl", base / "shards-eval", 100, progress=False)
    init_random("tiny", base / "model", seed=0, dtype=torch.float32, **MODEL_OVERRIDES)
    if cache:
        from atelier_studio.imagegen.cache import cache_latents
        from atelier_studio.imagegen.config import ImagegenConfig
        from atelier_studio.pipeline.config import load_config

        cache_latents(load_config(ImagegenConfig, DEMO, config_overrides(base)), base / "latents", shard_size=40)
    (base / "ready").write_text("ok\n")
    return base


def config_overrides(base: Path, out: Path | None = None) -> list[str]:
    """--set overrides pointing the demo config at the test world (micro-batch 8, no TensorBoard)."""
    sets = [f"model.path={base / 'model'}", f"data.image_shards={base / 'shards'}",
            f"data.eval_image_shards={base / 'shards-eval'}", f"data.shards={base / 'latents'}",
            f"data.eval_shards={base / 'latents' / 'eval'}", "train.micro_batch=8", "output.tensorboard=false",
            "train.log_every=1", "sample.every=0"]
    if out is not None:
        sets.append(f"output.dir={out}")
    return sets


def cli_args(base: Path, out: Path, *extra: str) -> list[str]:
    args = ["imagegen", "train", "--config", str(DEMO)]
    for s in config_overrides(base, out) + list(extra):
        args += ["--set", s]
    return args
