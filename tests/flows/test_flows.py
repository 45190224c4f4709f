"""The flows under a Prefect test harness: artifacts, bad input, retry after a killed trainer, the eval chain, the
validation images of a training run, render-briefs and the evaluation of any brief (the shapes-world judge, CLIP)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from atelier_studio.flows.evaluate import brief_to_image_eval, evaluate_brief_to_image, read_briefs
from atelier_studio.flows.launch import pid_dir
from atelier_studio.flows.train_designer import train_designer
from atelier_studio.flows.train_imagegen import needs_cache, train_imagegen
from atelier_studio.flows.training import FlowInputError

from tests.flows.conftest import designer_config
from tests.imagegen._world import DEMO, build_world, config_overrides

pytestmark = pytest.mark.usefixtures("prefect_harness")


def run_flow(fn, *args, **kwargs):
    """(result, flow_run_id) of a flow called in-process."""
    state = fn(*args, return_state=True, **kwargs)
    return state.result(), state.state_details.flow_run_id


def artifact_versions(flow_run_id) -> list:
    """Every artifact a flow run (and its tasks) created, each version of a key on its own, oldest first."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import ArtifactSort

    with get_client(sync_client=True) as client:
        newest_first = client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
                                             sort=ArtifactSort.CREATED_DESC)
    return newest_first[::-1]


def artifacts_of(flow_run_id) -> dict[str, dict]:
    """The newest version of each key."""
    return {a.key: {"type": a.type, "data": a.data} for a in artifact_versions(flow_run_id) if a.key}


def logs_of(flow_run_id) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    # Run logs reach the API in background batches: send what is still queued before reading (without this the
    # last lines of a run, e.g. a retry's "resumed from", were sometimes missing). Then read every page: the API
    # returns at most PREFECT_API_DEFAULT_LIMIT entries per call.
    APILogHandler().flush()
    out: list[str] = []
    with get_client(sync_client=True) as client:
        while True:
            page = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])),
                                    offset=len(out))
            out += [entry.message for entry in page]
            if not page:
                return out


@pytest.fixture(scope="module")
def designer_run(designer_world, tmp_path_factory):
    out = tmp_path_factory.mktemp("flows") / "d1"
    result, run_id = run_flow(train_designer, str(designer_config(designer_world, out)))
    return Path(result), run_id


def test_train_designer_publishes_metrics_summary_and_progress(designer_run):
    out, run_id = designer_run
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert json.loads((out / "summary.json").read_text())["step"] == 6
    arts = artifacts_of(run_id)
    assert {"train-designer-summary", "train-designer-metrics", "designer-progress"} <= set(arts)
    summary = arts["train-designer-summary"]["data"]
    assert "throughput (tokens/s, median)" in summary and "MFU" in summary and str(out.resolve()) in summary
    assert "Fallbacks:" in summary and "plain-PyTorch references" in summary  # a CPU run says what it ran
    rows = json.loads(arts["train-designer-metrics"]["data"])
    assert [r["step"] for r in rows if r["kind"] == "train"] == [str(s) for s in range(1, 7)]
    assert float(arts["designer-progress"]["data"]) == 100.0
    assert any(m.startswith("step 6/6 loss") for m in logs_of(run_id))  # the trainer's lines reached Prefect


def test_bad_config_and_missing_model_are_named_before_training(designer_world, tmp_path):
    cfg = designer_config(designer_world, tmp_path / "run")
    with pytest.raises(FlowInputError, match=r"train\.lr.*fast"):
        train_designer(str(cfg), overrides=["train.lr=fast"])
    with pytest.raises(FlowInputError, match=r"train\.no_such_key"):
        train_designer(str(cfg), overrides=["train.no_such_key=1"])
    with pytest.raises(FlowInputError, match=r"model\.path .*nowhere.*atelier designer init"):
        train_designer(str(cfg), overrides=[f"model.path={tmp_path / 'nowhere'}"])
    with pytest.raises(FlowInputError, match="missing.toml: no such file .* no shipped config of that name"):
        train_designer(str(tmp_path / "missing.toml"))
    assert not (tmp_path / "run").exists()  # nothing started


def _kill_trainer_after_checkpoint(out: Path, ckpt: str, killed: list) -> None:
    """SIGKILL the trainer's process group (found through launch's pid files) once `ckpt` is written."""
    deadline = time.time() + 120
    while time.time() < deadline:
        if (out / "checkpoints" / ckpt / "manifest.json").is_file():
            for f in pid_dir().glob("*.pgid"):
                pgid = int(f.read_text())
                try:
                    cmdline = Path(f"/proc/{pgid}/cmdline").read_bytes().decode(errors="replace")
                except FileNotFoundError:
                    continue
                if str(out) in cmdline or str(out.parent) in cmdline:
                    os.killpg(pgid, signal.SIGKILL)
                    killed.append((pgid, (out / "checkpoints" / ckpt / "manifest.json").stat().st_mtime_ns))
                    return
        time.sleep(0.05)


def test_failed_training_keeps_checkpoints_and_the_retry_resumes(designer_world, tmp_path):
    out = tmp_path / "killed"
    cfg = designer_config(designer_world, out, max_steps=40, save_every=4, extra="keep_checkpoints = 0")
    killed: list = []
    killer = threading.Thread(target=_kill_trainer_after_checkpoint, args=(out, "step-4", killed))
    killer.start()
    result, run_id = run_flow(train_designer, str(cfg))
    killer.join()
    assert killed, "the trainer finished before it could be killed"
    # the first attempt died by SIGKILL; its checkpoint survived untouched and the retry resumed from it
    assert (out / "checkpoints" / "step-4" / "manifest.json").stat().st_mtime_ns == killed[0][1]
    logs = logs_of(run_id)
    assert any("trainer exited with code -9" in m for m in logs)
    resumed = [m for m in logs if m.startswith("resumed from")]
    assert resumed and "step-" in resumed[0]
    steps = [json.loads(l)["step"] for l in (out / "metrics.jsonl").read_text().splitlines()
             if json.loads(l)["kind"] == "train"]
    assert steps == list(range(1, 41))  # one curve, no duplicates after the resume
    assert json.loads((out / "summary.json").read_text())["step"] == 40


# ----------------------------------------------------------------------------- imagegen and the evaluation


@pytest.fixture(scope="module")
def imagegen_run(tmp_path_factory):
    """train-imagegen on a world with image shards but no latents yet: (base, out, overrides, needed_cache, run id)."""
    from atelier_studio.imagegen.config import ImagegenConfig
    from atelier_studio.pipeline.config import load_config

    base = build_world(tmp_path_factory.mktemp("flows-imagegen"), cache=False)
    out = base / "i1"
    overrides = config_overrides(base, out) + ["train.max_steps=4", "train.warmup_steps=1", "train.save_every=0",
                                               "train.eval_every=0", "sample.every=2", "sample.steps=2",
                                               "ema.decay=0.5"]
    needed = needs_cache(load_config(ImagegenConfig, DEMO, overrides))
    result, run_id = run_flow(train_imagegen, str(DEMO), overrides=overrides)
    assert Path(result) == out
    return base, out, overrides, needed, run_id


def test_train_imagegen_caches_latents_first_then_trains(imagegen_run):
    from atelier_studio.imagegen.config import ImagegenConfig
    from atelier_studio.pipeline.config import load_config

    base, out, overrides, needed, run_id = imagegen_run
    assert needed and any((base / "latents").glob("*.tar"))
    assert (out / "ema" / "config.json").is_file()
    assert not needs_cache(load_config(ImagegenConfig, DEMO, overrides))  # a second run would not re-encode
    arts = artifacts_of(run_id)
    assert {"train-imagegen-summary", "train-imagegen-metrics", "imagegen-progress"} <= set(arts)
    assert "images/s" in arts["train-imagegen-summary"]["data"]
    assert "data:image/png;base64," in arts["train-imagegen-summary"]["data"]  # the sample grid, inline
    # each evaluation's validation grid (sample.every = 2 of 4 steps) is one version of an image artifact
    grids = [a for a in artifact_versions(run_id) if a.key == "imagegen-samples"]
    assert [a.type for a in grids] == ["image", "image"]
    assert all(a.data.startswith("data:image/jpeg;base64,") for a in grids)
    assert [a.description.split(":")[0] for a in grids] == ["step 2/4", "step 4/4"]
    assert any(m.startswith("samples step 4/4: ") and "EMA weights" in m for m in logs_of(run_id))


def test_eval_flow_scores_briefs_and_matches_the_plain_function(designer_run, imagegen_run, tmp_path):
    designer_dir, _ = designer_run
    base, out = imagegen_run[:2]
    briefs = tmp_path / "briefs.txt"
    briefs.write_text("".join(b + "\n" for b in read_briefs(base / "world" / "briefs_eval.txt")[:6]))
    result, run_id = run_flow(brief_to_image_eval, str(designer_dir), str(out / "ema"), str(briefs),
                              str(tmp_path / "eval"), seed=1, max_new_tokens=12, steps=2)
    agg = result["aggregate"]
    assert agg["n"] == 6 and 0.0 <= agg["score"] <= 1.0
    scores = json.loads((tmp_path / "eval" / "scores.json").read_text())
    assert [r["brief"] for r in scores["per_brief"]] == read_briefs(briefs)
    assert (tmp_path / "eval" / "scores.csv").read_text().count("\n") == 7
    drawn = [r for r in scores["per_brief"] if r["image"] is not None]
    assert all(r["score"] == 0.0 for r in scores["per_brief"] if r["image"] is None)  # empty caption: no image
    assert (tmp_path / "eval" / "grid.png").is_file() == bool(drawn)
    arts = artifacts_of(run_id)
    assert "Judged score" in arts["brief-to-image-eval-summary"]["data"]
    assert len(json.loads(arts["brief-to-image-eval-scores"]["data"])) == 6
    # the CLI's plain entry point (no Prefect) gives the same scores for the same seed
    plain = evaluate_brief_to_image(designer_dir, out / "ema", briefs, tmp_path / "plain", seed=1,
                                    max_new_tokens=12, steps=2)
    assert plain["aggregate"] == agg


def test_judge_scores_true_images_high_and_empty_captions_zero(tmp_path):
    """The world's own images with their true captions: the judge agrees; a row with no caption scores 0."""
    from atelier_studio.data.synthetic import generate_world
    from atelier_studio.flows.evaluate import judge

    world = tmp_path / "world"
    generate_world(world, n=40, seed=3, image_size=32, eval_fraction=0.25)
    rows = [json.loads(l) for l in (world / "eval.jsonl").read_text().splitlines()]
    captions = tmp_path / "captions.jsonl"
    captions.write_text("".join(json.dumps({"brief": r["brief"], "caption": r["caption"] if i else ""}) + "\n"
                                for i, r in enumerate(rows)))
    index = tmp_path / "images.json"
    index.write_text(json.dumps([None] + [str(world / r["image"]) for r in rows[1:]]))
    result = judge(captions, index, tmp_path / "out")
    per = json.loads((tmp_path / "out" / "scores.json").read_text())["per_brief"]
    assert per[0]["score"] == 0.0 and per[0]["caption_score"] == 0.0
    assert all(r["score"] == 1.0 and r["image_caption_score"] == 1.0 for r in per[1:])
    assert result["aggregate"]["score"] == pytest.approx((len(rows) - 1) / len(rows))
    assert result["captions"]["parsed_fraction"] == pytest.approx((len(rows) - 1) / len(rows))
    assert (tmp_path / "out" / "grid.png").is_file() and (tmp_path / "out" / "scores.csv").is_file()


def test_eval_of_given_captions_judges_the_world_images_or_samples_them(imagegen_run, tmp_path):
    """`atelier eval --captions`: the world's own renders score 1 everywhere (the judge is right on the truth); with
    the imagegen, one image is sampled per row and judged against the row's brief and caption."""
    from atelier_studio.data.synthetic import generate_world
    from atelier_studio.flows.cli import main
    from atelier_studio.flows.evaluate import evaluate_captions

    world = tmp_path / "world"
    generate_world(world, n=24, seed=5, image_size=32, eval_fraction=0.25)
    rows = [json.loads(l) for l in (world / "eval.jsonl").read_text().splitlines()]
    truth = evaluate_captions(world / "eval.jsonl", tmp_path / "truth")
    assert truth["aggregate"]["n"] == len(rows) == 6
    assert all(truth["aggregate"][k] == 1.0 for k in ("score", "color_ok", "shape_ok", "position_ok",
                                                        "caption_score", "image_caption_score"))
    judged = json.loads((tmp_path / "truth" / "scores.json").read_text())["per_brief"]
    assert [r["image"] for r in judged] == [str(world / r["image"]) for r in rows]

    out = imagegen_run[1]
    assert main(["eval", "--captions", str(world / "eval.jsonl"), "--imagegen", str(out / "ema"), "--out",
                 str(tmp_path / "sampled"), "--steps", "2", "--guidance", "2.0"]) == 0
    sampled = json.loads((tmp_path / "sampled" / "scores.json").read_text())
    assert [r["caption"] for r in sampled["per_brief"]] == [r["caption"] for r in rows]
    assert all(Path(r["image"]).parent == tmp_path / "sampled" / "images" for r in sampled["per_brief"])
    # the images are the sampler's for this seed, steps and guidance: the same call draws the same images
    again = evaluate_captions(world / "eval.jsonl", tmp_path / "again", out / "ema", steps=2, guidance=2.0)
    assert again["aggregate"] == sampled["aggregate"]


def test_eval_of_given_captions_bad_inputs_are_named(tmp_path):
    from atelier_studio.flows.evaluate import evaluate_captions

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"brief": "something calm with a circle", "caption": "a small blue circle in the center on a '
                    'white background"}\n\n{"brief": "something calm with a circle"}\n')
    with pytest.raises(FlowInputError, match=rf"{rows}:3: expected an object with string fields 'brief' and 'caption'"):
        evaluate_captions(rows, tmp_path / "e")
    rows.write_text('{"brief": "a plain poster", "caption": "a small blue circle"}\n')
    with pytest.raises(FlowInputError, match=rf"{rows}:1: brief 'a plain poster' cannot be judged"):
        evaluate_captions(rows, tmp_path / "e")
    rows.write_text('{"brief": "something calm with a circle", "caption": "a circle"}\n')
    with pytest.raises(FlowInputError, match=rf"{rows}: row 1 names no 'image'; without --imagegen"):
        evaluate_captions(rows, tmp_path / "e")
    rows.write_text('{"brief": "something calm with a circle", "caption": "a circle", "image": "gone.png"}\n')
    with pytest.raises(FlowInputError, match=rf"image {tmp_path / 'gone.png'} does not exist"):
        evaluate_captions(rows, tmp_path / "e")
    (tmp_path / "mmdit").mkdir()
    (tmp_path / "mmdit" / "config.json").write_text("{}")  # only its presence is checked before the steps
    with pytest.raises(FlowInputError, match=r"steps: the sampler needs at least 1 Euler step per image, got 0"):
        evaluate_captions(rows, tmp_path / "e", imagegen=tmp_path / "mmdit", steps=0)
    assert not (tmp_path / "e").exists()


def test_eval_bad_inputs_are_named(designer_run, imagegen_run, tmp_path):
    designer_dir, _ = designer_run
    out = imagegen_run[1]
    bad = tmp_path / "briefs.jsonl"
    bad.write_text('{"brief": "something calm with a circle"}\n\n{"brief": 3}\n')
    with pytest.raises(FlowInputError, match=rf"{bad}:3: .*'brief'"):
        read_briefs(bad)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"brief": "something calm with a circle"}\n{"brief": \n')
    with pytest.raises(FlowInputError, match=rf"{broken}:2: malformed JSON"):
        brief_to_image_eval(str(designer_dir), str(out / "ema"), str(broken), str(tmp_path / "e"))
    good = tmp_path / "good.txt"
    good.write_text("something calm with a circle\n")
    with pytest.raises(FlowInputError, match=r"designer .*nope.* does not exist"):
        brief_to_image_eval(str(tmp_path / "nope"), str(out / "ema"), str(good), str(tmp_path / "e"))
    with pytest.raises(FlowInputError, match=r"imagegen .*no config.json"):
        brief_to_image_eval(str(designer_dir), str(tmp_path), str(good), str(tmp_path / "e"))


# ----------------------------------------------------------------------------- any brief: render-briefs, CLIP scores

ANY_BRIEFS = ["a poster for a jazz night, moody blues", "something calm with a circle",
              "a birthday card for my grandmother"]


def test_render_briefs_renders_any_text_under_prefect(designer_run, imagegen_run, tmp_path):
    from atelier_studio.flows.render import render_briefs

    designer_dir, _ = designer_run
    briefs = tmp_path / "briefs.jsonl"
    briefs.write_text("".join(json.dumps({"brief": b}) + "\n" for b in ANY_BRIEFS))
    result, run_id = run_flow(render_briefs, str(designer_dir), str(imagegen_run[1]), str(briefs),
                              str(tmp_path / "render"), seed=1, max_new_tokens=12, steps=2)
    rows = [json.loads(line) for line in (tmp_path / "render" / "render.jsonl").read_text().splitlines()]
    assert [r["brief"] for r in rows] == ANY_BRIEFS and result["briefs"] == 3
    drawn = [r for r in rows if r["image"] is not None]
    assert result["images"] == len(drawn) and all(Path(r["image"]).is_file() for r in drawn)
    assert all(r["caption"].strip() for r in drawn)  # only an empty caption goes without an image
    arts = artifacts_of(run_id)
    assert arts["render-briefs"]["type"] == "markdown" and "3 briefs" in arts["render-briefs"]["data"]
    assert [r["brief"] for r in json.loads(arts["render-briefs-captions"]["data"])] == ANY_BRIEFS


def test_eval_scores_any_brief_and_says_which_scores_ran(designer_run, imagegen_run, tmp_path):
    """Shapes-world briefs get the judge; with a local CLIP directory every image gets CLIP scores, the only ones
    the other briefs can get; without it those are listed as not scored."""
    from tests.data.test_clip_score import build_clip

    designer_dir, _ = designer_run
    out = imagegen_run[1]
    briefs = tmp_path / "briefs.txt"
    briefs.write_text("".join(b + "\n" for b in ANY_BRIEFS))
    clip = build_clip(tmp_path / "clip")
    result, run_id = run_flow(brief_to_image_eval, str(designer_dir), str(out / "ema"), str(briefs),
                              str(tmp_path / "eval"), seed=1, max_new_tokens=12, steps=2, clip=str(clip))
    assert result["scores_run"] == {"shapes-world judge": 1, "CLIP score": 3} and result["not_scored"] == []
    per = json.loads((tmp_path / "eval" / "scores.json").read_text())["per_brief"]
    assert [r["scorer"] for r in per] == ["CLIP score", "shapes-world judge", "CLIP score"]
    assert all(0.0 <= r["clip_brief"] <= 100.0 and 0.0 <= r["clip_caption"] <= 100.0 for r in per)
    assert per[0]["score"] is None and per[1]["score"] is not None
    assert result["aggregate"]["judged"] == 1 and result["aggregate"]["clip_brief"] is not None
    assert "CLIP score" in artifacts_of(run_id)["brief-to-image-eval-summary"]["data"]
    assert any("scores run: shapes-world judge on 1 of 3 briefs" in m for m in logs_of(run_id))

    plain = evaluate_brief_to_image(designer_dir, out / "ema", briefs, tmp_path / "plain", seed=1,
                                    max_new_tokens=12, steps=2)  # no CLIP: only the shapes-world brief is scored
    assert plain["scores_run"] == {"shapes-world judge": 1} and plain["not_scored"] == [0, 2]
    assert "2 briefs outside the shapes world not scored" in (tmp_path / "plain" / "summary.md").read_text()
    with pytest.raises(FlowInputError, match=r"clip .*nowhere: not a local transformers CLIP directory"):
        brief_to_image_eval(str(designer_dir), str(out / "ema"), str(briefs), str(tmp_path / "e"),
                            clip=str(tmp_path / "nowhere"))
