"""improve-designer: pair selection (margin, ties), bad parameters, and one round end to end under Prefect at tiny size
(a random tiny designer, a random tiny MMDiT, the judge's brief score replaced by a deterministic stand-in so that
random renders still differ)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

from atelier_studio.flows.judged_pairs import Sample, select_pairs
from atelier_studio.flows.training import FlowInputError


def _group(brief: str, *scored: tuple[str, float | None]) -> list[Sample]:
    return [Sample(brief, caption, f"{caption}.png", score) for caption, score in scored]


def test_pairs_are_best_vs_worst_beyond_the_margin_and_ties_are_dropped():
    groups = [_group("a", ("x", 0.2), ("y", 1.0), ("z", 0.6)),       # kept: y over x
              _group("b", ("x", 0.5), ("y", 0.5)),                   # tie
              _group("c", ("x", 0.4), ("y", 0.6)),                   # gap 0.2: within a margin of 0.25
              _group("d", ("x", 0.9), ("", 0.0), ("y", None)),       # one usable sample only
              _group("e", ("same", 1.0), ("same ", 0.0)),            # the same text both ways: no preference
              _group("g", ("x", 0.5), ("y", 0.75))]                  # a gap of exactly the margin is not beyond it
    sel = select_pairs(groups, margin=0.25)
    assert [(p.brief, p.chosen.caption, p.rejected.caption) for p in sel.pairs] == [("a", "y", "x")]
    assert (sel.ties, sel.within_margin, sel.too_few) == (2, 2, 1)
    assert sel.pairs[0].gap == pytest.approx(0.8)
    at_zero = select_pairs(groups, margin=0.0)  # any strict gain is kept at margin 0
    assert [p.brief for p in at_zero.pairs] == ["a", "c", "g"] and at_zero.ties == 2
    # among equal best scores the first sample is chosen, among equal worst the last is rejected
    sel = select_pairs([_group("f", ("p", 1.0), ("q", 1.0), ("r", 0.0), ("s", 0.0))], margin=0.0)
    assert (sel.pairs[0].chosen.caption, sel.pairs[0].rejected.caption) == ("p", "s")
    with pytest.raises(ValueError, match="margin"):
        select_pairs(groups, margin=-0.1)


def test_a_captions_score_is_the_mean_over_its_judged_renders():
    from atelier_studio.flows.judged_pairs import mean_score

    assert mean_score([1.0, 0.5, 0.0]) == pytest.approx(0.5)
    assert mean_score([1.0, None]) == 1.0  # a render no scorer judged does not count
    assert mean_score([None, None]) is None and mean_score([0.25]) == 0.25


def test_bad_parameters_are_one_line(tmp_path):
    from atelier_studio.flows.improve import check_params

    briefs = tmp_path / "b.txt"
    briefs.write_text("a calm poster, one circle\n")
    ok = dict(designer=str(tmp_path), imagegen=str(tmp_path), briefs=str(briefs), eval_briefs=str(briefs), k=2,
              margin=0.0, rounds=1, temperature=1.0)
    for change, words in ((dict(k=1), "k: a pair needs at least 2"), (dict(margin=-0.5), "margin: must be >= 0"),
                          (dict(briefs=str(tmp_path / "none.txt")), "briefs: briefs file"),
                          (dict(eval_briefs=str(tmp_path / "none.txt")), "eval_briefs: briefs file"),
                          (dict(rounds=0), "rounds"), (dict(temperature=0.0), "temperature"),
                          (dict(renders=0), "renders: each caption needs at least one render")):
        with pytest.raises(FlowInputError, match=words) as e:
            check_params(**{**ok, **change})
        assert "\n" not in str(e.value)


def test_the_dpo_run_takes_the_configs_steps_and_rank_unless_the_flow_sets_them(tmp_path):
    """dpo_steps / lora_rank 0: the DPO config's own (the shipped designer/demo-dpo: its rank, steps, lr and NLL
    anchor); set: they replace the config's; the user's overrides come after, what the round fixes last."""
    from atelier_studio.designer.config import DesignerConfig
    from atelier_studio.flows.improve import dpo_run_sets
    from atelier_studio.flows.shipped import resolve_config
    from atelier_studio.pipeline.config import load_config

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    pairs = tmp_path / "pairs.jsonl"
    config = resolve_config("designer/demo-dpo")

    def resolved(steps: int, rank: int, user: list[str]) -> DesignerConfig:
        return load_config(DesignerConfig, config, dpo_run_sets(model, pairs, tmp_path / "dpo", steps, rank, user))

    shipped = resolved(0, 0, [])
    assert (shipped.lora.rank, shipped.train.max_steps, shipped.train.lr) == (16, 200, 3e-4)
    assert (shipped.train.objective, shipped.train.dpo.sft_weight) == ("dpo", 1.0)
    assert (shipped.model.path, shipped.data.train) == (str(model), str(pairs))
    assert shipped.output.dir == str(tmp_path / "dpo")
    flow_set = resolved(40, 8, ["train.lr=1e-4", f"output.dir={tmp_path}/mine"])
    assert (flow_set.lora.rank, flow_set.lora.alpha, flow_set.train.max_steps) == (8, 16.0, 40)
    assert flow_set.train.lr == 1e-4 and flow_set.output.dir == str(tmp_path / "dpo")  # the round's folder wins


# ----------------------------------------------------------------------------- end to end under Prefect


@pytest.fixture(scope="module")
def imagegen_model(tmp_path_factory) -> Path:
    """The tiny world's random MMDiT with its sampling settings beside it (no training)."""
    from atelier_studio.imagegen.config import ImagegenConfig
    from atelier_studio.imagegen.sample import write_run_meta
    from atelier_studio.pipeline.config import load_config

    from tests.imagegen._world import DEMO, build_world, config_overrides

    base = build_world(tmp_path_factory.mktemp("improve-imagegen"), cache=False)
    write_run_meta(base / "model", load_config(ImagegenConfig, DEMO, config_overrides(base)))
    return base


@pytest.fixture(scope="module")
def sft_designer(designer_world, tmp_path_factory) -> Path:
    """The tiny designer after 5 full fine-tuning steps: greedy captions are words, not an immediate end of turn (the
    random model's), so the held-out evaluation draws images to put in the before/after grid."""
    from tests.flows.conftest import atelier, designer_config

    out = tmp_path_factory.mktemp("improve-sft") / "sft"
    cfg = designer_config(designer_world, out, max_steps=5, save_every=5)
    assert atelier(["designer", "train", "--config", str(cfg), "--set", "train.lr=1e-2", "--set", "lora.rank=0",
                    "--set", "train.eval_every=0"]) == 0
    return out / "model"


def _brightness_judge(image, brief):
    """A stand-in for the brief judge: the image's mean brightness as its score (random renders all score 0 with
    the real one, which would leave no pairs)."""
    from atelier_studio.data.judge import BriefImageScore, read_image, to_array

    score = round(float(to_array(image).mean()) / 255.0, 4)
    return BriefImageScore(True, True, True, True, score=score, reading=read_image(image))


@pytest.mark.usefixtures("prefect_harness")
def test_improve_designer_runs_a_round_end_to_end_and_resumes(designer_world, sft_designer, imagegen_model, tmp_path,
                                                              monkeypatch):
    import atelier_studio.data.judge as judge_module
    from atelier_studio.flows.evaluate import read_briefs
    from atelier_studio.flows.improve import improve_designer

    from tests.flows.conftest import designer_config
    from tests.flows.test_flows import artifacts_of, run_flow

    monkeypatch.setattr(judge_module, "judge_image_brief", _brightness_judge)
    all_briefs = read_briefs(imagegen_model / "world" / "briefs_eval.txt")
    briefs, held_out = tmp_path / "briefs.txt", tmp_path / "heldout.txt"
    briefs.write_text("".join(b + "\n" for b in all_briefs[:4]))
    held_out.write_text("".join(b + "\n" for b in all_briefs[4:7]))
    dpo_config = designer_config(designer_world, tmp_path / "unused")  # the tiny LoRA config; this round sets the rest
    out = tmp_path / "improve"
    kwargs = dict(rounds=1, k=3, temperature=1.0, seed=0, dpo_config=str(dpo_config), dpo_steps=2, lora_rank=4,
                  max_new_tokens=8, steps=1, dpo_overrides=["data.seq_len=256", "output.tensorboard=true"], renders=2)
    result, run_id = run_flow(improve_designer, str(sft_designer), str(imagegen_model / "model"),
                              str(briefs), str(held_out), str(out), **kwargs)
    rdir = out / "round-1"
    # the pairs dataset: brief_pair rows, each with its two images and scores, the chosen one scoring higher
    pairs = [json.loads(line) for line in (rdir / "pairs" / "pairs.jsonl").read_text().splitlines()]
    scores = [json.loads(line) for line in (rdir / "pairs" / "scores.jsonl").read_text().splitlines()]
    assert pairs and len(pairs) == len(scores) <= 4
    assert all(set(p) == {"brief", "chosen", "rejected"} and p["chosen"] != p["rejected"] for p in pairs)
    assert all(s["chosen_score"] > s["rejected_score"] for s in scores)
    assert all((rdir / "pairs" / s[side]).is_file() for s in scores for side in ("chosen_image", "rejected_image"))
    # the DPO run: objective dpo, LoRA adapters on the tiny designer, its metrics carry the DPO rewards
    dpo = rdir / "dpo"
    assert (dpo / "adapter" / "adapter_config.json").is_file()
    metrics = [json.loads(line) for line in (dpo / "metrics.jsonl").read_text().splitlines()]
    assert any("train/rewards/accuracies" in m or "rewards/accuracies" in json.dumps(m) for m in metrics)
    assert json.loads((dpo / "improve_eval.json").read_text())["round"] == 1
    # the round's before/after went into the DPO run's own tracker, one step after its last
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(dpo / "tensorboard")).Reload()
    after = [(e.step, e.value) for e in events.Scalars("improve/score_after")]
    assert result["rounds"][0]["trackers"] == ["tensorboard"]
    assert after == [(3, pytest.approx(float(result["rounds"][0]["table"][0]["after"])))]
    # costs, before/after tables, artifacts
    r1 = result["rounds"][0]
    assert r1["costs"]["samples"] == 12 and r1["costs"]["pairs"] == len(pairs)
    assert r1["costs"]["ties"] + r1["costs"]["within_margin"] + r1["costs"]["too_few"] + len(pairs) == 4
    assert {"judge_s", "render_s", "sample_s", "dpo_s", "renders"} <= set(r1["costs"])
    # each caption rendered twice, from other noise: a chosen sample's score is the mean of its two judged renders
    assert r1["costs"]["renders_per_caption"] == 2 and r1["costs"]["renders"] == 2 * 12
    first, second = (json.loads((rdir / "samples" / d / "scores.json").read_text())["per_brief"]
                     for d in (".", "render-2"))
    both = [(e["score"], f["score"]) for e, f in zip(first, second)
            if e["score"] is not None and f["score"] is not None]
    assert any(a != b for a, b in both)  # other noise, other renders
    means = {round((a + b) / 2, 9) for a, b in both}
    assert {round(s["chosen_score"], 9) for s in scores} <= means
    assert [row["check"] for row in r1["table"]][0] == "score"
    for side in ("eval-before", "round-1/eval-after"):
        assert len(json.loads((out / side / "scores.json").read_text())["per_brief"]) == 3
    arts = artifacts_of(run_id)
    assert {"improve-designer-summary", "improve-designer-round-1", "improve-designer-round-1-briefs"} <= set(arts)
    assert "| 1 | 12 |" in arts["improve-designer-summary"]["data"]
    assert "before (top), after (bottom)" in arts["improve-designer-round-1"]["data"]
    assert len(json.loads(arts["improve-designer-round-1-briefs"]["data"])) == 3
    # a re-run resumes the finished round instead of redoing it
    stamp = (rdir / "round.json").stat().st_mtime_ns
    again, _ = run_flow(improve_designer, str(sft_designer), str(imagegen_model / "model"),
                        str(briefs), str(held_out), str(out), **kwargs)
    assert (rdir / "round.json").stat().st_mtime_ns == stamp and again["designer"] == result["designer"]
    # an unfinished round (no round.json) keeps the pairs it wrote, and its DPO run resumes at its last checkpoint
    (rdir / "round.json").unlink()
    sampled = (rdir / "samples" / "captions.jsonl").stat().st_mtime_ns
    again, _ = run_flow(improve_designer, str(sft_designer), str(imagegen_model / "model"),
                        str(briefs), str(held_out), str(out), **kwargs)
    assert (rdir / "samples" / "captions.jsonl").stat().st_mtime_ns == sampled
    timed = ("dpo_s",)  # the resumed DPO run's own seconds differ; every other cost is the pairs' costs.json
    assert {k: v for k, v in again["rounds"][0]["costs"].items() if k not in timed} == \
        {k: v for k, v in r1["costs"].items() if k not in timed} and (rdir / "round.json").is_file()
    assert len((dpo / "metrics.jsonl").read_text().splitlines()) == len(metrics)  # no step trained twice


@pytest.mark.parametrize("arg, value", [("--k", "1"), ("--k", "-3"), ("--k", "1" + "0" * 30), ("--k", "abc"),
                                        ("--rounds", "0"), ("--rounds", "99999999999"), ("--temperature", "0"),
                                        ("--temperature", "1e400"), ("--margin", "-1"), ("--dpo-steps", "-1"),
                                        ("--seed", "-1"), ("--renders", "0"), ("--renders", "65")])
def test_the_module_command_refuses_bad_numbers_in_one_line(tmp_path, capsys, arg, value):
    from atelier_studio.flows.improve import main as improve_main

    briefs = tmp_path / "b.txt"
    briefs.write_text("a red circle\n")
    with pytest.raises(SystemExit) if value.isalpha() else contextlib.nullcontext() as stopped:
        code = improve_main(["--designer", "d", "--imagegen", "i", "--briefs", str(briefs), "--eval-briefs",
                             str(briefs), arg, value])
    code = stopped.value.code if value.isalpha() else code
    err = capsys.readouterr()
    assert code == 2 and err.out == "" and err.err.count("\n") == 1, err
    assert err.err.startswith("atelier: error:") and arg in err.err and "Traceback" not in err.err
