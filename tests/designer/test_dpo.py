"""train.objective = "dpo": loss and gradients equal TRL's DPOTrainer (LoRA, full FT; sigmoid, ipo) on the same tiny
Qwen3 and pairs; packed pairs equal each document alone; adapters off is the base; the reference pass counts in
MFU; kill -9 + resume is exact (LoRA beside the step, full FT precomputed); bad pair data is one line."""

from __future__ import annotations

import json
import math
import signal
from pathlib import Path

import pytest
import torch

from atelier_studio.data.chat import encode_pair
from atelier_studio.data.packing import make_batch
from atelier_studio.designer.config import DesignerConfig
from atelier_studio.designer.dpo import doc_sums, token_logps
from atelier_studio.designer.lora import adapters_disabled, save_peft_adapter
from atelier_studio.designer.preference import PreferenceTask
from atelier_studio.flows.cli import main
from atelier_studio.pipeline.config import ConfigError, load_config

from .test_train import _spawn, train_args, train_losses

ROOT = Path(__file__).parents[2]
PAIRS = ROOT / "tests" / "fixtures" / "designer" / "pairs.jsonl"
EPS = torch.finfo(torch.float32).eps


def dpo_config(world: Path, out: Path, data: Path, *extra: str) -> DesignerConfig:
    return load_config(DesignerConfig, ROOT / "configs" / "designer" / "demo.toml",
                       [f"model.path={world / 'model'}", f"data.train={data}", "data.eval=", "data.seq_len=512",
                        "train.micro_batch=1", "train.objective=dpo", f"output.dir={out}", "sample.briefs=0", *extra])


def _first_pairs(tmp_path: Path, n: int) -> Path:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(PAIRS.read_text().splitlines(keepends=True)[:n]))
    return path


def _trl_trainer(policy, ref_model, tokenizer, beta: float, loss_type: str, sft_weight: float, out: Path):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    losses = {"loss_type": [loss_type, "sft"], "loss_weights": [1.0, sft_weight]} if sft_weight else \
        {"loss_type": [loss_type]}
    args = DPOConfig(output_dir=str(out), beta=beta, **losses, report_to=[], use_cpu=True, bf16=False,
                     per_device_train_batch_size=8, dataset_num_proc=None, logging_steps=1)
    dummy = Dataset.from_list([{"prompt": "a", "chosen": " b", "rejected": " c"}])  # the inputs are given below
    return DPOTrainer(model=policy, ref_model=ref_model, args=args, train_dataset=dummy, processing_class=tokenizer)


def _trl_inputs(task: PreferenceTask) -> dict:
    """TRL's collated batch of the task's pairs, from the task's own token ids: prompt, then the caption tokens."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    rows = []
    for chosen, rejected in (encode_pair(task.tokenizer, p) for p in task._train_pairs):
        first = chosen.loss_mask.index(True)
        answer = lambda d: [t for t, m in zip(d.input_ids, d.loss_mask) if m]  # noqa: E731
        rows.append({"prompt_ids": chosen.input_ids[:first], "chosen_ids": answer(chosen),
                     "rejected_ids": answer(rejected)})
    return DataCollatorForPreference(pad_token_id=task.tokenizer.pad_token_id or 0)(rows)


@pytest.mark.parametrize("mode,loss_type,sft_weight", [("lora", "sigmoid", 0.0), ("lora", "ipo", 0.0),
                                                       ("full", "sigmoid", 0.0), ("lora-init", "sigmoid", 0.0),
                                                       ("lora", "sigmoid", 0.7), ("full", "ipo", 0.7)])
def test_loss_and_gradients_equal_trl(world, tmp_path, mode, loss_type, sft_weight):
    """The same 4 pairs in one micro-batch: Atelier's packed rows vs TRL's padded batch, fp32, the policy moved off
    the reference first: fresh LoRA adapters (reference: adapters off) with B random; full FT (reference: the pass
    before training) with every weight nudged after it; LoRA from lora.init_adapter (reference: the loaded adapter,
    TRL's "ref" copy and Atelier's pass before training) with the adapters nudged after it. sft_weight w: TRL's
    loss_type [type, "sft"] with loss_weights [1, w]."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    beta = 0.3
    data = _first_pairs(tmp_path, 4)
    settings = (f"lora.rank={0 if mode == 'full' else 4}", f"train.dpo.beta={beta}", f"train.dpo.loss_type={loss_type}",
                f"train.dpo.sft_weight={sft_weight}")
    gen = torch.Generator().manual_seed(0)

    def randomise_b(model) -> None:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)

    init = ()
    if mode == "lora-init":  # an adapter trained before: random B, saved, loaded by both
        first = PreferenceTask(dpo_config(world, tmp_path / "first", data, *settings), torch.device("cpu"))
        randomise_b(first.model)
        save_peft_adapter(first.model, first.lora_args, tmp_path / "init", base_model_path=str(world / "model"))
        init = (f"lora.init_adapter={tmp_path / 'init'}",)
    task = PreferenceTask(dpo_config(world, tmp_path / "run", data, *settings, *init), torch.device("cpu"))
    assert task.reference == ("adapters off" if mode == "lora" else "precomputed")
    hf = AutoModelForCausalLM.from_pretrained(world / "model", torch_dtype=torch.float32)
    ref_model = None
    if mode == "lora":
        randomise_b(task.model)
        save_peft_adapter(task.model, task.lora_args, tmp_path / "adapter", base_model_path=str(world / "model"))
        policy = PeftModel.from_pretrained(hf, tmp_path / "adapter", is_trainable=True)
    elif mode == "lora-init":
        policy = PeftModel.from_pretrained(hf, tmp_path / "init", is_trainable=True)
    else:
        policy, ref_model = hf, AutoModelForCausalLM.from_pretrained(world / "model", torch_dtype=torch.float32)
    trainer = _trl_trainer(policy, ref_model, task.tokenizer, beta, loss_type, sft_weight, tmp_path / "trl")
    if mode == "lora":
        # TRL keeps a loaded adapter's copy as its reference ("ref", Atelier's choice too, for lora.init_adapter); this
        # run's adapters are fresh ones moved off zero to make the test non-trivial, whose reference is the base:
        # TRL's reference without the copy (its adapters disabled)
        assert "ref" in policy.peft_config
        policy.delete_adapter("ref")
        policy.set_adapter("default")
    strip = (lambda n: n.replace("base_model.model.", "").replace(".default", "")) if mode != "full" else (lambda n: n)
    if mode in ("full", "lora-init"):  # the reference as it is now; then the same nudge of every trainable weight
        iter(task.train_batches())
        with torch.no_grad():
            theirs_params = {strip(n): p for n, p in policy.named_parameters() if p.requires_grad}
            for n, p in task.model.named_parameters():
                if p.requires_grad:
                    noise = torch.randn(p.shape, generator=gen) * 0.01
                    p.add_(noise)
                    theirs_params[n].add_(noise)
    loader = task.train_loader
    batch = task._to_device(make_batch(loader.packed, list(range(len(loader.packed)))))
    assert batch.num_pairs == 4
    ours = task.loss_sum(batch) / batch.num_pairs
    ours.backward()
    theirs = trainer.compute_loss(trainer.model, _trl_inputs(task))
    theirs.backward()
    assert abs(ours.item() - math.log(2)) > 1e-3  # the policy is not the reference

    # fp32 throughout; the two sum the same products in other orders (packed rows vs padded rows, chunked head)
    tol = 64 * EPS
    assert math.isclose(ours.item(), theirs.item(), rel_tol=tol * 10, abs_tol=tol), (ours.item(), theirs.item())
    theirs_grads = {strip(n): p.grad for n, p in policy.named_parameters() if p.requires_grad}
    ours_grads = {n: p.grad for n, p in task.model.named_parameters() if p.requires_grad}
    assert set(ours_grads) == set(theirs_grads)
    for n, g in ours_grads.items():
        scale = theirs_grads[n].abs().max().item() + EPS
        err = (g - theirs_grads[n]).abs().max().item()
        assert err <= 1e-4 * scale, f"{n}: max |Δgrad| {err:.3g} vs max |grad| {scale:.3g}"
    assert any(g.abs().max() > 0 for g in ours_grads.values())


def test_packed_pairs_equal_each_document_alone_and_adapters_off_is_the_base(world, tmp_path):
    """Per-document log-probabilities of a packed batch equal each document run alone (exact attention); with the
    adapters off, the LoRA model's equal the base model's."""
    cfg = dpo_config(world, tmp_path / "run", _first_pairs(tmp_path, 6), "lora.rank=4")
    task = PreferenceTask(cfg, torch.device("cpu"))
    with torch.no_grad():
        for n, p in task.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    task.model.eval()
    loader = task.train_loader
    batch = make_batch(loader.packed, list(range(len(loader.packed))))
    assert max(len(ids) for ids in loader.packed.doc_ids) >= 4  # several pairs share a row
    pb = task._to_device(batch)
    with torch.no_grad():
        packed = task._doc_logps(pb)
        with adapters_disabled(task.model):
            packed_off = task._doc_logps(pb)
        docs = [d for pair in task._train_pairs for d in encode_pair(task.tokenizer, pair)]
        for k, d in enumerate(batch.doc_ids):
            ids = torch.tensor([docs[d].input_ids])
            mask = torch.tensor(docs[d].loss_mask[1:])
            n = ids.shape[1]
            hidden = task.model(ids, torch.arange(n)[None], torch.tensor([0, n], dtype=torch.int32), n)[0, :-1]
            alone = token_logps(hidden[mask], task.model.lm_head_weight, ids[0, 1:][mask]).sum()
            torch.testing.assert_close(packed[k], alone, rtol=64 * EPS, atol=64 * EPS * abs(float(alone)))
    assert not torch.allclose(packed, packed_off)  # the adapters do something
    base = PreferenceTask(dpo_config(world, tmp_path / "base", _first_pairs(tmp_path, 6), "lora.rank=0"),
                          torch.device("cpu"))
    base.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(packed_off, base._doc_logps(base._to_device(batch)), rtol=0, atol=0)


def test_an_all_padding_batch_runs_its_forward_and_holds_no_pair(world, tmp_path):
    """The last evaluation / reference batch a rank gets under torchrun can be all padding; the rank still runs the
    forward (FSDP's collectives), and it gives no pair, no loss and no metric."""
    cfg = dpo_config(world, tmp_path / "run", _first_pairs(tmp_path, 4), "lora.rank=4")
    task = PreferenceTask(cfg, torch.device("cpu"))
    pb = task._to_device(make_batch(task.train_loader.packed, [-1]))
    assert pb.num_pairs == 0 and pb.chosen.dtype == torch.long
    calls = []
    hook = task.model.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        terms = task._terms(pb, "train")
    hook.remove()
    assert len(calls) == 2  # the reference (adapters off) and the policy
    assert terms.losses.shape == (0,) and float(terms.losses.sum()) == 0.0


def test_doc_sums_and_token_logps_match_the_logits():
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(7, 5, generator=g, requires_grad=True), torch.randn(11, 5, generator=g)
    y = torch.randint(0, 11, (7,), generator=g)
    got = token_logps(h, w, y, chunk=3)
    want = torch.log_softmax(h @ w.t(), dim=1).gather(1, y[:, None]).squeeze(1)
    torch.testing.assert_close(got, want)
    sums = doc_sums(got, torch.tensor([0, 0, 1, 2, 2, 2, 1]), 3)
    torch.testing.assert_close(sums, torch.stack([want[:2].sum(), want[[2, 6]].sum(), want[3:6].sum()]))
    sums.sum().backward()
    assert h.grad is not None and h.grad.abs().sum() > 0


def test_mfu_counts_the_reference_pass(world, tmp_path):
    """LoRA: a step's FLOPs are the policy's forward + backward plus one reference forward; full FT: only the
    policy's (its reference ran once, before training)."""
    data = _first_pairs(tmp_path, 4)
    lora = PreferenceTask(dpo_config(world, tmp_path / "a", data, "lora.rank=4"), torch.device("cpu"))
    batch = lora._to_device(make_batch(lora.train_loader.packed, [0]))
    b = batch.batch
    train = lora.family.train_flops(lora.model, b.doc_lens, b.num_loss_tokens)
    forward = lora.model.forward_flops(b.doc_lens, b.num_loss_tokens)
    assert 0 < forward < train
    assert lora.batch_flops(batch) == train + forward
    full = PreferenceTask(dpo_config(world, tmp_path / "b", data, "lora.rank=0"), torch.device("cpu"))
    fb = full._to_device(make_batch(full.train_loader.packed, [0]))
    # full FT: every weight trains, so a forward is a third of a training step's matmul and attention FLOPs
    assert full.batch_flops(fb) == full.family.train_flops(full.model, fb.batch.doc_lens, fb.batch.num_loss_tokens)
    assert full.model.forward_flops(fb.batch.doc_lens, fb.batch.num_loss_tokens) * 3 == full.batch_flops(fb)


def test_dry_run_packs_pairs_and_counts_the_reference(world, tmp_path):
    """`--dry-run` reads pair data as the run does (pairs side by side in rows) and adds LoRA's reference forward."""
    from atelier_studio.designer.dry_run import designer_plan

    data = _first_pairs(tmp_path, 4)
    plan = designer_plan(dpo_config(world, tmp_path / "plan", data, "lora.rank=4"))
    assert "8 documents" in plan.dataset
    task = PreferenceTask(dpo_config(world, tmp_path / "t", data, "lora.rank=4"), torch.device("cpu"))
    assert plan.flops_per_step == task.batch_flops(task._to_device(make_batch(task.train_loader.packed, [0])))


def dpo_args(world: Path, out: Path, *extra: str) -> list[str]:
    return train_args(world, out, "--set", f"data.train={PAIRS}", "--set", f"data.eval={PAIRS}",
                      "--set", "data.seq_len=256", "--set", "train.objective=dpo", "--set", "sample.briefs=0", *extra)


@pytest.mark.parametrize("rank", [4, 0], ids=["lora", "full"])
def test_sigkill_then_resume_is_exact(world, tmp_path, rank):
    """Kill -9 after a checkpoint; the resumed run's losses and metrics equal the uninterrupted run's (full FT: the
    reference table comes back from the checkpoint, not from the trained weights)."""
    common = ["--set", f"lora.rank={rank}", "--set", "train.max_steps=12", "--set", "train.save_every=4",
              "--set", "train.eval_every=0", "--set", "train.lr=1e-3", "--set", "train.dpo.beta=0.5"]
    ref = tmp_path / "ref"
    assert main(dpo_args(world, ref, *common)) == 0
    out = tmp_path / "killed"
    proc = _spawn(dpo_args(world, out, *common))
    import time

    deadline = time.time() + 300
    while not (out / "checkpoints" / "step-8").is_dir():
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert max(s for s, _ in train_losses(out)) < 12, "the run finished before it could be killed"
    assert main(dpo_args(world, out, *common)) == 0

    def records(run: Path) -> dict[int, dict]:
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        keys = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                "logps/chosen", "logps/rejected")
        return {r["step"]: {k: r[k] for k in keys} for r in rows if r["kind"] == "train"}

    assert records(out) == records(ref)
    assert 0 < records(ref)[12]["rewards/accuracies"] <= 1


BAD = [
    ({"brief": "a calm circle", "chosen": "a small blue circle"}, "missing field 'rejected'"),
    ({"brief": "a calm circle", "chosen": "", "rejected": "a red square"}, "chosen is empty"),
    ({"brief": "a calm circle", "chosen": "a blue circle", "rejected": "a blue circle"}, "chosen and rejected are the "
                                                                                          "same text"),
    ({"prompt": "a calm circle", "chosen": "a blue circle", "rejected": 3}, "rejected must be a string"),
]


@pytest.mark.parametrize("record,message", BAD, ids=["missing", "empty", "identical", "not-text"])
def test_bad_pairs_are_one_line_naming_file_and_line(world, tmp_path, capsys, record, message):
    good = json.loads(PAIRS.read_text().splitlines()[0])
    if "prompt" in record:
        good = {"prompt": good["brief"], "chosen": good["chosen"], "rejected": good["rejected"]}
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n")
    code = main(train_args(world, tmp_path / "out", "--set", f"data.train={data}", "--set", "data.eval=",
                           "--set", "data.seq_len=256", "--set", "train.objective=dpo"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith(f"atelier: error: {data}:2: ") and message in err[0], err


def test_what_dpo_does_not_do_yet_is_refused_by_key():
    with pytest.raises(ConfigError, match=r'model\.router_aux_loss = "on" with train\.objective = "dpo"'):
        load_config(DesignerConfig, None, ["model.path=m", "data.train=d", "train.objective=dpo",
                                           "model.router_aux_loss=on"])
    with pytest.raises(ConfigError, match=r'data\.format = "brief_pair" holds preference pairs'):
        load_config(DesignerConfig, None, ["model.path=m", "data.train=d", "data.format=brief_pair"])


def test_sft_data_under_dpo_and_pairs_under_sft_are_refused(world, tmp_path, capsys):
    briefs = ROOT / "tests" / "fixtures" / "designer" / "briefs.jsonl"
    assert main(train_args(world, tmp_path / "a", "--set", f"data.train={briefs}", "--set", "data.eval=",
                           "--set", "train.objective=dpo")) == 2
    assert "learns from preference pairs" in capsys.readouterr().err
    assert main(train_args(world, tmp_path / "b", "--set", f"data.train={PAIRS}", "--set", "data.eval=")) == 2
    assert 'set train.objective = "dpo"' in capsys.readouterr().err


def test_qlora_reference_is_the_nf4_base_and_resume_is_exact(world, tmp_path):
    """QLoRA: adapters off is the NF4 base exactly (the same model with its adapters zeroed); a run stopped at a
    checkpoint and resumed gives one uninterrupted run's losses, the first of them log 2 (policy = reference)."""
    task = PreferenceTask(dpo_config(world, tmp_path / "t", _first_pairs(tmp_path, 4), "lora.rank=4",
                                     "lora.base_dtype=nf4"), torch.device("cpu"))
    batch = task._to_device(make_batch(task.train_loader.packed, [0, 1]))
    task.model.eval()
    with torch.no_grad():
        for n, p in task.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
        moved = task._doc_logps(batch)
        with adapters_disabled(task.model):
            off = task._doc_logps(batch)
        for n, p in task.model.named_parameters():
            if "lora_B" in n:
                p.zero_()
        torch.testing.assert_close(off, task._doc_logps(batch), rtol=0, atol=0)
    assert not torch.allclose(moved, off)

    args = ("--set", "lora.rank=4", "--set", "lora.base_dtype=nf4", "--set", "train.schedule=constant",
            "--set", "train.warmup_steps=0", "--set", "train.save_every=2", "--set", "train.lr=1e-3")
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(dpo_args(world, straight, *args, "--set", "train.max_steps=4")) == 0
    assert main(dpo_args(world, split, *args, "--set", "train.max_steps=2")) == 0
    assert main(dpo_args(world, split, *args, "--set", "train.max_steps=4")) == 0
    assert train_losses(split) == train_losses(straight)
    assert math.isclose(train_losses(straight)[0][1], math.log(2), rel_tol=16 * EPS)


def test_the_loss_is_the_mean_over_the_accumulated_batchs_pairs(world, tmp_path):
    """Rows of 1 and 2 pairs: 2 micro-batches of 1 row give the step 2 rows in one micro-batch gives (the pair is the
    loss unit, a row holding 2 pairs weighs twice), to fp32 rounding."""
    data = _first_pairs(tmp_path, 11)  # 5 rows of 2 pairs and one of 1 in rows of 300 tokens
    common = ("--set", f"data.train={data}", "--set", "data.eval=", "--set", "data.seq_len=300",
              "--set", "train.objective=dpo", "--set", "sample.briefs=0", "--set", "lora.rank=4",
              "--set", "train.max_steps=3", "--set", "train.lr=3e-3", "--set", "train.save_every=0")
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(train_args(world, one, *common, "--set", "train.micro_batch=2")) == 0
    assert main(train_args(world, two, *common, "--set", "train.micro_batch=1", "--set", "train.grad_accum=2")) == 0
    task = PreferenceTask(dpo_config(world, tmp_path / "t", data, "data.seq_len=300"), torch.device("cpu"))
    assert {len(ids) for ids in task.train_loader.packed.doc_ids} == {2, 4}  # rows of 1 and of 2 pairs
    a, b = train_losses(one), train_losses(two)
    assert [s for s, _ in a] == [s for s, _ in b] == [1, 2, 3]
    assert [v for _, v in a] == pytest.approx([v for _, v in b], rel=1e-5)


def test_a_resume_that_needs_a_reference_it_cannot_compute_is_refused(world, tmp_path, capsys):
    """Full FT keeps its reference table in the checkpoint; a resume with other eval pairs would need the starting
    model's log-probabilities of those, which the trained weights cannot give: one line naming data.eval."""
    out = tmp_path / "run"
    common = ("--set", "lora.rank=0", "--set", "train.save_every=2", "--set", "train.eval_every=0")
    assert main(dpo_args(world, out, *common, "--set", "train.max_steps=2")) == 0
    fewer = _first_pairs(tmp_path, 3)
    capsys.readouterr()
    assert main(dpo_args(world, out, *common, "--set", "train.max_steps=3", "--set", f"data.eval={fewer}")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("atelier: error: data.eval: the checkpoint holds no reference "
                                               "log-probabilities for these 3 pairs (it has 24)"), err
