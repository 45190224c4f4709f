"""Shared fixtures for the flow tests: one Prefect test harness per session, one tiny designer world."""

from __future__ import annotations

from pathlib import Path

import pytest

from atelier_studio.flows.cli import main as atelier

ROOT = Path(__file__).parents[2]
BRIEFS = ROOT / "tests" / "fixtures" / "designer" / "briefs.jsonl"


@pytest.fixture(scope="session")
def prefect_harness():
    """A temporary Prefect server + SQLite database, started once (30-60 s on 2 cores)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def designer_world(tmp_path_factory) -> Path:
    """A tokenizer trained on the fixture briefs and a tiny random fp32 Qwen3."""
    d = tmp_path_factory.mktemp("designer-world")
    assert atelier(["data", "tokenizer", "--corpus", str(BRIEFS), "--vocab-size", "400", "--out", str(d / "tok")]) == 0
    assert atelier(["designer", "init", "--size", "tiny", "--tokenizer", str(d / "tok"), "--out", str(d / "model"),
                    "--dtype", "float32"]) == 0
    return d


def designer_config(world: Path, out: Path, max_steps: int = 6, save_every: int = 3, extra: str = "") -> Path:
    """A tiny LoRA designer config with absolute paths, written next to the run's output directory."""
    cfg = out.parent / f"{out.name}.toml"
    cfg.write_text(f"""
[model]
path = "{world / 'model'}"
dtype = "float32"
[data]
train = "{BRIEFS}"
eval = "{BRIEFS}"
seq_len = 128
max_eval_batches = 2
[lora]
rank = 4
alpha = 8.0
[train]
max_steps = {max_steps}
micro_batch = 2
lr = 1e-3
warmup_steps = 1
log_every = 1
eval_every = {save_every}
save_every = {save_every}
{extra}
[output]
dir = "{out}"
tensorboard = false
""")
    return cfg
