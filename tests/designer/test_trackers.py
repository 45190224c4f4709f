"""A tiny designer run with every tracker (offline, tests/_trackers.py): the same per-step loss in metrics.jsonl,
TensorBoard, W&B and MLflow, and the held-out briefs' captions as a table at each evaluation, judged (the fixture's
briefs are shapes-world briefs)."""

from __future__ import annotations

import json

from atelier_studio.flows.cli import main

from tests._trackers import assert_same_losses_everywhere, mlflow_history, wandb_history
from tests.designer.test_train import ROOT, train_args

# shapes-world briefs (data/synthetic.py's parse_brief reads each): the judge scores their captions
SHAPES_BRIEFS = ("a calm poster with a circle on the left", "something angular, bold",
                 "a moody blocky design at the top")
CAPTION = "a small red circle in the center on a white background"


def test_a_run_logs_the_same_losses_and_its_captions_to_every_tracker(world, tracker_env, tmp_path):
    out = tmp_path / "run"
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text("".join(json.dumps({"brief": b, "caption": CAPTION}) + "\n" for b in SHAPES_BRIEFS))
    assert main(train_args(world, out, "--set", f"data.eval={held_out}", "--set", "lora.rank=4",
                           "--set", "train.max_steps=4", "--set",
                           "train.eval_every=2", "--set", "sample.briefs=3", "--set", "sample.max_new_tokens=8",
                           "--set", "output.tensorboard=true",
                           "--set", "output.trackers=tensorboard,wandb,mlflow")) == 0
    run_id = assert_same_losses_everywhere(out, tracker_env, [1, 2, 3, 4])

    rows = [json.loads(line) for line in (out / "samples" / "captions-step-4.jsonl").read_text().splitlines()]
    assert [(r["brief"], r["step"]) for r in rows] == [(b, 4) for b in SHAPES_BRIEFS]
    assert all(isinstance(r["caption"], str) for r in rows)
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    scores = [(r["step"], r["caption_score"]) for r in evals if r["kind"] == "eval" and "caption_score" in r]
    assert [s for s, _ in scores] == [2, 4] and all(0.0 <= v <= 1.0 for _, v in scores)
    assert [s for s, _ in mlflow_history(tracker_env.uri, run_id, "eval/caption_score")] == [2, 4]
    assert {r["_step"] for r in wandb_history(out) if r.get("captions/_type") == "table-file"} == {2, 4}


def test_captions_of_briefs_outside_the_shapes_world_are_not_judged(world):
    from atelier_studio.data.synthetic import parse_brief
    from atelier_studio.data.tokenizer import load_tokenizer
    from atelier_studio.designer.samples import CaptionSampler

    tokenizer = load_tokenizer(world / "tok")
    assert all(parse_brief(b) is not None for b in SHAPES_BRIEFS)
    assert CaptionSampler(tokenizer, SHAPES_BRIEFS, 8, 128).judged
    assert not CaptionSampler(tokenizer, [*SHAPES_BRIEFS, "a poster for a jazz night"], 8, 128).judged


def test_a_dpo_run_logs_its_rewards_to_every_tracker(world, tracker_env, tmp_path):
    """train.objective = "dpo": rewards/* and logps/* of each logged step and each evaluation, the same in
    metrics.jsonl, TensorBoard, W&B and MLflow."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests._trackers import assert_same, checkpoint_trackers

    pairs = ROOT / "tests" / "fixtures" / "designer" / "pairs.jsonl"
    out = tmp_path / "dpo"
    assert main(train_args(world, out, "--set", f"data.train={pairs}", "--set", f"data.eval={pairs}",
                           "--set", "data.seq_len=256", "--set", "train.objective=dpo", "--set", "lora.rank=4",
                           "--set", "train.max_steps=2", "--set", "sample.briefs=0",
                           "--set", "data.max_eval_batches=2", "--set", "output.tensorboard=true",
                           "--set", "output.trackers=tensorboard,wandb,mlflow")) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(out / "tensorboard")).Reload()
    run_id = checkpoint_trackers(out)["mlflow"]["run_id"]
    history = wandb_history(out)
    for kind, steps in (("train", [1, 2]), ("eval", [2])):
        for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                     "logps/rejected"):
            want = [(r["step"], r[name]) for r in records if r["kind"] == kind]
            assert [s for s, _ in want] == steps
            assert_same([(e.step, e.value) for e in events.Scalars(f"{kind}/{name}")], want)
            assert_same(mlflow_history(tracker_env.uri, run_id, f"{kind}/{name}"), want)
            assert_same([(r["_step"], r[f"{kind}/{name}"]) for r in history if f"{kind}/{name}" in r], want)
