"""`[train] optimizer`: each optimizer's config keys, what it trains, and exact resume through a checkpoint.

The kill -9 tests through the CLI (tests/designer/test_train.py, tests/imagegen/test_task.py) run AdamW and one
other optimizer; every optimizer's save/resume equivalence is here, on the toy task (a few seconds each).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from atelier_studio.pipeline.config import ConfigError, OutputConfig, TrainConfig, load_config
from atelier_studio.pipeline.optimizers import build_optimizers
from atelier_studio.pipeline.trainer import Trainer, seed_everything

from tests.pipeline.toy_task import ToyTask

OPTIMIZERS = ["adamw", "adamw8bit", "adamw4bit", "adafactor", "schedulefree_adamw", "prodigy", "muon"]
# what each needs besides train.optimizer: Prodigy's lr multiplies its own estimate, schedule-free has no decay
SETTINGS = {"prodigy": {"lr": 1.0}, "schedulefree_adamw": {"schedule": "constant"}}


@dataclass(frozen=True)
class TrainConfigRoot:
    """A config with a [train] section, as both trainers' configs have."""

    train: TrainConfig = field(default_factory=TrainConfig)


def make(tmp_path, optimizer: str, name: str = "run", seed: int = 0, **train):
    seed_everything(0)
    task = ToyTask(seed=0, hidden=64)
    seed_everything(seed)
    cfg = TrainConfig(**{"max_steps": 12, "micro_batch": 1, "lr": 1e-2, "warmup_steps": 2, "save_every": 4,
                         "keep_checkpoints": 0, "weight_decay": 0.01, "optimizer": optimizer,
                         **SETTINGS.get(optimizer, {}), **train})
    return Trainer(task, cfg, OutputConfig(dir=str(tmp_path / name), tensorboard=False), torch.device("cpu")), task


def losses(tmp_path, name):
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if r["kind"] in ("train", "eval")]


class Killed(Exception):
    """Stands in for SIGKILL: the run dies between steps, without any chance to save."""


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_resume_is_exact_for_every_optimizer(tmp_path, optimizer):
    """Killed after step 9 (newest checkpoint: step 8), resumed with other global RNG state: the same losses, eval
    losses (evaluated every 3 steps: schedule-free's averaged weights go in and out between steps) and weights."""
    full, _ = make(tmp_path, optimizer, "full", eval_every=3)
    full.fit()
    part, task = make(tmp_path, optimizer, "part", eval_every=3)
    task.after_optimizer_step = lambda step: (_ for _ in ()).throw(Killed()) if step == 10 else None
    with pytest.raises(Killed):
        part.fit()
    resumed, _ = make(tmp_path, optimizer, "part", seed=123, eval_every=3)
    assert resumed.fit().step == 12
    assert losses(tmp_path, "part") == losses(tmp_path, "full")
    last_full = load_file(tmp_path / "full" / "checkpoints" / "step-12" / "model.safetensors")
    last_part = load_file(tmp_path / "part" / "checkpoints" / "step-12" / "model.safetensors")
    assert all(torch.equal(last_full[k], last_part[k]) for k in last_full)
    first = [loss for s, loss in losses(tmp_path, "full")[:3]]
    assert len(set(first)) == 3, "the optimizer did not move the weights"


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_the_checkpoint_holds_the_optimizer_state(tmp_path, optimizer):
    """Every state tensor of every parameter is in the checkpoint, and loads back equal (torchao's low-bit states
    as their codes, scales and maps)."""
    trainer, _ = make(tmp_path, optimizer, max_steps=3, save_every=0)
    trainer.fit()
    other, _ = make(tmp_path, optimizer, "other", max_steps=3)
    other.load(tmp_path / "run" / "checkpoints" / "step-3")
    for a, b in zip(trainer.optimizer.parts, other.optimizer.parts):
        assert len(a.state) == len(b.state) > 0
        params_a = [p for g in a.param_groups for p in g["params"]]
        params_b = [q for g in b.param_groups for q in g["params"]]
        for p, q in zip(params_a, params_b):
            assert a.state[p].keys() == b.state[q].keys()
            for k, v in a.state[p].items():
                w = b.state[q][k]
                assert type(v) is type(w), (optimizer, k)
                if torch.is_tensor(v) and hasattr(v, "codes"):  # torchao's packed states
                    assert all(torch.equal(getattr(v, i), getattr(w, i)) for i in ("codes", "scale", "qmap")), k
                elif torch.is_tensor(v):
                    assert torch.equal(v, w), k
                else:
                    assert v == w, k


def test_lowbit_states_are_packed():
    """torchao's AdamW8bit keeps the hidden 64x64 weight's moments in 8 bits (its codes are uint8)."""
    task = ToyTask(hidden=64)
    params = [(n, p) for n, p in task.model.named_parameters()]
    opt = build_optimizers(params, TrainConfig(optimizer="adamw8bit"), torch.device("cpu"))
    task.loss_sum(next(task.loader)).backward()
    opt.step()
    state = opt.parts[0].state[task.model[3].weight]
    assert type(state["exp_avg"]).__name__ == "OptimState8bit" and state["exp_avg"].codes.dtype == torch.uint8


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    task = ToyTask(hidden=64)
    params = list(task.model.named_parameters())
    opt = build_optimizers(params, TrainConfig(optimizer="muon"), torch.device("cpu"), task.outer_layers)
    muon, adamw = opt.parts
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    assert [p for g in muon.param_groups for p in g["params"]] == [task.model[3].weight]
    rest = {id(p) for g in adamw.param_groups for p in g["params"]}
    assert rest == {id(p) for n, p in params if n != "3.weight"}


def test_designer_and_imagegen_name_their_embeddings_and_heads():
    from atelier_studio.designer.qwen3 import Qwen3, Qwen3Args
    from atelier_studio.designer.task import DesignerTask
    from atelier_studio.imagegen.model import MMDiT, MMDiTArgs
    from atelier_studio.imagegen.task import ImagegenTask

    lm = Qwen3(Qwen3Args(vocab_size=97, dim=48, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=12, ffn_dim=80))
    dit = MMDiT(MMDiTArgs(caption_projection_dim=64, num_layers=1))
    for model, outer, want_outer in [
        (lm, DesignerTask.outer_layers, {"model.embed_tokens.weight", "lm_head.weight"}),
        (dit, ImagegenTask.outer_layers, {"time_text_embed.timestep_embedder.linear_1.weight",
                                          "time_text_embed.timestep_embedder.linear_2.weight",
                                          "time_text_embed.text_embedder.linear_1.weight",
                                          "time_text_embed.text_embedder.linear_2.weight",
                                          "context_embedder.weight", "proj_out.weight"}),
    ]:
        params = list(model.named_parameters())
        opt = build_optimizers(params, TrainConfig(optimizer="muon"), torch.device("cpu"), outer)
        in_muon = {id(p) for g in opt.parts[0].param_groups for p in g["params"]}
        matrices = {n for n, p in params if p.ndim == 2}
        assert {n for n, p in params if id(p) in in_muon} == matrices - want_outer


def test_schedulefree_evaluates_the_averaged_weights(tmp_path):
    """Evaluation sees x = the average (not the y the gradient is taken at), and y comes back bit for bit."""
    trainer, task = make(tmp_path, "schedulefree_adamw", max_steps=4, save_every=0, eval_every=2)
    w = task.model[3].weight
    seen: dict[str, list] = {"eval": [], "mode": [], "y": []}
    evaluate, outer = task.evaluate, trainer._evaluate

    def spy():
        seen["eval"].append(w.detach().clone())
        seen["mode"].append(trainer.optimizer.parts[0].param_groups[0]["train_mode"])
        return evaluate()

    def around(run):
        before = w.detach().clone()
        outer(run)
        seen["y"].append(torch.equal(w, before))

    task.evaluate, trainer._evaluate = spy, around
    trainer.fit()
    assert seen["mode"] == [False, False] and seen["y"] == [True, True]
    opt = trainer.optimizer.parts[0]
    x = w.detach().lerp(opt.state[w]["z"], 1 - 1 / opt.param_groups[0]["betas"][0])  # schedulefree's eval()
    assert not torch.equal(x, w)
    assert torch.equal(seen["eval"][-1], x)  # the last evaluation is of step 4, the weights and z the run ended with


@pytest.mark.parametrize("keys, message", [
    ({"muon": {"momentun": 0.9}},
     r"train\.muon\.momentun: unknown key, did you mean train\.muon\.momentum\?; allowed keys in \[train\.muon\]"),
    ({"optimizer": "adamw", "muon": {"momentum": 0.9}}, r"muon\.momentum configure optimizer 'muon', but "
                                                        r"train\.optimizer = 'adamw'"),
    ({"optimizer": "adamw8bit", "adafactor": {"d": 2.0}}, r"adafactor\.d configure optimizer 'adafactor'"),
    ({"optimizer": "schedulefree_adamw"}, r"set train\.schedule = \"constant\""),
    ({"optimizer": "prodigy", "lr": 1e-4}, r"train\.lr: 0\.0001 multiplies the step size Prodigy"),
    ({"optimizer": "lion"}, r"train\.optimizer: must be one of 'adamw', 'adamw8bit'"),
    ({"optimizer": "adamw4bit", "lowbit": {"block_size": -1}}, r"train\.lowbit\.block_size: must be >= 0"),
])
def test_bad_optimizer_keys_are_named(tmp_path, keys, message):
    def toml(d, prefix=""):
        lines = [f"{k} = {json.dumps(v)}" for k, v in d.items() if not isinstance(v, dict)]
        for k, v in d.items():
            if isinstance(v, dict):
                lines += [f"[{prefix}{k}]", *toml(v, f"{prefix}{k}.")]
        return lines

    path = tmp_path / "c.toml"
    path.write_text("\n".join(["[train]", *toml(keys, "train.")]) + "\n")
    with pytest.raises(ConfigError, match=message):
        load_config(TrainConfigRoot, path)


def test_optimizer_keys_by_override():
    cfg = load_config(TrainConfigRoot, None, ["train.optimizer=muon", "train.muon.ns_steps=3",
                                              "train.muon.adjust_lr=original"])
    assert cfg.train.optimizer == "muon" and cfg.train.muon.ns_steps == 3



# FSDP2 over 2 processes (gloo): the optimizers whose state is more than AdamW's plain tensors, one of each kind — two
# optimizers stepped as one (muon), weights swapped around evaluation (schedule-free), tensor-subclass states
# (torchao's 8-bit; 4-bit is the same code path), and the two that step the shards with Atelier's own code
# (adafactor: row-sharded and replicated factors; prodigy: sums over the ranks, int state). AdamW's sharded resume
# is tests/designer/test_distributed.py's.
SHARDED = ["muon", "schedulefree_adamw", "adamw8bit", "adafactor", "prodigy"]
PARITY = ["adafactor", "prodigy"]  # also compared with the library's optimizer on whole tensors (optim_dist_worker)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("optimizers-two")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "tests.pipeline.optim_dist_worker", str(out), *SHARDED]
    # torchao's low-bit step runs eager here (TORCHDYNAMO_DISABLE makes its torch.compile a no-op): what this test
    # checks is the sharded state and its resume, the same eager or compiled. Compiled, on two gloo ranks of a
    # loaded 2-core machine, rank 1 died twice with SIGSEGV inside the compiled Inductor C++ kernel of
    # torchao's single_param_adam during full-suite runs (never when the worker ran alone); one process compiles it
    # in tests/designer/test_optimizers.py and tests/imagegen/test_optimizers.py. PYTHONFAULTHANDLER: a native
    # crash in a rank prints its Python stack into the assertion's output.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1",
           "TORCHDYNAMO_DISABLE": "1"}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return out


@pytest.mark.multigpu
@pytest.mark.parametrize("optimizer", SHARDED)
def test_two_process_resume_is_exact(two, optimizer):
    """Killed after step 9, resumed from the sharded step-8 checkpoint: the same losses and evaluations."""
    full, cut = losses(two / optimizer, "full"), losses(two / optimizer, "cut")
    assert len(full) == 16 and cut == full


@pytest.mark.multigpu
@pytest.mark.parametrize("optimizer", PARITY)
def test_two_process_shards_step_as_whole_tensors(two, optimizer):
    """Sharded over the 2 ranks (uneven rows, an empty shard, 3 dims), 6 steps equal the library's own optimizer on
    the whole tensors: every weight, state tensor and Prodigy's step size. Not bit for bit: a sum over two shards
    rounds differently from one over the whole tensor, about an ulp per sum (seen: under one fp32 eps times each
    tensor's largest value after 6 steps); the tolerance allows 16."""
    saved = load_file(two / optimizer / "parity.safetensors")
    whole = sorted(k for k in saved if k.startswith("whole/"))
    assert [k.replace("whole/", "sharded/") for k in whole] == sorted(k for k in saved if k.startswith("sharded/"))
    eps = torch.finfo(torch.float32).eps  # the optimizers compute in fp32 (the scalars' fp64 sums start from fp32)
    for key in whole:
        want, got = saved[key], saved[key.replace("whole/", "sharded/")]
        tol = 16 * eps * float(want.abs().max()) if want.numel() else 0.0
        err = float((got - want).abs().max()) if want.numel() else 0.0
        assert got.shape == want.shape and err <= tol, f"{key}: max error {err:.3g} > {tol:.3g}"
        if key.endswith(".weight"):  # the comparison is of weights the optimizer moved, by far more than tol
            assert float((want - saved[key.replace("whole/", "init/")]).abs().max()) > 100 * tol, key


@pytest.mark.multigpu
@pytest.mark.parametrize("optimizer", SHARDED)
def test_a_two_process_checkpoint_resumes_on_one_process(two, tmp_path, optimizer):
    """The sharded step-8 checkpoint of 2 ranks loads into the one-process optimizer (every state in a shape it
    takes) and the run goes on to step 12. Not compared with the 2 ranks' losses: each rank read its own data."""
    shutil.copytree(two / optimizer / "full" / "checkpoints" / "step-8", tmp_path / "run" / "checkpoints" / "step-8")
    resumed, _ = make(tmp_path, optimizer, eval_every=3)
    assert resumed.fit().step == 12
    after = losses(tmp_path, "run")
    assert [step for step, _ in after] == [9, 9, 10, 11, 12, 12] and all(math.isfinite(loss) for _, loss in after)
