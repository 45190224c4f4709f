"""QLoRA (`lora.base_dtype = "nf4"`) on the CPU: the trainer learns and saves what a bf16-base run saves; its PEFT
adapter loads onto the unquantised base and the merged model's logits are the trainer's up to the NF4 error (a
bound derived below); packed rows equal documents one by one; Qwen3.5's projections (Gated DeltaNet included)
quantise; the Triton path equals the reference inside the model; resume is exact.

The merged-logits bound. The trainer computes with Ŵ = dequantise(NF4(W)) where the released base holds W; the
adapter is the same on both. So (a) transformers + PEFT over a base holding Ŵ must give the trainer's logits up to
the rounding of two fp32 implementations, and (b) over W they differ from the trainer's by what ε = W − Ŵ does,
each |ε_jk| within kernels.nf4.nf4_error_bound (derived there from the format). ε adds X_l ε_lᵀ to the output Y_l of
NF4 layer l (X_l its input on the trainer's forward), so to first order in ε a logit z moves by
Σ_l ⟨∂z/∂Y_l, X_l ε_lᵀ⟩, and
  |z(W) − z(Ŵ)| ≤ Σ_l |⟨∂z/∂Y_l, X_l ε_lᵀ⟩|  (+ second order),
each layer's own cancellations kept, the layers' contributions added by absolute value. ε is a few percent of W
(the NF4 resolution), so the second-order remainder is that fraction of the first-order terms; the triangle
inequality's slack over the layers covers it (the ratio is printed). The bound is computed for every logit of one
position, by one backward pass per logit.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from atelier_studio.designer.config import DesignerConfig
from atelier_studio.designer.hf import load_pretrained, save_pretrained
from atelier_studio.designer.lora import LoraArgs, LoRALinear, apply_lora, load_peft_adapter
from atelier_studio.designer.task import DesignerTask
from atelier_studio.flows.cli import main
from atelier_studio.kernels.nf4 import nf4_error_bound
from atelier_studio.pipeline.config import load_config
from atelier_studio.pipeline.lora_nf4 import NF4LoRALinear, quantize_lora_bases

from tests.designer.test_fp8_train import _tensors
from tests.designer.test_model import load_hf, packed_inputs, rel_err, run_rows
from tests.designer.test_train import train_args, train_losses
from tests.kernels._compare import assert_no_leak

STEPS = 24
# two fp32 implementations of the same network (Atelier's, transformers + PEFT): logits agree to a few ulps of
# their largest value, as in tests/designer/test_lora.py (1e-5 is ~80 ulps)
PARITY = 1e-5


@pytest.fixture(scope="module")
def runs(world, tmp_path_factory) -> dict[str, Path]:
    """A 24-step QLoRA run and the one-step bf16-base twin (the same config otherwise)."""
    d = tmp_path_factory.mktemp("qlora")
    common = ("--set", "lora.rank=4", "--set", "train.lr=3e-3", "--set", "train.warmup_steps=3",
              "--set", f"train.save_every={STEPS}")
    assert main(train_args(world, d / "nf4", *common, "--set", f"train.max_steps={STEPS}",
                           "--set", "lora.base_dtype=nf4")) == 0
    assert main(train_args(world, d / "bf16", *common, "--set", "train.max_steps=1", "--set",
                           "train.warmup_steps=1")) == 0
    return {"nf4": d / "nf4", "bf16": d / "bf16", "model": world / "model"}


def test_qlora_learns_and_saves_what_a_bf16_base_run_saves(runs):
    losses = [l for _, l in train_losses(runs["nf4"])]
    assert sum(losses[-5:]) / 5 < 0.95 * sum(losses[:5]) / 5, losses  # it learns
    assert train_losses(runs["bf16"])[0][1] != losses[0]  # the first loss differs: the base really was quantised
    for rel, other in (("checkpoints/step-24/model.safetensors", "checkpoints/step-1/model.safetensors"),
                       ("adapter/adapter_model.safetensors", "adapter/adapter_model.safetensors")):
        assert _tensors(runs["nf4"] / rel) == _tensors(runs["bf16"] / other), rel  # the adapters, and only them
    assert 'base_dtype = "nf4"' in (runs["nf4"] / "config.toml").read_text()
    assert json.loads((runs["nf4"] / "adapter" / "adapter_config.json").read_text()) == \
        json.loads((runs["bf16"] / "adapter" / "adapter_config.json").read_text())


def _qlora_model(model_dir: Path, adapter: Path):
    """What the trainer ran: the base loaded, the adapter applied, every base quantised (deterministic)."""
    m = load_pretrained(model_dir)
    load_peft_adapter(m, adapter)
    done, kept = quantize_lora_bases(m)
    assert done and not kept
    return m.eval()


def rebuilt_and_logged_eval_loss(run: Path) -> tuple[float, float]:
    """(the eval loss of a task over the run's exported adapter on a freshly quantised base, the run's last logged
    eval loss)."""
    cfg = load_config(DesignerConfig, run / "config.toml", [f"lora.init_adapter={run / 'adapter'}"])
    task = DesignerTask(cfg, torch.device("cpu"))
    task.model.eval()
    with torch.no_grad():
        got = task.evaluate()["loss"]
    evals = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    return got, [r for r in evals if r["kind"] == "eval"][-1]["loss"]


def test_the_rebuilt_model_is_the_one_the_trainer_evaluated(runs):
    """The final eval loss of the run, recomputed by a task over the exported adapter on a freshly quantised base:
    the same kernels on the same tensors in the same order, so equal exactly."""
    got, want = rebuilt_and_logged_eval_loss(runs["nf4"])
    assert got == want


def test_merged_adapter_on_the_unquantised_base_is_the_trainers_model_up_to_the_nf4_error(runs, tmp_path):
    from peft import PeftModel

    model_dir, adapter = runs["model"], runs["nf4"] / "adapter"
    q = _qlora_model(model_dir, adapter)
    w = load_pretrained(model_dir)  # the released base: W
    names = [n for n, m in q.named_modules() if isinstance(m, NF4LoRALinear)]
    ids = torch.randint(0, q.args.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))

    # (a) over Ŵ: the base the trainer computed with, as a plain fp32 HF directory
    deq = load_pretrained(model_dir)
    with torch.no_grad():
        for n in names:
            deq.get_submodule(n).weight.copy_(q.get_submodule(n).base_layer.dequantized_weight())
    deq_dir = save_pretrained(deq, tmp_path / "dequantised", dtype=torch.float32)
    merged_deq = PeftModel.from_pretrained(load_hf(deq_dir), str(adapter)).merge_and_unload().eval()
    with torch.no_grad():
        want = q.logits(run_rows(q, ids))
        assert rel_err(merged_deq(input_ids=ids).logits, want) <= PARITY

    # (b) over W: every merged weight is the trainer's Ŵ + s·B·A plus ε = W − Ŵ, and |ε| is within the format's bound
    merged = PeftModel.from_pretrained(load_hf(model_dir), str(adapter)).merge_and_unload().eval()
    merged_sd = merged.state_dict()
    for n in names:
        layer, original = q.get_submodule(n), w.get_submodule(n).weight.detach()
        theirs, ours = merged_sd[f"{n}.weight"].double(), layer.merged_weight().double()
        eps = original.double() - layer.base_layer.dequantized_weight().double()
        # two fp32 sums of W (or Ŵ) and s·B·A: a rounding of each at the merged weight's scale
        rounding = 4 * torch.finfo(torch.float32).eps * (theirs.abs() + ours.abs())
        assert ((theirs - ours - eps).abs() <= rounding).all(), n
        assert (eps.abs() <= nf4_error_bound(layer.base_layer.nf4_weight(), original)).all(), n

    # ... and the logits: within the first-order bound (module docstring) at the last position
    bound = _first_order_logit_bound(q, w, names, ids, position=-1)
    with torch.no_grad():
        theirs = merged(input_ids=ids).logits[0, -1].double()
    actual = (theirs - want[0, -1].double()).abs()
    allowed = bound + PARITY * want[0, -1].abs().max().item()
    assert (actual <= allowed).all(), f"{int((actual > allowed).sum())} logits beyond the bound"
    assert actual.max() > PARITY * want.abs().max()  # the NF4 error is really there, above parity's rounding
    print(f"NF4 logit error at the last position: max {actual.max():.3e}, at most "
          f"{(actual / bound).max():.2f} of its first-order bound (max {bound.max():.3e}), median "
          f"{(actual / bound).median():.2f}")


def _first_order_logit_bound(q, unquantised, names, ids, position) -> torch.Tensor:
    """Σ_layers |⟨∂z/∂Y_l, X_l ε_lᵀ⟩| for every logit z at `position` (module docstring), in fp64."""
    layers = [q.get_submodule(n) for n in names]
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = [m.register_forward_hook(lambda mod, inp, out: seen.__setitem__(id(mod), (inp[0].detach(), out)))
             for m in layers]
    try:
        logits = q.logits(run_rows(q, ids))[0, position]  # [V]
    finally:
        for h in hooks:
            h.remove()
    outs, moves = [], []
    for n, m in zip(names, layers):
        x, y = seen[id(m)]
        eps = unquantised.get_submodule(n).weight.detach().double() - m.base_layer.dequantized_weight().double()
        moves.append(x.reshape(-1, x.shape[-1]).double() @ eps.t())  # X_l ε_lᵀ [T, O]: what ε adds to Y_l
        outs.append(y)
    bound = torch.zeros(logits.shape[0], dtype=torch.float64)
    for v in range(logits.shape[0]):
        grads = torch.autograd.grad(logits[v], outs, retain_graph=True)
        bound[v] = sum((g.reshape(d.shape).double() * d).sum().abs() for g, d in zip(grads, moves))
    return bound


def _nf4_tiny(model_dir: Path, kernels: str = "auto", targets: tuple[str, ...] = ()):
    """The fixture's tiny model with LoRA (random non-zero B, so adapters change the outputs), bases in NF4."""
    m = load_pretrained(model_dir, kernels=kernels)
    torch.manual_seed(0)  # A's kaiming draws: the same adapters on every call
    apply_lora(m, LoraArgs(rank=4, alpha=8.0, targets=targets))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, LoRALinear):
                mod.lora_B.weight.normal_(0, 0.05, generator=g)
    quantize_lora_bases(m)
    return m


def test_packed_rows_equal_documents_one_by_one(runs):
    """Three documents packed into one row against each alone: the NF4 layers see tokens one at a time, and the
    attention keeps to each document (assert_no_leak: reordered fp32 sums over the model's depth)."""
    m = _nf4_tiny(runs["model"]).eval()
    g = torch.Generator().manual_seed(2)
    docs = [torch.randint(3, m.args.vocab_size, (n,), generator=g).tolist() for n in (9, 14, 6)]
    ids, pos, cu, max_len, _ = packed_inputs(docs, [[0, 1, 2]], 29)
    with torch.no_grad():
        packed = m(ids, pos, cu, max_len)[0]
        start = 0
        for d in docs:
            alone = run_rows(m, torch.tensor([d]))[0]
            assert_no_leak(packed[start:start + len(d)], alone, f"document of {len(d)}", torch.float32,
                           terms=4 * m.args.dim)
            start += len(d)


def test_triton_path_equals_the_reference_inside_the_model(runs):
    """kernels = "triton" (the interpreter here) and "ref" on the same NF4 model: loss and every adapter gradient
    within fp32 reordered sums over the model's depth (the kernels' Ŵ is the reference's bit for bit)."""
    results = []
    for kernels in ("triton", "ref"):
        m = _nf4_tiny(runs["model"], kernels=kernels, targets=("q", "o", "down"))
        ids = torch.randint(3, m.args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
        loss = m.logits(run_rows(m, ids)).float().logsumexp(-1).mean()
        loss.backward()
        results.append([loss.detach()] + [p.grad for n, p in m.named_parameters() if p.requires_grad])
    assert len(results[0]) == 1 + 2 * 3 * 2  # 3 targets × 2 layers × (A, B)
    for got, exp in zip(*results):
        torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-6 * exp.abs().max().item())


def test_qwen35_projections_quantise_and_train(world, tmp_path):
    """Qwen3.5-tiny: every target but out_proj (96 in-features, not whole blocks of 64) goes to NF4, the Gated
    DeltaNet input projections (qkv, z, b, a) included, and a QLoRA run through the CLI trains."""
    model = tmp_path / "qwen35"
    assert main(["designer", "init", "--size", "qwen3.5-tiny", "--tokenizer", str(world / "tok"), "--out",
                 str(model), "--dtype", "float32"]) == 0
    m = apply_lora(load_pretrained(model), LoraArgs(rank=4, alpha=8.0))
    done, kept = quantize_lora_bases(m)
    leaves = {n.rsplit(".", 1)[1] for n in done}
    assert {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "q_proj", "k_proj", "v_proj", "o_proj",
            "gate_proj", "up_proj", "down_proj"} == leaves
    assert kept and all(n.endswith("linear_attn.out_proj") for n in kept)
    out = tmp_path / "run"
    assert main(train_args(world, out, "--set", f"model.path={model}", "--set", "lora.rank=4",
                           "--set", "lora.base_dtype=nf4", "--set", "train.max_steps=3")) == 0
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert len(train_losses(out)) == 3


def test_qlora_resume_is_exact(world, tmp_path):
    """Stop at step 2 (a checkpoint), run again to 4: the losses equal one uninterrupted run's (the base is
    quantised again on resume, deterministically; constant schedule)."""
    args = ("--set", "lora.rank=4", "--set", "train.schedule=constant", "--set", "train.warmup_steps=0",
            "--set", "lora.base_dtype=nf4", "--set", "train.save_every=2")
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(train_args(world, straight, *args, "--set", "train.max_steps=4")) == 0
    assert main(train_args(world, split, *args, "--set", "train.max_steps=2")) == 0
    assert main(train_args(world, split, *args, "--set", "train.max_steps=4")) == 0
    assert train_losses(split)[-2:] == train_losses(straight)[-2:]
