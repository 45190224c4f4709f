"""`atelier designer export --merge RUN`: the merged model is PEFT's merge_and_unload of the same adapter on the same
base (to the rounding of the output dtype), transformers loads it, QLoRA merges onto the NF4-rounded base the run
trained on, Qwen3-MoE's per-expert adapters land in the released per-expert layout, and bad input is one line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from atelier_studio.designer.hf import load_pretrained, weight_files
from atelier_studio.designer.lora import GroupedLoRA, LoraArgs, apply_lora, load_peft_adapter, save_peft_adapter
from atelier_studio.flows.cli import main
from atelier_studio.pipeline.lora_nf4 import NF4LoRALinear, quantize_lora_bases

from tests.designer.test_lora import _randomise_adapters
from tests.designer.test_model import load_hf, rel_err
from tests.designer.test_train import train_args

PARITY = 1e-5  # two fp32 implementations of the same network (tests/designer/test_lora.py's bound, ~80 ulps)


def _random_adapter(model_dir: Path, out: Path, lora: LoraArgs, seed: int) -> Path:
    """A PEFT adapter on model_dir with non-zero B (so the merge changes the weights), its grouped ones too."""
    model = apply_lora(load_pretrained(model_dir), lora)
    _randomise_adapters(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, GroupedLoRA):
                m.lora_B.normal_(0, 0.05, generator=g)
    return save_peft_adapter(model, lora, out, base_model_path=str(model_dir))


def _peft_merged(model_dir: Path, adapter: Path):
    from peft import PeftModel

    return PeftModel.from_pretrained(load_hf(model_dir), str(adapter)).merge_and_unload().eval()


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 19), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("base_dtype,dtype", [("float32", "float32"), ("float32", "bfloat16"), ("bfloat16", "")],
                         ids=["fp32 base, fp32 out", "fp32 base, bf16 out", "bf16 base, its dtype out"])
def test_merge_equals_peft_merge_and_unload(world, tmp_path, base_dtype, dtype):
    base = world / "model"
    if base_dtype != "float32":  # held in bf16 while merging (half fp32's memory): still one rounding of the fp32 sum
        base = tmp_path / "base"
        assert main(["designer", "init", "--size", "tiny", "--tokenizer", str(world / "tok"), "--out", str(base),
                     "--dtype", base_dtype]) == 0
    adapter = _random_adapter(base, tmp_path / "adapter", LoraArgs(rank=4, alpha=16.0, targets=("q", "v", "o", "down")),
                              seed=3)
    out = tmp_path / "merged"
    given = ["--dtype", dtype] if dtype else []
    assert main(["designer", "export", "--merge", str(adapter), "--out", str(out), *given]) == 0
    dtype = dtype or base_dtype
    peft = _peft_merged(base, adapter)
    ours = load_hf(out)  # transformers' AutoModelForCausalLM reads it (as fp32 for the comparison)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == dtype
    assert {t.dtype for t in load_pretrained(out, dtype=None).state_dict().values()} == {getattr(torch, dtype)}
    want_dtype = getattr(torch, dtype)
    theirs_sd, ours_sd = peft.state_dict(), ours.state_dict()
    assert theirs_sd.keys() == ours_sd.keys()
    # every weight is PEFT's fp32 merge rounded once to the output dtype: at most one ulp of that dtype apart (the
    # two fp32 sums W + s·B·A may round to neighbouring values, which the cast can split)
    eps = torch.finfo(want_dtype).eps
    for k, theirs in theirs_sd.items():
        diff = (ours_sd[k] - theirs.to(want_dtype).float()).abs()
        assert (diff <= eps * theirs.abs() + torch.finfo(torch.float32).tiny).all(), k
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(out)).get_vocab() == AutoTokenizer.from_pretrained(str(base)).get_vocab()
    ids = _ids(ours.config.vocab_size)
    with torch.no_grad():
        theirs_logits, ours_logits = peft(input_ids=ids).logits, ours(input_ids=ids).logits
    # fp32: the same network; bf16: the weights' rounding (≤ eps/2 relative each) moves the logits by a few eps
    assert rel_err(ours_logits, theirs_logits) <= (PARITY if dtype == "float32" else 4 * eps)


def test_a_lora_run_folder_merges_into_a_model_transformers_loads(world, tmp_path):
    run = tmp_path / "run"
    assert main(train_args(world, run, "--set", "lora.rank=4", "--set", "train.max_steps=3", "--set",
                           "train.lr=3e-2", "--set", "train.save_every=3")) == 0
    out = tmp_path / "merged"
    assert main(["designer", "export", "--merge", str(run), "--out", str(out)]) == 0  # the base's dtype: fp32
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    peft, ours = _peft_merged(world / "model", run / "adapter"), load_hf(out)
    base = load_hf(world / "model")
    ids = _ids(ours.config.vocab_size)
    with torch.no_grad():
        want, got, before = peft(input_ids=ids).logits, ours(input_ids=ids).logits, base(input_ids=ids).logits
    assert rel_err(got, want) <= PARITY
    assert rel_err(before, want) > 100 * PARITY  # the adapter trained: the merge really changed the model


def test_sharded_output_and_a_base_named_by_hub_id(world, tmp_path, monkeypatch):
    """Small shards give an index transformers follows; an adapter whose base_model_name_or_path is a hub id (as
    PEFT writes for hub bases) merges from the local cache, and one not in the cache is one line naming it."""
    from atelier_studio.designer.export import export_merged

    from tests.pipeline.test_hub import lay_out_cache

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lay_out_cache(tmp_path / "hub", "atelier-test/designer-tiny", world / "model")
    adapter = _random_adapter(world / "model", tmp_path / "adapter", LoraArgs(rank=2, alpha=4.0), seed=9)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path":
                                                             "atelier-test/designer-tiny"}))
    out = export_merged(adapter, tmp_path / "merged", max_shard_bytes=2**16)
    assert (out / "model.safetensors.index.json").is_file() and len(set(weight_files(out).values())) > 1
    ids = _ids(load_hf(out).config.vocab_size)
    with torch.no_grad():
        want = _peft_merged(world / "model", adapter)(input_ids=ids).logits
        assert rel_err(load_hf(out)(input_ids=ids).logits, want) <= PARITY
    (adapter / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": "atelier-test/gone"}))
    assert main(["designer", "export", "--merge", str(adapter), "--out", str(tmp_path / "again")]) == 2


def test_a_qlora_run_merges_onto_the_nf4_rounded_base(world, tmp_path, capsys):
    run = tmp_path / "qlora"
    assert main(train_args(world, run, "--set", "lora.rank=4", "--set", "train.max_steps=2", "--set",
                           "train.lr=3e-2", "--set", "train.save_every=2", "--set", "lora.base_dtype=nf4")) == 0
    capsys.readouterr()
    out = tmp_path / "merged"
    assert main(["designer", "export", "--merge", str(run / "adapter"), "--out", str(out), "--dtype", "float32"]) == 0
    assert "carry the NF4 rounding" in capsys.readouterr().out
    # what the trainer computed with: the base as the run loaded it (model.dtype float32), quantised, the adapter on it
    q = load_pretrained(world / "model")
    lora = load_peft_adapter(q, run / "adapter")
    done, _ = quantize_lora_bases(q)
    assert done
    merged = load_pretrained(out).state_dict()
    base = load_pretrained(world / "model").state_dict()
    for name, m in q.named_modules():
        if isinstance(m, NF4LoRALinear):
            w_hat = m.base_layer.dequantized_weight().float()
            want = w_hat + lora.scale * (m.lora_B.weight.float() @ m.lora_A.weight.float())
            assert torch.equal(merged[f"{name}.weight"], want), name  # the same fp32 sum, on the same Ŵ
            assert not torch.equal(merged[f"{name}.weight"], base[f"{name}.weight"] + (want - w_hat)), name
    assert load_hf(out) is not None


def test_a_qwen3_moe_adapter_merges_into_the_per_expert_weights(world, tmp_path):
    model_dir = tmp_path / "moe"
    assert main(["designer", "init", "--size", "qwen3-moe-tiny", "--tokenizer", str(world / "tok"), "--out",
                 str(model_dir), "--dtype", "float32"]) == 0
    adapter = _random_adapter(model_dir, tmp_path / "adapter", LoraArgs(rank=4, alpha=8.0), seed=5)
    out = tmp_path / "merged"
    assert main(["designer", "export", "--merge", str(adapter), "--out", str(out)]) == 0
    keys = weight_files(out)
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in keys  # the released per-expert layout
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in keys)
    peft, ours = _peft_merged(model_dir, adapter), load_hf(out)
    ids = _ids(ours.config.vocab_size)
    with torch.no_grad():
        assert rel_err(ours(input_ids=ids).logits, peft(input_ids=ids).logits) <= PARITY


def test_a_qwen3_moe_qlora_adapter_merges_onto_the_nf4_experts(world, tmp_path):
    """An adapter beside a run config.toml saying lora.base_dtype = "nf4" (as a QLoRA run leaves it): every expert
    stack and attention linear is merged onto its dequantised NF4 weights, Ŵ + s·B·A, in the per-expert layout."""
    model_dir = tmp_path / "moe"
    assert main(["designer", "init", "--size", "qwen3-moe-tiny", "--tokenizer", str(world / "tok"), "--out",
                 str(model_dir), "--dtype", "float32"]) == 0
    adapter = _random_adapter(model_dir, tmp_path / "run" / "adapter", LoraArgs(rank=4, alpha=8.0), seed=6)
    (tmp_path / "run" / "config.toml").write_text('[model]\ndtype = "float32"\n[lora]\nbase_dtype = "nf4"\n')
    out = tmp_path / "merged"
    assert main(["designer", "export", "--merge", str(tmp_path / "run"), "--out", str(out)]) == 0
    q = load_pretrained(model_dir)
    load_peft_adapter(q, adapter)
    quantize_lora_bases(q)
    merged = load_pretrained(out).state_dict()
    checked = 0
    for name, m in q.named_modules():
        if isinstance(m, NF4LoRALinear):
            want = m.base_layer.dequantized_weight().float() + m.scale * (m.lora_B.weight @ m.lora_A.weight).float()
            assert torch.equal(merged[f"{name}.weight"], want), name
            checked += 1
        elif isinstance(m, GroupedLoRA):  # <experts>.lora_adapters.<leaf>
            experts = q.get_submodule(name.rsplit(".", 2)[0])
            f = experts.down_proj.shape[2]
            stack, rows = {"gate_proj": ("gate_up_proj", slice(0, f)), "up_proj": ("gate_up_proj", slice(f, None)),
                           "down_proj": ("down_proj", slice(None))}[m.leaf]
            w_hat = getattr(experts, stack).experts().dequantize()[:, rows]
            key = f"{name.rsplit('.', 2)[0]}.{stack}"
            assert torch.equal(merged[key][:, rows], w_hat.float() + m.delta()), (name, m.leaf)
            checked += 1
    assert checked > 0 and any(".experts." in k and k.endswith("gate_up_proj") for k in merged)
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in weight_files(out)


def test_bad_input_is_one_line(world, tmp_path, capsys):
    adapter = _random_adapter(world / "model", tmp_path / "adapter", LoraArgs(rank=2, alpha=2.0), seed=1)
    (tmp_path / "empty").mkdir()
    cases = {
        str(world / "model"): "not a LoRA run",  # a model directory
        str(tmp_path / "empty"): "not a LoRA run",
        str(tmp_path / "nowhere"): "not a directory",
    }
    (adapter / "adapter_model.safetensors").rename(tmp_path / "moved.safetensors")
    cases[str(adapter)] = "adapter_model.safetensors is missing"
    for run, what in cases.items():
        assert main(["designer", "export", "--merge", run, "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("atelier: error: ") and what in err[0] and run in err[0], err
        if what != "adapter_model.safetensors is missing":  # the argument is named with its value
            assert f"--merge {run}: " in err[0], err
        assert not (tmp_path / "out").exists()
