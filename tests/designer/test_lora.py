"""LoRA: training parity with transformers+PEFT, PEFT-format adapters in and out, merged export."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from atelier_studio.designer.hf import load_pretrained, save_pretrained
from atelier_studio.designer.lora import (
    LoraArgs,
    LoRALinear,
    apply_lora,
    load_peft_adapter,
    lora_parameters,
    merge_lora,
    peft_target_modules,
    save_peft_adapter,
)
from atelier_studio.kernels.cross_entropy import linear_cross_entropy

from tests.designer.test_model import load_hf, make_model_dir, rel_err, run_rows

V = 89


def _peft_name(ours: str) -> str:
    # model.layers.0.self_attn.q_proj.lora_A.weight
    #   → base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight
    return "base_model.model." + ours.replace(".weight", ".default.weight")


def _peft_model(path, args: LoraArgs, target_modules: list[str]):
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=args.rank, lora_alpha=args.alpha, lora_dropout=args.dropout, target_modules=target_modules,
                     use_rslora=args.rslora, bias="none", task_type="CAUSAL_LM")
    return get_peft_model(load_hf(path), cfg)


def _randomise_adapters(model, seed: int) -> None:
    """Non-zero B so the adapters change the logits (PEFT's init makes B = 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.weight.normal_(0, 0.05, generator=g)


@pytest.mark.parametrize("lora", [
    LoraArgs(rank=4, alpha=8.0, dropout=0.0),
    LoraArgs(rank=8, alpha=4.0, dropout=0.0, targets=("q", "v", "down"), rslora=True),
])
def test_training_matches_peft(tmp_path, lora):
    path, _ = make_model_dir(tmp_path, V, seed=2, tie_embeddings=False)
    ours = apply_lora(load_pretrained(path), lora)
    peft = _peft_model(path, lora, peft_target_modules(ours))
    peft_params = dict(peft.named_parameters())
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if p.requires_grad:
                peft_params[_peft_name(name)].copy_(p)
    trainable = [n for n, p in peft.named_parameters() if p.requires_grad]
    assert sorted(trainable) == sorted(_peft_name(n) for n, p in ours.named_parameters() if p.requires_grad)
    opt_ours = torch.optim.AdamW(lora_parameters(ours), lr=1e-2, weight_decay=0.01)
    opt_peft = torch.optim.AdamW([p for p in peft.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    g = torch.Generator().manual_seed(3)
    for step in range(20):
        ids = torch.randint(0, V, (2, 24), generator=g)
        labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
        hidden = run_rows(ours, ids)
        loss = linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), ours.lm_head_weight, labels.reshape(-1))
        loss = loss / (labels != -100).sum()
        loss_peft = peft(input_ids=ids, labels=ids).loss  # transformers shifts the labels itself
        # two implementations of the same fp32 training: the loss (~4.5) differs by a few ulps (at most 1.4e-6
        # over the 20 steps on AVX-512 and DEFAULT kernels, not growing: B is random, so no coordinate's gradient
        # is rounding noise for Adam to amplify); 1e-4 is ~200 ulps
        assert abs(loss.item() - loss_peft.item()) <= 1e-4, f"step {step}: {loss.item()} vs {loss_peft.item()}"
        for opt, l in ((opt_ours, loss), (opt_peft, loss_peft)):
            opt.zero_grad()
            l.backward()
            opt.step()
    # the base really was frozen and the adapters really moved
    assert all(not p.requires_grad or "lora_" in n for n, p in ours.named_parameters())
    assert any(m.lora_B.weight.abs().sum() > 0 for m in ours.modules() if isinstance(m, LoRALinear))


def test_adapter_round_trips_through_peft_and_merge(tmp_path):
    from peft import PeftModel
    from peft.utils import load_peft_weights, set_peft_model_state_dict

    path, _ = make_model_dir(tmp_path, V, seed=4)  # tied embeddings: the adapter must not touch the head
    lora = LoraArgs(rank=4, alpha=16.0, dropout=0.1, targets=("q", "k", "o", "up"))
    ours = apply_lora(load_pretrained(path), lora)
    _randomise_adapters(ours, 5)
    ours.eval()
    ids = torch.randint(0, V, (2, 17), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = ours.logits(run_rows(ours, ids))
    adapter = save_peft_adapter(ours, lora, tmp_path / "adapter", base_model_path=str(path))
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["modules_to_save"] is None and sorted(cfg["target_modules"]) == ["k_proj", "o_proj", "q_proj", "up_proj"]

    peft = PeftModel.from_pretrained(load_hf(path), str(adapter)).eval()
    result = set_peft_model_state_dict(peft, load_peft_weights(str(adapter)))
    assert not result.unexpected_keys
    assert not [k for k in result.missing_keys if "lora_" in k]
    with torch.no_grad():
        assert rel_err(peft(input_ids=ids).logits, want) <= 1e-5

    # Atelier's own loader, into a fresh model
    again = load_pretrained(path)
    assert load_peft_adapter(again, adapter).rank == 4
    with torch.no_grad():
        assert rel_err(again.eval().logits(run_rows(again, ids)), want) <= 1e-5

    # merged export is a plain HF model
    merged = merge_lora(copy.deepcopy(ours))
    assert not any(isinstance(m, LoRALinear) for m in merged.modules())
    out = save_pretrained(merged, tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        assert rel_err(load_hf(out)(input_ids=ids).logits, want) <= 1e-5
    with pytest.raises(ValueError, match="merge_lora"):
        save_pretrained(ours, tmp_path / "unmerged")


def test_lora_layer_and_bad_adapters(tmp_path):
    base = torch.nn.Linear(12, 7)
    layer = LoRALinear(base, LoraArgs(rank=3, alpha=6.0, dtype="bfloat16"))
    assert not base.weight.requires_grad and layer.lora_A.weight.dtype == torch.bfloat16
    x = torch.randn(5, 12)
    assert torch.equal(layer(x), base(x))  # B = 0: a fresh adapter is the identity
    torch.nn.init.normal_(layer.lora_B.weight)
    a, b = layer.lora_A.weight.float(), layer.lora_B.weight.float()
    expect = base(x) + (x.bfloat16().float() @ a.t()).bfloat16().float() @ b.t() * 2.0
    assert torch.allclose(layer(x), expect, atol=5e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="targets"):
        LoraArgs(targets=("q", "lm_head"))

    path, _ = make_model_dir(tmp_path, V, seed=7)
    ours = apply_lora(load_pretrained(path), LoraArgs(rank=4, alpha=8.0))
    adapter = save_peft_adapter(ours, LoraArgs(rank=4, alpha=8.0), tmp_path / "a", base_model_path=str(path))
    with pytest.raises(ValueError, match="rank"):
        load_peft_adapter(apply_lora(load_pretrained(path), LoraArgs(rank=2, alpha=8.0)), adapter)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["q_proj"]}))
    with pytest.raises(ValueError, match=r"adapter_model.safetensors: missing keys \[\], unexpected keys .*down_proj"):
        load_peft_adapter(load_pretrained(path), adapter)
    (adapter / "adapter_config.json").write_text(json.dumps({**cfg, "modules_to_save": ["lm_head"]}))
    with pytest.raises(ValueError, match="adapter_config.json: modules_to_save"):
        load_peft_adapter(load_pretrained(path), adapter)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_peft_adapter(load_pretrained(path), tmp_path / "nowhere")


@pytest.mark.parametrize("family", ["qwen3", "qwen3.5"])
def test_shared_input_groups_equal_the_layers_alone(family, monkeypatch):
    """q/k/v, gate/up and Qwen3.5's four in_proj_* run as one lora_linear_group (fused impl) each; the loss and every
    adapter gradient equal the same model with every LoRA layer run alone."""
    import atelier_studio.kernels.lora_linear as kl
    from atelier_studio.designer.qwen3 import Qwen3, Qwen3Args

    from tests.designer.test_qwen35 import random_qwen35

    if family == "qwen3":
        base = Qwen3(Qwen3Args.from_size("tiny", V, kernels="ref")).init_weights(4)
    else:
        base = random_qwen35(4)
    ids = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(10), torch.arange(14)]).repeat(2, 1)
    cu = torch.tensor([0, 10, 24, 34, 48], dtype=torch.int32)
    groups: list[int] = []
    real = kl.lora_group_fwd
    monkeypatch.setattr(kl, "lora_group_fwd", lambda x, ws, *a, **k: groups.append(len(ws)) or real(x, ws, *a, **k))

    def run(grouped: bool):
        torch.manual_seed(6)  # lora_A's init draws from the global RNG: the same adapters both times
        model = apply_lora(copy.deepcopy(base), LoraArgs(rank=4, alpha=8.0))
        _randomise_adapters(model, seed=5)
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.impl = "fused"
                if not grouped:
                    m.shared_input_operands = lambda: None
        hidden = model(ids, pos, cu, 14).reshape(-1, model.args.dim)
        loss = linear_cross_entropy(hidden, model.lm_head_weight, ids.reshape(-1), impl="torch")
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    loss_alone, grads_alone = run(grouped=False)
    assert groups == []
    loss_grouped, grads_grouped = run(grouped=True)
    layers = base.args.num_layers
    if family == "qwen3":
        assert sorted(groups) == sorted([3, 2] * layers)  # q/k/v and gate/up in every block
    else:
        full = sum(block.layer_type == "full_attention" for block in base.model.layers)
        assert 0 < full < layers
        assert sorted(groups) == sorted([3] * full + [4] * (layers - full) + [2] * layers)
    assert abs(loss_grouped - loss_alone) <= 1e-5 * abs(loss_alone)
    assert grads_grouped.keys() == grads_alone.keys() and len(grads_alone) > 0
    for n, g in grads_alone.items():
        assert rel_err(grads_grouped[n], g) <= 1e-4, n


@pytest.mark.parametrize("case,grouped", [("plain", True), ("frozen A (LoRA-FA)", False), ("dropout", False),
                                          ("bias", False), ("eval with dropout", True), ("one layer alone", False)])
def test_shared_input_linears_group_only_what_one_op_can_take(case, grouped, monkeypatch):
    """Layers that cannot share one lora_linear_group run one by one, with the same outputs and gradients."""
    import atelier_studio.kernels.lora_linear as kl
    from atelier_studio.pipeline.shared_input import shared_input_linears

    calls: list[int] = []
    real = kl.lora_group_fwd
    monkeypatch.setattr(kl, "lora_group_fwd", lambda x, ws, *a, **k: calls.append(len(ws)) or real(x, ws, *a, **k))
    torch.manual_seed(0)
    args = LoraArgs(rank=2, alpha=4.0, dropout=0.3 if "dropout" in case else 0.0)
    layers = [LoRALinear(torch.nn.Linear(8, o, bias=case == "bias" and o == 5), args, impl="fused") for o in (6, 5)]
    if case == "one layer alone":
        layers = layers[:1]
    for m in layers:
        m.train(case != "eval with dropout")
        torch.nn.init.normal_(m.lora_B.weight, std=0.1)
        if case == "frozen A (LoRA-FA)":
            m.lora_A.weight.requires_grad_(False)
    x = torch.randn(7, 8, requires_grad=True)
    torch.manual_seed(1)
    ys = shared_input_linears(x, *layers)
    assert calls == ([len(layers)] if grouped else [])
    torch.manual_seed(1)  # the same dropout masks
    exp = [m(x) for m in layers]
    dys = [torch.randn_like(e) for e in exp]
    grads = [torch.autograd.grad(sum((o * d).sum() for o, d in zip(out, dys)), x) for out in (ys, exp)]
    for y, e in zip(ys, exp):
        torch.testing.assert_close(y, e, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-5)
