"""Image data in users' layouts through the whole imagegen path on the CLI: a kohya-style folder (caption sidecars, a
repeat folder, one broken image) -> `data shards --from` -> `imagegen cache` -> `imagegen train`."""
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

    sets = [s for s in config_overrides(world) if not s.startswith(("data.image_shards", "data.eval_image_shards"))]
    cache = ["imagegen", "cache", "--config", str(DEMO), "--out", str(tmp_path / "latents")]
    for s in [*sets, f"data.image_shards={tmp_path / 'shards'}", "data.eval_image_shards="]:
        cache += ["--set", s]
    assert main(cache) == 0
    assert json.loads((tmp_path / "latents" / "index.json").read_text())["total"] == 20
    out = tmp_path / "run"
    assert main(cli_args(world, out, f"data.shards={tmp_path / 'latents'}", "data.eval_shards=",
                         "train.max_steps=2", "train.warmup_steps=1", "train.save_every=2")) == 0
    losses = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in losses if r["kind"] == "train"] == [1, 2]
