"""The designer trainer end to end through the CLI: outputs, SIGKILL + exact resume (bad input: test_bad_input.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from atelier_studio.flows.cli import main

ROOT = Path(__file__).parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "designer" / "briefs.jsonl"


def train_args(world: Path, out: Path, *extra: str) -> list[str]:
    """The demo config on the fixture world; warmup 1 step, so that runs of any length are valid."""
    return ["designer", "train", "--config", str(ROOT / "configs" / "designer" / "demo.toml"),
            "--set", f"model.path={world / 'model'}", "--set", f"data.train={FIXTURE}", "--set", f"data.eval={FIXTURE}",
            "--set", "data.seq_len=128", "--set", "train.micro_batch=2", "--set", "train.log_every=1",
            "--set", "train.warmup_steps=1", "--set", "output.tensorboard=false", "--set", f"output.dir={out}", *extra]


def train_losses(out: Path) -> list[tuple[int, float]]:
    records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]


def test_lora_run_writes_every_output(world, tmp_path):
    out = tmp_path / "run"
    code = main(train_args(world, out, "--set", "lora.rank=4", "--set", "train.max_steps=6", "--set",
                           "train.save_every=3", "--set", "train.eval_every=3", "--set", "output.tensorboard=true"))
    assert code == 0
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert (out / "config.toml").is_file() and (out / "summary.json").is_file()
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == ["step-3", "step-6"]
    assert any((out / "tensorboard").iterdir())
    records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [3, 6]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["step"] == 6 and summary["units_per_s"] > 0


def test_full_finetune_learns_and_exports_hf_model(world, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "full"
    assert main(train_args(world, out, "--set", "lora.rank=0", "--set", "train.max_steps=30",
                           "--set", "train.lr=3e-3", "--set", "train.warmup_steps=3")) == 0
    losses = [l for _, l in train_losses(out)]
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5  # it learns
    hf = AutoModelForCausalLM.from_pretrained(out / "model", local_files_only=True, torch_dtype=torch.float32)
    assert hf.config.model_type == "qwen3"


def _spawn(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "atelier_studio.flows.cli", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_sigkill_then_resume_is_exact(world, tmp_path):
    """Kill -9 a training process after a checkpoint; the resumed run's losses equal the uninterrupted run's."""
    common = ["--set", "lora.rank=4", "--set", "lora.dropout=0.1", "--set", "train.max_steps=40",
              "--set", "train.save_every=8", "--set", "train.eval_every=0", "--set", "train.lr=1e-3"]
    ref = tmp_path / "ref"
    assert main(train_args(world, ref, *common)) == 0

    out = tmp_path / "killed"
    proc = _spawn(train_args(world, out, *common))
    deadline = time.time() + 120
    while not (out / "checkpoints" / "step-16").is_dir():
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = max(s for s, _ in train_losses(out))
    assert killed_at < 40, "the run finished before it could be killed"

    assert main(train_args(world, out, *common)) == 0
    assert train_losses(out) == train_losses(ref)


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(world, tmp_path):
    out = tmp_path / "term"
    proc = _spawn(train_args(world, out, "--set", "lora.rank=4", "--set", "train.max_steps=100000",
                             "--set", "train.save_every=0"))
    deadline = time.time() + 120
    while not (out / "metrics.jsonl").is_file() or len(train_losses(out)) < 3:
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, output
    assert "Traceback" not in output
    saved = sorted((out / "checkpoints").iterdir())
    assert len(saved) == 1 and saved[0].name.startswith("step-")
    assert not (out / "adapter").exists()  # an interrupted run exports nothing


def test_selective_checkpointing_and_cpu_offload_train_exactly_like_plain(world, tmp_path):
    """The long-sequence options of `[train.distributed]` change memory, not numbers: the same losses (fp32)."""
    common = ["--set", "lora.rank=4", "--set", "train.max_steps=4", "--set", "train.save_every=0",
              "--set", "train.eval_every=0", "--set", "model.dtype=float32"]
    runs = {}
    for name, extra in {"plain": [], "saved": ["--set", "train.distributed.activation_checkpointing=selective",
                                               "--set", "train.distributed.cpu_offload=true"]}.items():
        assert main(train_args(world, tmp_path / name, *common, *extra)) == 0
        runs[name] = train_losses(tmp_path / name)
    assert len(runs["plain"]) == 4
    for (s1, l1), (s2, l2) in zip(runs["plain"], runs["saved"]):
        assert s1 == s2 and abs(l1 - l2) <= 1e-6 * max(1.0, abs(l1)), (runs["plain"], runs["saved"])


def test_compiled_training_matches_plain_and_compiles_only_at_the_start(world, tmp_path):
    """`[train.distributed] compile = true`: the eager losses, and every batch after the first reuses what was
    compiled although each packs different documents (data.packing.compile_shape buckets the segment count;
    a recompile per batch): a 6-step run compiles no more graphs than a 1-step run."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    common = ["--set", "lora.rank=4", "--set", "train.save_every=0", "--set", "train.eval_every=0",
              "--set", "model.dtype=float32"]
    compiled = ["--set", "train.distributed.compile=true"]
    assert main(train_args(world, tmp_path / "plain", *common, "--set", "train.max_steps=6")) == 0
    graphs = {}
    for steps in (1, 6):
        torch._dynamo.reset()
        counters.clear()
        out = tmp_path / f"compiled-{steps}"
        assert main(train_args(world, out, *common, *compiled, "--set", f"train.max_steps={steps}")) == 0
        graphs[steps] = counters["stats"]["unique_graphs"]
    assert graphs[1] > 0 and graphs[6] == graphs[1], graphs
    plain, comp = train_losses(tmp_path / "plain"), train_losses(tmp_path / "compiled-6")
    assert [s for s, _ in plain] == [s for s, _ in comp] == list(range(1, 7))
    for (_, l1), (_, l2) in zip(plain, comp):
        assert abs(l1 - l2) <= 1e-4 * max(1.0, abs(l1)), (plain, comp)
