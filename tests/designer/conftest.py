"""Shared designer fixtures: a tokenizer trained on the fixture briefs and a tiny random Qwen3 (fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest

from atelier_studio.flows.cli import main

FIXTURE = Path(__file__).parents[1] / "fixtures" / "designer" / "briefs.jsonl"


@pytest.fixture(scope="session")
def world(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("designer")
    assert main(["data", "tokenizer", "--corpus", str(FIXTURE), "--vocab-size", "400", "--out", str(d / "tok")]) == 0
    assert main(["designer", "init", "--size", "tiny", "--tokenizer", str(d / "tok"), "--out", str(d / "model"),
                 "--dtype", "float32"]) == 0
    return d
