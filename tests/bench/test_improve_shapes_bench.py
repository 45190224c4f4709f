"""bench/improve_shapes.py without models: the split it writes, per-axis scores, the report's table and targets."""

from __future__ import annotations

import contextlib
import json

import pytest

from atelier_studio.bench.improve_shapes import per_axis, report_markdown, world_train_briefs, write_split
from atelier_studio.data.weak_briefs import AXES


def test_split_per_axis_scores_and_report(tmp_path):
    briefs, heldout, axes = write_split(tmp_path / "split", per_axis=3)
    held = heldout.read_text().splitlines()
    assert len(held) == 9 and set(axes.values()) == set(AXES) and not set(held) & set(briefs.read_text().splitlines())
    # the first axis's briefs score 1, the rest 0; a brief the split does not name counts as "normal"
    rows = [{"brief": b, "score": 1.0 if axes[b] == AXES[0] else 0.0} for b in held]
    rows.append({"brief": "something calm with a circle", "score": None})
    (tmp_path / "scores.json").write_text(json.dumps({"per_brief": rows}))
    scores = per_axis(tmp_path / "scores.json", axes)
    assert scores == {AXES[0]: 100.0, AXES[1]: 0.0, AXES[2]: 0.0, "normal": 0.0, "all": 30.0}
    report = {"command": "python -m atelier_studio.bench.improve_shapes ...", "rounds_reported": [1, 3],
              "table": {"all": {"before": 30.0, "round 1": 40.0, "round 3": 50.0}}, "weakest_axis": AXES[1],
              "weakest_change": 12.5, "normal_change": -0.5, "grids": ["g.png"],
              "costs": [{"round": 1, "samples": 36, "renders": 35, "sample_s": 1.0, "render_s": 2.0, "judge_s": 3.0,
                         "dpo_s": 4.0, "pairs": 7, "ties": 2}]}
    md = report_markdown(report)
    assert "| all | 30.0 | 40.0 | 50.0 |" in md and "+12.5 points (target ≥ +10)" in md
    assert "-0.5 points (target ≥ 0)" in md and "| 1 | 36 | 35 |" in md


def test_the_sampling_set_can_add_the_worlds_training_briefs(tmp_path):
    world = tmp_path / "world"
    world.mkdir()
    (world / "train.jsonl").write_text("".join(json.dumps({"brief": f"a circle, calm {i}", "caption": "c"}) + "\n"
                                               for i in range(5)))
    normal = world_train_briefs(world, 3)
    assert normal == ["a circle, calm 0", "a circle, calm 1", "a circle, calm 2"]
    briefs, heldout, _ = write_split(tmp_path / "split", per_axis=2, normal=normal)
    lines = briefs.read_text().splitlines()
    assert len(lines) == 2 * len(AXES) + 3 and lines[-3:] == normal
    assert not set(normal) & set(heldout.read_text().splitlines())


def test_caption_scores_are_reported_beside_the_judged_ones(tmp_path):
    rows = [{"brief": "a", "score": 2 / 3, "caption_score": 1.0}, {"brief": "b", "score": 1.0, "caption_score": 0.5}]
    (tmp_path / "scores.json").write_text(json.dumps({"per_brief": rows}))
    assert per_axis(tmp_path / "scores.json", {"a": "order"}) == {"order": 66.7, "normal": 100.0, "all": 83.3,
                                                                  "captions": 75.0}


@pytest.mark.parametrize("arg, value", [("--per-axis", "0"), ("--k", "1"), ("--normal-briefs", "-1"),
                                        ("--rounds", "1" + "0" * 30), ("--dpo-steps", "-3"), ("--steps", "0"),
                                        ("--k", "abc"), ("--world", "missing"), ("--renders", "0")])
def test_bad_options_are_one_line_before_anything_runs(tmp_path, capsys, arg, value):
    from atelier_studio.bench.improve_shapes import main

    argv = ["--designer", "d", "--imagegen", "i", "--world", str(tmp_path), "--out", str(tmp_path / "out")]
    (tmp_path / "train.jsonl").write_text("")
    (tmp_path / "briefs_eval.txt").write_text("")
    if arg == "--world":
        argv[5], value, arg = str(tmp_path / value), "", ""
    with pytest.raises(SystemExit) if value.isalpha() else contextlib.nullcontext() as stopped:
        code = main(argv + ([arg, value] if arg else []))
    code = stopped.value.code if value.isalpha() else code
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and not (tmp_path / "out").exists()
    assert err.count("\n") == 1 and err.startswith("atelier: error: ") and (arg or "--world") in err, err
