"""bench/scaling.py on the CPU: 1 and 2 gloo processes through the real CLI, the report's fields and efficiency."""

from __future__ import annotations

import json

import pytest

from atelier_studio.bench.scaling import RUNS, main, tiny
from atelier_studio.flows.cli import main as atelier

from tests.designer.test_model import FIXTURE


@pytest.mark.slow
def test_tiny_scaling_runs_designer_and_imagegen_on_1_and_2_processes(tmp_path):
    tok = tmp_path / "tok"
    assert atelier(["data", "tokenizer", "--corpus", str(FIXTURE), "--vocab-size", "400", "--out", str(tok)]) == 0
    out = tmp_path / "out"
    assert main(["--tiny", "--runs", "designer-8b-lora,imagegen-sd3-1024", "--gpus", "1,2", "--steps", "4",
                 "--tokenizer", str(tok), "--work", str(tmp_path / "work"), "--out", str(out)]) == 0
    (path,) = out.glob("scaling-*.json")
    report = json.loads(path.read_text())
    assert {"gpu", "versions", "source", "clocks", "runs"} <= set(report)
    for name in ("designer-8b-lora", "imagegen-sd3-1024"):
        r = report["runs"][name]
        assert r["baseline_gpus"] == 1, r
        for n in ("1", "2"):
            x = r["by_gpus"][n]
            assert x["code"] == 0 and x["units_per_s"] > 0 and x["efficiency"] > 0, (name, n, x)
        assert r["by_gpus"]["1"]["efficiency"] == 1.0
    assert "efficiency" in path.with_suffix(".md").read_text()


def test_bad_arguments_say_what(capsys):
    with pytest.raises(SystemExit):
        main(["--tiny", "--runs", "designer-70b"])
    assert "unknown ['designer-70b']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--tiny", "--runs", "imagegen-sd3-1024", "--steps", "2"])
    assert "--steps must be >= 4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--tiny", "--runs", "designer-8b-lora", "--tokenizer", "/nonexistent"])
    assert "--tokenizer: the designer runs need a tokenizer directory" in capsys.readouterr().err
    assert tiny(RUNS["designer-8b-full"]).lora_rank == 0 and tiny(RUNS["designer-8b-lora"]).lora_rank == 4
