"""Skipped samples are reported where users look: an imagegen run on latent shards with one tar cut short shows
the samples that tar lacks on the progress line, in metrics.jsonl, TensorBoard, summary.json and the Prefect summary
artifact's markdown (flows/report.py), by shard and reason."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from atelier_studio.data.latent_stream import ShardSet
from atelier_studio.flows.cli import main
from atelier_studio.flows.launch import parse_step_line
from atelier_studio.flows.report import metrics_rows, summary_markdown

from tests.imagegen._world import build_world, cli_args


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    return build_world(tmp_path_factory.getbasetemp() / "imagegen-world")


def test_a_tar_cut_short_is_counted_by_its_missing_samples_everywhere(world, tmp_path, capsys):
    latents = Path(shutil.copytree(world / "latents", tmp_path / "latents"))
    cut = latents / "shard-000001.tar"
    listed = {s["name"]: s["count"] for s in json.loads((latents / "index.json").read_text())["shards"]}[cut.name]
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    missing = listed - ShardSet.open([cut]).counts[0]  # without an index: the whole samples, from the headers
    assert 0 < missing < listed
    out = tmp_path / "run"
    # one stream reads every shard once per pass: each pass through the cut tar skips its `missing` samples
    assert main(cli_args(world, out, f"data.shards={latents}", "data.max_bad_fraction=0.5", "train.max_steps=2",
                         "train.warmup_steps=0", "train.save_every=0", "output.tensorboard=true")) == 0

    lines = capsys.readouterr().out.splitlines()
    steps = [parse_step_line(line) for line in lines if parse_step_line(line)]
    assert [s["step"] for s in steps] == [1, 2]
    assert steps[0]["skipped"] > 0 and steps[0]["skipped"] % missing == 0
    named = [line for line in lines if line.startswith("data step 1: ")]
    assert len(named) == 1 and f"{cut}: {steps[0]['skipped']} truncated tar" in named[0]

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["skipped"] for r in train] == [s["skipped"] for s in steps]
    reported = [r for r in records if r["kind"] == "skipped"]
    assert reported[0]["step"] == 1
    assert reported[0]["by_source"] == {str(cut): {"truncated tar": steps[0]["skipped"]}}
    total = steps[-1]["skipped"]

    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped"] == {"total": total, "by_reason": {"truncated tar": total},
                                  "by_source": {str(cut): {"truncated tar": total}}}
    md = summary_markdown(out, "train-imagegen")  # the Prefect summary artifact's content
    assert f"## Skipped training samples: {total}" in md and f"| `{cut}` | truncated tar | {total} |" in md
    assert [row["skipped"] for row in metrics_rows(out) if row["kind"] == "train"] == [str(s["skipped"])
                                                                                       for s in steps]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard")).Reload()
    assert [e.value for e in events.Scalars("skipped/total")][0] == steps[0]["skipped"]
    assert [e.value for e in events.Scalars(f"skipped/{cut}")][0] == steps[0]["skipped"]


def test_a_run_that_skips_nothing_says_so(world, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(cli_args(world, out, "train.max_steps=1", "train.warmup_steps=0", "train.save_every=0")) == 0
    assert " skipped " not in capsys.readouterr().out
    assert json.loads((out / "summary.json").read_text())["skipped"]["total"] == 0
    assert "Skipped training samples: none." in summary_markdown(out, "train-imagegen")
