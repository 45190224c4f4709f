"""Image data in users' layouts through the whole imagegen path on the CLI: a kohya-style folder (caption sidecars, a
repeat folder, one broken image) -> `data shards --from` -> `imagegen cache` -> `imagegen train`; an imagefolder and
a parquet file through `data shards --from` into the latent cache."""
from __future__ import annotations

import json
import shutil

from atelier_studio.flows.cli import main

from tests.imagegen._world import DEMO, build_world, cli_args, config_overrides


def test_a_sidecar_folder_with_repeats_trains(tmp_path_factory, tmp_path):
    world = build_world(tmp_path_factory.getbasetemp() / "imagegen-world")
    rows = [json.loads(line) for line in (world / "world" / "captions.jsonl").read_text().splitlines()][:12]
    src = tmp_path / "photos"
    for i, row in enumerate(rows):
        folder = src / ("3_shapes" if i < 4 else "plain")  # 4 images x 3 repeats + 8 images = 20 samples
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(world / "world" / row["image"], folder / f"{i}.png")
        (folder / f"{i}.{'txt' if i % 2 else 'caption'}").write_text(row["caption"] + "\n")
    (src / "plain" / "broken.png").write_bytes(b"\x89PNG cut")
    (src / "plain" / "broken.txt").write_text("a broken image")
    assert main(["data", "shards", "--from", str(src), "--out", str(tmp_path / "shards"), "--shard-size", "8"]) == 0
    index = json.loads((tmp_path / "shards" / "index.json").read_text())
    assert index["total"] == 20 and index["skipped"] == {"undecodable image": 1}

    assert _cache(world, tmp_path / "shards", tmp_path / "latents")["total"] == 20
    out = tmp_path / "run"
    assert main(cli_args(world, out, f"data.shards={tmp_path / 'latents'}", "data.eval_shards=",
                         "train.max_steps=2", "train.warmup_steps=1", "train.save_every=2")) == 0
    losses = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in losses if r["kind"] == "train"] == [1, 2]


def _cache(world, shards, out) -> dict:
    sets = [s for s in config_overrides(world) if not s.startswith(("data.image_shards", "data.eval_image_shards"))]
    argv = ["imagegen", "cache", "--config", str(DEMO), "--out", str(out)]
    for s in [*sets, f"data.image_shards={shards}", "data.eval_image_shards="]:
        argv += ["--set", s]
    assert main(argv) == 0
    return json.loads((out / "index.json").read_text())


def test_imagefolder_and_parquet_sources_reach_the_latent_cache(tmp_path_factory, tmp_path):
    """The other layouts give the same shards; `imagegen cache` encodes every sample of each (training reads latents,
    whatever the source)."""
    import datasets

    world = build_world(tmp_path_factory.getbasetemp() / "imagegen-world")
    rows = [json.loads(line) for line in (world / "world" / "captions.jsonl").read_text().splitlines()][:6]
    folder = tmp_path / "imagefolder"
    (folder / "train").mkdir(parents=True)
    for i, row in enumerate(rows):
        shutil.copy(world / "world" / row["image"], folder / "train" / f"{i}.png")
    (folder / "train" / "metadata.jsonl").write_text(
        "".join(json.dumps({"file_name": f"{i}.png", "text": r["caption"]}) + "\n" for i, r in enumerate(rows)))
    images = [{"bytes": (world / "world" / r["image"]).read_bytes(), "path": None} for r in rows]
    datasets.Dataset.from_dict({"image": images, "caption": [r["caption"] for r in rows]},
                               features=datasets.Features({"image": datasets.Image(),
                                                           "caption": datasets.Value("string")})
                               ).to_parquet(str(tmp_path / "train.parquet"))
    for name, src in (("imagefolder", folder), ("parquet", tmp_path / "train.parquet")):
        assert main(["data", "shards", "--from", str(src), "--out", str(tmp_path / f"shards-{name}")]) == 0
        assert _cache(world, tmp_path / f"shards-{name}", tmp_path / f"latents-{name}")["total"] == len(rows), name
