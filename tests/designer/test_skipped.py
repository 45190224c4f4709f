"""The designer's data skips only what `data.overflow = "drop"` leaves out (a bad JSONL line is an error): those
documents are reported as skipped once per epoch, on the progress line, in metrics.jsonl and summary.json."""

from __future__ import annotations

import json
import re
from pathlib import Path

from atelier_studio.flows.cli import main
from atelier_studio.flows.launch import parse_step_line

ROOT = Path(__file__).parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "designer" / "briefs.jsonl"


def test_dropped_documents_are_counted_each_epoch(world, tmp_path, capsys):
    out = tmp_path / "run"
    # 12 rows of 64 tokens in batches of 8: one step per epoch, so every step begins an epoch
    sets = {"model.path": world / "model", "data.train": FIXTURE, "data.eval": "", "data.seq_len": 64,
            "data.overflow": "drop", "train.micro_batch": 8, "train.max_steps": 2, "train.warmup_steps": 1,
            "train.log_every": 1, "train.save_every": 0, "output.tensorboard": "false", "output.dir": out}
    argv = ["designer", "train", "--config", str(ROOT / "configs" / "designer" / "demo.toml")]
    for k, v in sets.items():
        argv += ["--set", f"{k}={v}"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    dropped = int(re.search(r"(\d+) rows of 64 tokens.* dropped (\d+)", "\n".join(lines))[2])
    rows = int(re.search(r"(\d+) rows of 64 tokens", "\n".join(lines))[1])
    assert dropped > 0 and rows // 8 == 1
    assert [parse_step_line(line)["skipped"] for line in lines if parse_step_line(line)] == [dropped, 2 * dropped]
    reason = "longer than data.seq_len (data.overflow = drop)"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["by_source"] for r in records if r["kind"] == "skipped"] == [{str(FIXTURE): {reason: n}}
                                                                           for n in (dropped, 2 * dropped)]
    assert json.loads((out / "summary.json").read_text())["skipped"]["by_reason"] == {reason: 2 * dropped}


def test_without_drop_nothing_is_reported(world, tmp_path, capsys):
    """The default overflow policy splits long documents: no `skipped` anywhere (the task reports None)."""
    out = tmp_path / "run"
    argv = ["designer", "train", "--config", str(ROOT / "configs" / "designer" / "demo.toml")]
    for k, v in {"model.path": world / "model", "data.train": FIXTURE, "data.eval": "", "data.seq_len": 128,
                 "train.micro_batch": 8, "train.max_steps": 1, "train.warmup_steps": 1, "train.save_every": 0,
                 "output.tensorboard": "false", "output.dir": out}.items():
        argv += ["--set", f"{k}={v}"]
    assert main(argv) == 0
    assert "skipped" not in capsys.readouterr().out and "skipped" not in (out / "metrics.jsonl").read_text()
    assert "skipped" not in json.loads((out / "summary.json").read_text())
