"""bench/imagegen.py end to end at tiny size on the CPU (fp32, Triton kernels through the interpreter): every JSON
field, and Atelier's MMDiT agreeing with diffusers' SD3Transformer2DModel on the same weights and batches; the
sd3.5-medium-1024 config (MMDiT-X at tiny size: QK RMSNorm, dual attention) with LoRA against diffusers + PEFT."""

from __future__ import annotations

import json
import math

import pytest
import torch

from atelier_studio.bench.imagegen import (
    CONFIGS,
    Variant,
    attempt,
    bench,
    build_atelier,
    build_peer,
    main,
    make_batches,
    make_lora,
    markdown,
    model_args,
    random_state_dict,
    tiny_config,
)

from tests.bench._budget import SpentAfter

CPU = torch.device("cpu")
# The tiny bench runs on the CPU: the Triton kernels through the interpreter (tests/conftest.py) where there is no
# GPU; a GPU host compiles Triton for CUDA only, so there the CPU run takes the references.
KERNELS = "ref" if torch.cuda.is_available() else "triton"


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    assert main(["--config", "sd3-medium-1024", "--tiny", "--out", str(out), "--peers", "diffusers", "--steps", "2",
                 "--warmup", "1", "--ablation", "--loader-workers", "2", "--kernels", KERNELS, "--fp8", "rowwise"]) == 0
    (path,) = out.glob("imagegen-sd3-medium-1024-*.json")
    assert path.with_suffix(".md").is_file()
    return json.loads(path.read_text())


def test_tiny_run_writes_every_field(tiny_report):
    r = tiny_report
    for key in ("gpu", "versions", "clocks", "matmul_tflops", "config", "atelier", "peers", "loss_mean_abs_diff",
                "ablation", "loader_images_per_s"):
        assert key in r, key
    assert set(r["clocks"]) == {"before", "after"}
    a = r["atelier"]
    assert set(a) >= {"images_per_s", "mfu", "peak_gb", "batch"}
    assert a["images_per_s"] > 0 and a["mfu"] > 0 and a["batch"] in (1, 2)
    d = r["peers"]["diffusers"]
    assert d["images_per_s"] > 0 and d["mfu"] > 0 and "peak_gb" in d
    assert set(r["ablation"]) == {"all_on", "no_compile", "reference_kernels", "foreach_adamw"}
    assert all(v > 0 for v in r["ablation"].values())
    assert r["loader_images_per_s"] > 0 and r["loader"]["workers"] == 2
    assert r["ema_update"]["foreach_ms"] > 0
    assert r["config"]["image_tokens"] == 16 and r["config"]["text_tokens"] == 7
    for run in list(r["sweep"].values()) + list(r["peer_runs"]["diffusers"].values()):
        assert all(math.isfinite(x) for x in run["timed_losses"])
    # every MFU beside the dense bf16 one: the dense FP8 peak is 1,979 (the measured matmul rates need a GPU)
    f = r["fp8"]["rowwise"]
    for row in (a, d, f):
        assert row["mfu_fp8_peak"] == pytest.approx(row["mfu"] * 989 / 1979, rel=1e-12)
        assert row["mfu_matmul"] is None and row["mfu_matmul_fp8"] is None
    assert r["strongest_peer"] == "diffusers"
    assert r["speedup_vs_strongest_peer"] == pytest.approx(a["images_per_s"] / d["images_per_s"], rel=1e-12)
    # the FP8 row ran on the bf16 run's batches (fp32 here, so any loss difference is the FP8 quantisation):
    # nonzero, and far below one E4M3 rounding step of the loss (2^-4 relative: independent operand roundings
    # average out in every dot product)
    assert f["batch"] == a["batch"] and f["images_per_s"] > 0
    assert 0 < f["loss_mean_abs_diff_vs_bf16"] < 2**-4 * r["sweep"][str(a["batch"])]["timed_losses"][0]
    assert "| atelier fp8 rowwise |" in markdown(r) and "| FP8 ablation |" in markdown(r)


def test_tiny_loss_parity_with_diffusers(tiny_report):
    assert tiny_report["loss_mean_abs_diff"] < 1e-5


def test_same_weights_same_prediction_and_training():
    """Beyond the loss (at random init it is dominated by the target's variance): Atelier with Triton kernels and
    diffusers predict the same velocity, and after 3 AdamW steps on one batch hold the same weights."""
    cfg = tiny_config(CONFIGS["sd3-medium-512"])
    args = model_args(cfg)
    sd = random_state_dict(args, torch.float32, CPU, seed=0)
    (b,) = make_batches(cfg, args, 2, 1, CPU, torch.float32, seed=1)
    runs = [build_atelier(args, sd, Variant(compile=False, kernels=KERNELS), exact=True),
            build_peer("diffusers", args, sd, exact=True)]
    preds = [run.forward(b.x0, b.text, b.pooled, b.t * 1000) for run in runs]
    assert preds[0].abs().mean() > 0.05
    torch.testing.assert_close(preds[0], preds[1], rtol=1e-4, atol=1e-5)
    losses = []
    for run in runs:
        opt = torch.optim.AdamW(run.params, lr=1e-3, weight_decay=0.0, foreach=True)
        for _ in range(3):
            loss = run.loss(b)
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(run.loss(b).item())
    assert abs(losses[0] - losses[1]) < 1e-4 * abs(losses[1])
    state = runs[1].model.state_dict()
    for name, p in runs[0].model.state_dict().items():
        torch.testing.assert_close(p, state[name], rtol=1e-3, atol=1e-4, msg=name)


def test_bad_arguments_say_what(capsys):
    with pytest.raises(SystemExit):
        main(["--config", "sd3-medium-512", "--tiny", "--peers", "onediff"])
    assert "--peers: unknown ['onediff']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--config", "sd3-medium-512", "--tiny", "--batches", "two"])
    assert "expected comma-separated ints" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--config", "sd3-medium-512", "--tiny", "--ablation", "no_kernels"])
    assert "--ablation: unknown ['no_kernels']" in capsys.readouterr().err


def test_a_failing_run_is_a_result_not_the_end_of_the_bench():
    cfg = tiny_config(CONFIGS["sd3-medium-512"])
    batches = make_batches(cfg, model_args(cfg), 1, 1, CPU, torch.float32, seed=0)

    def build():
        raise RuntimeError("No available kernel. Aborting execution.\nmore detail")

    r = attempt(build, batches, 0, 1, 1e-5, flops=1)
    assert r == {"oom": False, "failed": True, "error": "RuntimeError: No available kernel. Aborting execution."}


@pytest.fixture(scope="module")
def tiny_lora_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-lora")
    assert main(["--config", "sd3.5-medium-1024", "--tiny", "--lora", "4", "--out", str(out), "--peers", "diffusers",
                 "--steps", "2", "--warmup", "1", "--ablation", "reference_kernels", "--loader-workers", "0",
                 "--kernels", KERNELS]) == 0
    (path,) = out.glob("imagegen-sd3.5-medium-1024-lora4-*.json")
    assert "LoRA r4" in path.with_suffix(".md").read_text()
    return json.loads(path.read_text())


def test_tiny_sd35_lora_run_writes_every_field(tiny_lora_report):
    r = tiny_lora_report
    model = r["config"]["model"]
    assert model["qk_norm"] == "rms_norm" and model["dual_attention_layers"] == [0]  # MMDiT-X at tiny size
    # every attention projection: block 0 has both streams' 8 and attn2's 4, the last block 6 (no text output)
    assert r["lora"]["rank"] == 4 and r["lora"]["modules"] == 12 + 6
    for run in (r["atelier"], r["peers"]["diffusers"]):
        assert run["images_per_s"] > 0 and 0 < run["mfu"] < run["mfu_6n"]  # 4N + 6N_lora < 6N
    assert set(r["ablation"]) == {"all_on", "reference_kernels"}
    assert r["loss_mean_abs_diff"] < 1e-5  # fp32: two implementations of the same LoRA training
    assert r["ema_update"]["foreach_ms"] > 0


def test_lora_runs_train_the_same_adapters_as_diffusers_with_peft():
    """The bench's two LoRA runs on one batch: the same trainable set, prediction and, after 3 AdamW steps, adapters."""
    cfg = tiny_config(CONFIGS["sd3.5-medium-1024"])
    args = model_args(cfg)
    sd = random_state_dict(args, torch.float32, CPU, seed=0)
    lora = make_lora(args, 4, CPU, seed=1)
    (b,) = make_batches(cfg, args, 2, 1, CPU, torch.float32, seed=1)
    runs = [build_atelier(args, sd, Variant(compile=False, kernels=KERNELS), exact=True, lora=lora),
            build_peer("diffusers", args, sd, exact=True, lora=lora)]
    assert [sum(p.numel() for p in run.params) for run in runs] == [sum(v.numel() for v in lora.weights.values())] * 2
    preds = [run.forward(b.x0, b.text, b.pooled, b.t * 1000) for run in runs]
    torch.testing.assert_close(preds[0], preds[1], rtol=1e-4, atol=1e-5)
    for run in runs:
        opt = torch.optim.AdamW(run.params, lr=1e-3, weight_decay=0.0, foreach=True)
        for _ in range(3):
            run.loss(b).backward()
            opt.step()
            opt.zero_grad()
    theirs = dict(runs[1].model.named_parameters())
    for name, p in runs[0].model.named_parameters():
        if p.requires_grad:  # <module>.lora_A.weight -> <module>.lora_A.default.weight
            torch.testing.assert_close(p, theirs[name.replace(".weight", ".default.weight")], rtol=1e-3, atol=1e-4,
                                       msg=name)


def test_a_spent_budget_skips_the_rest_and_every_run_is_reported():
    """Atelier's bf16 run fits; the FP8 row, the peer and the loader are recorded as skipped, and the report was
    handed out after every run."""
    cfg = tiny_config(CONFIGS["sd3-medium-512"])
    seen = []
    r = bench("sd3-medium-512", cfg, ["diffusers"], [1], steps=1, warmup=0, ablation=[], loader_workers=0,
              device=CPU, exact=True, kernels=KERNELS, fp8=("tensorwise",), budget=SpentAfter(1),
              on_result=lambda rep: seen.append(rep["atelier"].get("images_per_s")))
    assert r["atelier"]["images_per_s"] > 0 and seen[0] == r["atelier"]["images_per_s"] and len(seen) >= 3
    assert r["fp8"]["tensorwise"]["skipped"].startswith("time budget")
    assert r["peers"]["diffusers"]["skipped"].startswith("time budget")
    assert r["loader"]["error"].startswith("time budget")
    assert "time budget" in markdown(r)


def test_tiny_qwen_image_lora_run_asks_the_registry(tmp_path):
    """Qwen-Image's bench config at tiny size: Atelier's and diffusers' QwenImageTransformer2DModel + PEFT (called as
    QwenImagePipeline calls it, the text mask in the pooled vector's place) on the same weights, adapters and
    batches."""
    assert main(["--config", "qwen-image-1024", "--tiny", "--lora", "4", "--out", str(tmp_path), "--peers",
                 "diffusers", "--steps", "2", "--warmup", "1", "--loader-workers", "0", "--kernels", KERNELS]) == 0
    (path,) = tmp_path.glob("imagegen-qwen-image-1024-lora4-*.json")
    r = json.loads(path.read_text())
    assert r["config"]["model"]["num_layers"] == 2
    assert r["lora"]["modules"] == 2 * 8  # every attention projection of both streams, in each of the 2 blocks
    for run in (r["atelier"], r["peers"]["diffusers"]):
        assert run["images_per_s"] > 0 and 0 < run["mfu"] < run["mfu_6n"]
    assert r["loss_mean_abs_diff"] < 1e-5  # fp32: two implementations of the same LoRA training


def test_tiny_flux_lora_run_asks_the_registry(tmp_path):
    """FLUX.1-dev's bench config at tiny size: Atelier's FLUX and diffusers' FluxTransformer2DModel + PEFT (called as
    FluxPipeline calls it, with dev's guidance input) on the same weights, adapters and batches, both under activation
    checkpointing (Atelier's policy on the double- and single-stream blocks, diffusers' own): the same losses."""
    assert main(["--config", "flux-dev-1024", "--tiny", "--lora", "4", "--out", str(tmp_path), "--peers", "diffusers",
                 "--steps", "2", "--warmup", "1", "--loader-workers", "0", "--kernels", KERNELS,
                 "--checkpointing", "full"]) == 0
    (path,) = tmp_path.glob("imagegen-flux-dev-1024-lora4-ac-*.json")
    r = json.loads(path.read_text())
    assert r["run"]["activation_checkpointing"] == "full"
    assert "checkpointing full" in path.with_suffix(".md").read_text()
    assert r["config"]["model"]["guidance_embeds"] and r["config"]["model"]["num_single_layers"] == 2
    # every attention projection: each double block both streams' 8, each single block its q, k, v
    assert r["lora"]["modules"] == 2 * 8 + 2 * 3
    for run in (r["atelier"], r["peers"]["diffusers"]):
        assert run["images_per_s"] > 0 and 0 < run["mfu"] < run["mfu_6n"]
    assert r["loss_mean_abs_diff"] < 1e-5  # fp32: two implementations of the same LoRA training
