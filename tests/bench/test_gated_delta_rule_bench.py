"""bench/gated_delta_rule.py on the CPU: each backend in its own process with fla's dispatch switch set for it, a
skip with the reason where it cannot run, and the choice rule (the guard-free path within 3%)."""
from __future__ import annotations

import json

import pytest

from atelier_studio.bench.gated_delta_rule import WITHIN, child_env, choose, main


def test_tiny_run_records_each_backend_and_the_choice(tmp_path):
    assert main(["--tiny", "--out", str(tmp_path), "--repeats", "1"]) == 0
    r = json.loads(next(tmp_path.glob("gated-delta-rule-*.json")).read_text())
    assert set(r["backends"]) == {"tilelang", "triton"}
    for b in r["backends"].values():  # no GPU here: skipped with the reason, from the backend's own process
        assert b["skipped"] in ("needs a CUDA GPU",) or "fla-core" in b["skipped"]
    assert r["choice"] == {"choice": None, "why": "no backend ran exactly here"}
    assert "choice: None" in next(tmp_path.glob("gated-delta-rule-*.md")).read_text()


def test_the_guard_free_path_wins_within_three_percent():
    def ran(ms, exact=True):
        return {"ms": ms, "exact": exact}
    assert choose({"tilelang": ran(1.02), "triton": ran(1.0)})["choice"] == "tilelang"
    assert choose({"tilelang": ran(WITHIN * 1.0 + 0.01), "triton": ran(1.0)})["choice"] == "triton"
    assert choose({"tilelang": ran(0.8), "triton": ran(1.0)})["choice"] == "tilelang"
    assert choose({"tilelang": ran(0.8, exact=False), "triton": ran(1.0)})["choice"] == "triton"
    assert choose({"tilelang": {"skipped": "not installed"}, "triton": ran(1.0)}) == {
        "choice": "triton", "why": "the only exact path that ran"}


def test_each_backend_process_gets_fla_s_dispatch_switch(monkeypatch):
    monkeypatch.setenv("FLA_DISABLE_BACKEND_DISPATCH", "1")
    assert "FLA_DISABLE_BACKEND_DISPATCH" not in child_env("tilelang")
    assert child_env("triton")["FLA_DISABLE_BACKEND_DISPATCH"] == "1"


def test_unknown_backend_is_named(capsys):
    with pytest.raises(SystemExit):
        main(["--tiny", "--backends", "cuda"])
    assert "--backends: unknown ['cuda']" in capsys.readouterr().err
