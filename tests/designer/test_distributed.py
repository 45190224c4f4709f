"""The designer trainer on two processes (torchrun, gloo, CPU) against one process on the same global batch.

One torchrun launch (the `two_process_runs` fixture) trains, with 2 ranks x micro_batch 1:
  lora      LoRA, 4 steps, checkpoints at 2 and 4, activation checkpointing on, rows balanced by cost
  lora_cut  the same run stopped at step 2, then resumed with 2 processes to step 4
  full      full fine-tuning, 4 steps, async sharded checkpoints
  lora_full_init  as lora, but every rank loads the whole model before sharding (init = "full")
  qlora     LoRA over NF4 bases, sharded
  full_fp8  full fine-tuning with train.precision = "fp8" (rowwise), sharded init
  dpo_lora  DPO on preference pairs, LoRA (the reference: adapters off, a forward beside each step's)
  dpo_full  DPO, full fine-tuning (the reference precomputed: each rank its pairs, the table summed over ranks)
  dpo_full_cut  dpo_full stopped at step 2, then resumed with 2 processes (the table read back from the sharded
            checkpoint)
and the tests run the one-process twins here (1 rank x micro_batch 2: the same rows each step) and compare
losses (fp32, 1e-5), exports, and resumes of the 2-process checkpoint with 1 and with 2 processes.

Tolerances. Two processes add the same gradients in another order (each rank sums its row, then the all-reduce
adds the ranks), so a 2-process run differs from its 1-process twin by fp32 rounding, which training then
carries forward. The runs are kept short and gentle so that this stays rounding-sized on any CPU: 4 steps at lr
1e-3. Adam divides each gradient by its own running size, so a coordinate whose true gradient is ~0 (pure
rounding noise) still steps by up to lr in a noise-chosen direction, and at lr 1e-2 those steps grew to 1.6e-4
in the Qwen3.5 adapter after 4 steps; at 1e-3 the largest adapter difference is 2.5e-7. A real bug is far
outside the bounds: a missing all-reduce (each rank stepping on its own rows) moves the losses by 1e-2 and
93% of the adapter elements by more than the weight bound (up to 5.5e-3), measured on the Qwen3.5 run.
  loss        |Δ| ≤ TOL = 1e-5: the loss (~6) is a mean over the step's caption tokens; reordering its sums costs
              a few ulps (4.8e-7 measured: 1 ulp of 6.0), the bound is ~20
  grad norm   |Δ| ≤ 1e-5 · max(1, norm): ~80 fp32 ulps, for the norm of a gradient summed in another order
  weights     |Δ| ≤ 1e-5 + 1e-4 · |w|: 1% of one step's largest Adam update (lr), plus the rounding of weights
              of size |w| over 4 updates
Resumes with the same world size run the same kernels in the same order, so those are compared with the same
bounds although they are exact.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from atelier_studio.flows.cli import main

pytestmark = pytest.mark.multigpu

ROOT = Path(__file__).parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "designer" / "briefs.jsonl"
TOL = 1e-5


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("designer-dist")
    assert main(["data", "tokenizer", "--corpus", str(FIXTURE), "--vocab-size", "400", "--out", str(d / "tok")]) == 0
    assert main(["designer", "init", "--size", "tiny", "--tokenizer", str(d / "tok"), "--out", str(d / "model"),
                 "--dtype", "float32"]) == 0
    return d


def args(world: Path, out: Path, *extra: str) -> list[str]:
    """A 4-step fp32 run at lr 1e-3 (the module docstring says why); micro_batch is set per launch so that
    processes x micro_batch = 2."""
    return ["designer", "train", "--config", str(ROOT / "configs" / "designer" / "demo.toml"),
            "--set", f"model.path={world / 'model'}", "--set", f"data.train={FIXTURE}", "--set", f"data.eval={FIXTURE}",
            "--set", "data.seq_len=128", "--set", "data.max_eval_batches=0", "--set", "train.grad_accum=2",
            "--set", "train.max_steps=4", "--set", "train.save_every=2", "--set", "train.eval_every=0",
            "--set", "train.log_every=1", "--set", "train.warmup_steps=1", "--set", "train.lr=1e-3",
            "--set", "train.device=cpu", "--set", "output.tensorboard=false", "--set", f"output.dir={out}",
            "--set", "sample.briefs=0", *extra]


LORA = ("--set", "lora.rank=4")
QLORA = ("--set", "lora.base_dtype=nf4")
FULL = ("--set", "lora.rank=0")
FP8 = ("--set", "train.precision=fp8", "--set", "train.fp8_recipe=rowwise")
CAPTIONS = ("--set", "sample.briefs=3", "--set", "sample.max_new_tokens=6")  # caption samples at the final eval
PAIRS = ROOT / "tests" / "fixtures" / "designer" / "pairs.jsonl"
# DPO on the pairs, evaluated on them at the end; no NLL anchor (train.dpo.sft_weight = 0): the anchor is a mean
# over each micro-batch's chosen tokens, so 2 ranks x 1 row and 1 rank x 2 rows weigh it differently, by design
DPO = ("--set", "train.objective=dpo", "--set", f"data.train={PAIRS}", "--set", f"data.eval={PAIRS}",
       "--set", "data.seq_len=512")


def launch_two(runs: dict[str, list[str]], tmp: Path) -> str:
    """`torchrun --nproc-per-node 2` over tests/designer/dist_worker.py, which runs `runs` in order; its output."""
    spec = tmp / "runs.json"
    spec.write_text(json.dumps(runs))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "tests.designer.dist_worker", str(spec)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return proc.stdout


@pytest.fixture(scope="module")
def two(world, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("two")
    two1 = ("--set", "train.micro_batch=1")
    out = launch_two({
        "lora": args(world, d / "lora", *LORA, *two1, "--set", "train.distributed.activation_checkpointing=full",
                     *CAPTIONS),
        "lora_cut": args(world, d / "lora_cut", *LORA, *two1, "--set", "train.max_steps=2"),
        "lora_cut_resumed": args(world, d / "lora_cut", *LORA, *two1),
        "full": args(world, d / "full", *FULL, *two1, "--set", "train.distributed.async_checkpoint=true"),
        "lora_full_init": args(world, d / "lora_full_init", *LORA, *two1, "--set", "train.distributed.init=full",
                               "--set", "train.distributed.balance=false"),
        "qlora": args(world, d / "qlora", *LORA, *QLORA, *two1),
        "full_fp8": args(world, d / "full_fp8", *FULL, *FP8, *two1),
        "dpo_lora": args(world, d / "dpo_lora", *LORA, *DPO, *two1),
        "dpo_full": args(world, d / "dpo_full", *FULL, *DPO, *two1),
        "dpo_full_cut": args(world, d / "dpo_full_cut", *FULL, *DPO, *two1, "--set", "train.max_steps=2"),
        "dpo_full_cut_resumed": args(world, d / "dpo_full_cut", *FULL, *DPO, *two1),
    }, d)
    (d / "launch.log").write_text(out)
    return d


def records(out: Path, kind: str = "train") -> dict[int, dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if r["kind"] == kind}


def assert_same_losses(a: Path, b: Path, steps: range) -> None:
    """The same global batch (loss weights exactly: they count tokens) and losses and gradient norms equal up to
    rounding (bounds in the module docstring); prints the largest differences, to show the margin."""
    ra, rb = records(a), records(b)
    for s in steps:
        assert ra[s]["loss_weight"] == rb[s]["loss_weight"], f"step {s}: different global batches"
        assert abs(ra[s]["loss"] - rb[s]["loss"]) <= TOL, f"step {s}: loss {ra[s]['loss']} vs {rb[s]['loss']}"
        assert abs(ra[s]["grad_norm"] - rb[s]["grad_norm"]) <= TOL * max(1.0, ra[s]["grad_norm"]), f"step {s}"
    print(f"{a.name} vs {b.name}, steps {steps.start}-{steps.stop - 1}: largest loss difference "
          f"{max(abs(ra[s]['loss'] - rb[s]['loss']) for s in steps):.2e}, grad norm "
          f"{max(abs(ra[s]['grad_norm'] - rb[s]['grad_norm']) for s in steps):.2e} (bound {TOL:g})")


def assert_same_safetensors(a: Path, b: Path) -> None:
    """The same tensors, equal up to rounding: |Δ| ≤ TOL + 1e-4 · |w| (module docstring)."""
    ta, tb = load_file(str(a)), load_file(str(b))
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape, k
        torch.testing.assert_close(ta[k], tb[k], rtol=1e-4, atol=TOL, msg=lambda m: f"{a.name} {k}: {m}")
    worst = max(((ta[k].double() - tb[k].double()).abs().max().item(), k) for k in ta)
    print(f"{a.parent.name}/{a.name}: largest weight difference {worst[0]:.2e} ({worst[1]})")


def test_lora_two_processes_equal_one(world, two, tmp_path):
    one = tmp_path / "lora1"
    assert main(args(world, one, *LORA, "--set", "train.micro_batch=2", *CAPTIONS)) == 0
    assert_same_losses(one, two / "lora", range(1, 5))
    ev1, ev2 = records(one, "eval")[4]["loss"], records(two / "lora", "eval")[4]["loss"]
    assert abs(ev1 - ev2) <= TOL
    # the consolidated PEFT adapter from rank 0 equals the one-process export
    assert json.loads((one / "adapter" / "adapter_config.json").read_text()) == \
        json.loads((two / "lora" / "adapter" / "adapter_config.json").read_text())
    assert_same_safetensors(one / "adapter" / "adapter_model.safetensors",
                            two / "lora" / "adapter" / "adapter_model.safetensors")
    # caption samples under torchrun: both ranks decode in lockstep, rank 0 writes the table of the same briefs
    tables = [[json.loads(x) for x in (run / "samples" / "captions-step-4.jsonl").read_text().splitlines()]
              for run in (one, two / "lora")]
    assert [r["brief"] for r in tables[0]] == [r["brief"] for r in tables[1]] and len(tables[1]) == 3
    assert all(isinstance(r["caption"], str) for r in tables[1])


def test_qlora_two_processes_equal_one_with_the_nf4_bases_sharded(world, two, tmp_path):
    """QLoRA under FSDP2: each rank reads every whole weight, quantises it as one process does and keeps its rows
    (each holds half of the NF4 bytes: 14 bases of rows 128 or 64, all even); the same losses and adapter."""
    one = tmp_path / "qlora1"
    assert main(args(world, one, *LORA, *QLORA, "--set", "train.micro_batch=2")) == 0
    assert_same_losses(one, two / "qlora", range(1, 5))
    assert_same_safetensors(one / "adapter" / "adapter_model.safetensors",
                            two / "qlora" / "adapter" / "adapter_model.safetensors")
    held = [line for line in (two / "launch.log").read_text().splitlines() if "of the" in line and "NF4" in line]
    assert held, "no rank reported its NF4 bytes"
    for line in held:
        words = line.split()
        mine, total = int(words[words.index("holds") + 1].replace(",", "")), int(words[words.index("the") + 1]
                                                                                 .replace(",", ""))
        assert 2 * mine == total, line


def test_full_two_processes_equal_one(world, two, tmp_path):
    one = tmp_path / "full1"
    assert main(args(world, one, *FULL, "--set", "train.micro_batch=2")) == 0
    assert_same_losses(one, two / "full", range(1, 5))
    assert json.loads((one / "model" / "config.json").read_text()) == \
        json.loads((two / "full" / "model" / "config.json").read_text())
    assert_same_safetensors(one / "model" / "model.safetensors", two / "full" / "model" / "model.safetensors")
    # async saves were finalised: both checkpoints complete, no temporary directory left behind
    assert sorted(p.name for p in (two / "full" / "checkpoints").iterdir()) == ["step-2", "step-4"]


def test_full_fp8_two_processes_equal_one(world, two, tmp_path):
    """FP8 full fine-tuning under FSDP2 (meta-device init): each block's weights gathered whole and quantised as one
    process quantises them. The twin runs one row per micro-batch (grad_accum 4), as each rank does: the recipe's
    scales are taken over a micro-batch's tokens, so only the same micro-batches quantise the same.

    Bounds. Step 1 starts from the same weights: its loss and gradient norm are the bf16 runs' (TOL); a missing
    all-reduce shows here, in the gradient norm. From step 2 the weights differ by the rounding of the gradients'
    sums, and now and then that moves a weight across an E4M3 rounding boundary, which changes it by an eighth of
    its size in the forward: the losses then differ by more than rounding (measured 8.8e-5 and 1.1e-4 at steps 3
    and 4 on AVX-512, 2.4e-7 on DEFAULT kernels), bounded here by 1e-3, ten times under what a missing all-reduce
    does (1e-2); and each step after the first can move a weight by at most about lr = 1e-3 (Adam), so the exported
    weights differ by at most 3 lr (measured 8.2e-4)."""
    one = tmp_path / "full_fp8_1"
    assert main(args(world, one, *FULL, *FP8, "--set", "train.micro_batch=1", "--set", "train.grad_accum=4")) == 0
    assert_same_losses(one, two / "full_fp8", range(1, 2))
    ra, rb = records(one), records(two / "full_fp8")
    for step in range(2, 5):
        assert ra[step]["loss_weight"] == rb[step]["loss_weight"], f"step {step}: different global batches"
        assert abs(ra[step]["loss"] - rb[step]["loss"]) <= 1e-3, (step, ra[step]["loss"], rb[step]["loss"])
    ta = load_file(str(one / "model" / "model.safetensors"))
    tb = load_file(str(two / "full_fp8" / "model" / "model.safetensors"))
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape, k
        torch.testing.assert_close(ta[k], tb[k], rtol=0, atol=3e-3, msg=lambda m: f"{k}: {m}")
    assert "fp8 (rowwise):" in (two / "launch.log").read_text()


def test_full_init_and_unbalanced_rows_train_the_same(two):
    # the same rows per step, split differently over the ranks; the same weights, loaded whole or by shard
    assert_same_losses(two / "lora", two / "lora_full_init", range(1, 5))


def test_sharded_checkpoint_layout(two):
    ckpt = two / "lora" / "checkpoints" / "step-2"
    names = {p.name for p in ckpt.iterdir()}
    assert names == {"shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors",
                     "state.json", "rank-0.json", "rank-1.json", "manifest.json"}
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert set(manifest) == names - {"manifest.json"}
    state = json.loads((ckpt / "state.json").read_text())
    assert state["world_size"] == 2 and state["format"] == "dcp-safetensors"
    assert state["objects"]["optimizer"]["param_groups"][0]["lr"] > 0  # hyper-parameters as JSON, not pickled
    # nothing in it is a pickle (protocol 2 and later start with 0x80): safetensors (an 8-byte header length) and JSON
    assert not [n for n in names if (ckpt / n).read_bytes()[:1] == b"\x80"]


def test_resume_with_two_processes_is_exact(two):
    assert_same_losses(two / "lora", two / "lora_cut", range(1, 5))


def test_resume_two_process_checkpoint_with_one_process(world, two, tmp_path):
    out = tmp_path / "resumed1"
    shutil.copytree(two / "lora", out, ignore=shutil.ignore_patterns("step-4", "adapter"))
    assert main(args(world, out, *LORA, "--set", "train.micro_batch=2")) == 0
    assert_same_losses(two / "lora", out, range(3, 5))
    assert_same_safetensors(two / "lora" / "adapter" / "adapter_model.safetensors",
                            out / "adapter" / "adapter_model.safetensors")


def test_resume_with_another_global_batch_is_refused(world, two, tmp_path, capsys):
    out = tmp_path / "resumed-wrong"
    shutil.copytree(two / "lora", out, ignore=shutil.ignore_patterns("step-4", "adapter"))
    assert main(args(world, out, *LORA, "--set", "train.micro_batch=1")) == 2
    err = capsys.readouterr().err
    assert "global micro-batch" in err and "2 ranks x 1 rows" in err


def test_async_checkpoint_resumes_exactly_with_one_process(world, two, tmp_path):
    # written in the background while steps 3-4 ran: it must still hold the weights of step 2
    out = tmp_path / "full-resumed1"
    shutil.copytree(two / "full", out, ignore=shutil.ignore_patterns("step-4", "model"))
    assert main(args(world, out, *FULL, "--set", "train.micro_batch=2")) == 0
    assert_same_losses(two / "full", out, range(3, 5))


def assert_same_pair_metrics(a: Path, b: Path, kind: str, steps: range) -> None:
    """DPO's logged rewards and log-probabilities (means over the step's pairs, summed over ranks) equal up to
    rounding: log-probabilities are sums over a caption's tokens (|logp| ~ 100), so the bound scales with them."""
    ra, rb = records(a, kind), records(b, kind)
    for s in steps:
        for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
                     "rewards/accuracies"):
            assert abs(ra[s][name] - rb[s][name]) <= TOL * max(1.0, abs(ra[s][name])), (kind, s, name)


@pytest.mark.parametrize("run, mode", [("dpo_lora", LORA), ("dpo_full", FULL)])
def test_dpo_two_processes_equal_one(world, two, tmp_path, run, mode):
    """DPO under torchrun: the same global batch of pairs, the same losses, pair metrics and final evaluation as one
    process with the same rows per step; for full fine-tuning the reference table is computed by shards and summed
    over ranks, for LoRA the adapters-off forward runs on every rank beside the policy's."""
    one = tmp_path / f"{run}1"
    assert main(args(world, one, *mode, *DPO, "--set", "train.micro_batch=2")) == 0
    assert_same_losses(one, two / run, range(1, 5))
    assert_same_pair_metrics(one, two / run, "train", range(1, 5))
    assert_same_pair_metrics(one, two / run, "eval", range(4, 5))
    assert abs(records(one, "eval")[4]["loss"] - records(two / run, "eval")[4]["loss"]) <= TOL
    assert records(two / run)[4]["rewards/margins"] != 0  # real preference steps (step 1 of LoRA: policy = reference)


def test_dpo_precomputed_reference_resumes_from_a_sharded_checkpoint(two):
    """The full-FT reference table goes into the 2-process checkpoint once and is read back by the resumed run (which
    cannot compute it from its trained weights): the resumed steps equal the uninterrupted run's."""
    assert_same_losses(two / "dpo_full", two / "dpo_full_cut", range(1, 5))
    assert_same_pair_metrics(two / "dpo_full", two / "dpo_full_cut", "train", range(3, 5))
    log = (two / "launch.log").read_text()
    assert log.count("reference log-probabilities of") == 2  # dpo_full, dpo_full_cut; not the resumed run
