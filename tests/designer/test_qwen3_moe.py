"""Qwen3-MoE: parity with transformers' Qwen3MoeForCausalLM (logits, router choices, the load-balancing loss), both
checkpoint key layouts, packing exactness, FLOPs, LoRA against PEFT (loading and training), decoding, and init /
train (LoRA and full) / generate through the CLI.

Tolerances (fp32 on both sides): two implementations of the same math in other orders (the fused add + norm, the
expert loop against the grouped path, the combine's fp32 sum), so differences are fp32 rounding through a few
layers: 1e-5 relative on logits and losses (test_model.py's bound for Qwen3), router logits to rounding, the
router's top-k choices identical (a tie within rounding would be a 1e-7 coincidence on random weights).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from atelier_studio.designer.hf import init_random, load_pretrained, save_pretrained
from atelier_studio.designer.lora import (
    GroupedLoRA,
    LoraArgs,
    LoRALinear,
    apply_lora,
    load_peft_adapter,
    lora_parameters,
    merge_lora,
    save_peft_adapter,
)
from atelier_studio.designer.qwen3_moe import (
    FAMILY,
    Qwen3Moe,
    Qwen3MoeArgs,
    active_params,
    forward_with_aux,
    load_balancing_loss,
    num_params,
)
from atelier_studio.flows.cli import main
from atelier_studio.kernels.cross_entropy import linear_cross_entropy
from atelier_studio.kernels.moe import route

from tests.designer.test_model import (
    check_flops_match_counter,
    check_packed_equals_one_by_one,
    load_hf,
    norms_away_from_one,
    randomise_adapters,
    rel_err,
    run_rows,
)

ROOT = Path(__file__).parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "designer" / "briefs.jsonl"
V = 97


def random_moe(seed: int, vocab: int = V, **overrides) -> Qwen3Moe:
    """The tiny Qwen3-MoE (2 sparse layers around a dense one) with norms away from 1."""
    model = Qwen3Moe(FAMILY.args_of_size("qwen3-moe-tiny", vocab, eos_token_id=2, pad_token_id=0, **overrides))
    return norms_away_from_one(model.init_weights(seed), seed)


def router_inputs(model) -> tuple[list[torch.Tensor], list]:
    """Forward hooks capturing each sparse layer's router input [N, D] (the MoE block's input)."""
    seen, handles = [], []
    for block in model.model.layers:
        if block.sparse:
            handles.append(block.mlp.register_forward_hook(
                lambda m, a, out: seen.append(a[0].reshape(-1, a[0].shape[-1]))))
    return seen, handles


# --- parity with transformers ---------------------------------------------------------------------
@pytest.mark.parametrize("overrides", [dict(), dict(tie_embeddings=True, norm_topk_prob=False, decoder_sparse_step=2,
                                                     mlp_only_layers=())])
def test_logits_and_router_choices_match_transformers(tmp_path, overrides):
    path = save_pretrained(random_moe(1, **overrides), tmp_path / "m", dtype=torch.float32)
    ours, hf = load_pretrained(path), load_hf(path)
    assert type(ours) is Qwen3Moe and type(hf) is FAMILY.hf_reference.causal_lm_class()
    tied = ours.args.tie_embeddings
    assert set(ours.state_dict()) == {k for k in hf.state_dict() if not (tied and k == "lm_head.weight")}
    ids = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(2))
    seen, handles = router_inputs(ours)
    with torch.no_grad():
        got = ours.logits(run_rows(ours, ids))
        out = hf(input_ids=ids, output_router_logits=True)
    for h in handles:
        h.remove()
    assert rel_err(got, out.logits) <= 1e-5, rel_err(got, out.logits)
    sparse = [b for b in ours.model.layers if b.sparse]
    assert len(out.router_logits) == len(sparse) == len(seen) == sum(ours.args.sparse_layers) >= 1
    for i, (block, x, want) in enumerate(zip(sparse, seen, out.router_logits)):
        r = route(x, block.mlp.gate.weight, ours.args.top_k, ours.args.norm_topk_prob)
        assert rel_err(r.logits, want) <= 1e-5, (i, rel_err(r.logits, want))
        chosen = torch.topk(torch.softmax(want.float(), -1), ours.args.top_k, dim=-1).indices
        assert torch.equal(r.experts, chosen), f"sparse layer {i}: different experts chosen"


def test_loads_transformers_checkpoints_in_either_expert_layout(tmp_path):
    """A transformers-written checkpoint (per-expert keys, sharded) and one with the experts stacked under their
    state-dict names both load; Atelier writes the per-expert layout of the released checkpoints."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from atelier_studio.pipeline.atomic import save_safetensors

    cfg = Qwen3MoeConfig(vocab_size=61, hidden_size=48, intermediate_size=80, moe_intermediate_size=24,
                         num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=1, head_dim=24, num_experts=6,
                         num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0],
                         tie_word_embeddings=False, rope_theta=5e5)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    hf.save_pretrained(str(tmp_path / "hf"), max_shard_size="40KB")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.experts.5.down_proj.weight" in index  # transformers writes the per-expert layout
    ours = load_pretrained(tmp_path / "hf")
    assert ours.args.mlp_only_layers == (0,) and ours.args.rope_theta == 5e5 and ours.args.num_experts == 6
    ids = torch.randint(0, 61, (1, 23), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        assert rel_err(ours.logits(run_rows(ours, ids)), want) <= 1e-5
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    (stacked / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    save_safetensors({k: v.contiguous() for k, v in ours.state_dict().items()}, stacked / "model.safetensors")
    again = load_pretrained(stacked)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), ours.state_dict().values()))
    written = save_pretrained(ours, tmp_path / "ours", dtype=torch.float32)
    with safe_open(str(written / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.2.mlp.experts.0.gate_proj.weight" in keys and not any(k.endswith("gate_up_proj") for k in keys)


def test_config_round_trip_sizes_and_parameter_counts():
    from transformers import Qwen3MoeConfig

    for size in FAMILY.sizes:
        args = FAMILY.args_of_size(size, 151936)
        assert Qwen3MoeArgs.from_hf_config(args.to_hf_config()) == args
        hf = Qwen3MoeConfig(**{k: v for k, v in args.to_hf_config().items() if k not in ("architectures", "dtype",
                                                                                           "torch_dtype")})
        assert hf.num_experts == args.num_experts and hf.moe_intermediate_size == args.moe_ffn_dim
    # transformers 5 writes num_local_experts and rope_parameters; both read
    cfg = FAMILY.args_of_size("qwen3-moe-tiny", V).to_hf_config()
    v5 = {**{k: v for k, v in cfg.items() if k not in ("num_experts", "rope_theta")}, "num_local_experts": 8,
          "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    assert Qwen3MoeArgs.from_hf_config(v5) == FAMILY.args_of_size("qwen3-moe-tiny", V)
    # the model cards: 30.5B total, 3.3B activated; 235B total, 22B activated (both counting the embedding)
    for size, total, active in (("qwen3-30b-a3b", 30.5, 3.3), ("qwen3-235b-a22b", 235.1, 22.2)):
        args = FAMILY.args_of_size(size, 151936)
        embed = args.vocab_size * args.dim
        assert abs(num_params(args) / 1e9 - total) < 0.1, size
        assert abs((active_params(args) + embed) / 1e9 - active) < 0.1, size
    with pytest.raises(ValueError, match=r"config.json: missing keys \['moe_intermediate_size'\]"):
        Qwen3MoeArgs.from_hf_config({k: v for k, v in cfg.items() if k != "moe_intermediate_size"})
    with pytest.raises(ValueError, match="top_k=9 exceeds num_experts=8"):
        FAMILY.args_of_size("qwen3-moe-tiny", V, top_k=9)


def test_load_balancing_loss_is_transformers_over_the_real_tokens():
    """The aux loss (and the loss it joins) on right-padded rows equals transformers' with the padding masked out
    of its attention mask; counting the padding too would give another value."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = random_moe(3)
    b, t, lens = 3, 20, [20, 13, 6]
    ids = torch.randint(1, V, (b, t), generator=torch.Generator().manual_seed(5))
    real = torch.arange(t)[None, :] < torch.tensor(lens)[:, None]  # [B, T]
    ids[~real] = 0
    labels = torch.where(real, ids, -100)
    hf_cfg = {k: v for k, v in model.args.to_hf_config(torch.float32).items() if k not in ("architectures",)}
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(hf_cfg.pop("model_type"), **hf_cfg),
                                          dtype=torch.float32, attn_implementation="eager").eval()
    hf.load_state_dict(model.state_dict())
    out = hf(input_ids=ids, attention_mask=real.long(), labels=labels)
    # rows of one document each (the padding its own segment, as data/packing.py lays rows out)
    bounds = [0] + [x for i, n in enumerate(lens) for x in ((i * t + n, (i + 1) * t) if n < t else ((i + 1) * t,))]
    cu = torch.tensor(bounds, dtype=torch.int32)
    pos = torch.arange(t).repeat(b, 1)
    pos[~real] = (torch.arange(t)[None, :] - torch.tensor(lens)[:, None]).clamp(min=0)[~real]
    hidden, aux = forward_with_aux(model, ids, pos, cu, t, real, "auto")
    assert rel_err(aux, model.args.router_aux_loss_coef * out.aux_loss) <= 1e-5
    shifted = torch.cat([labels[:, 1:], torch.full((b, 1), -100)], 1).reshape(-1)
    ce = linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), model.lm_head_weight, shifted)
    loss = ce / (shifted != -100).sum() + aux  # designer/task.py's loss with one micro-batch
    assert rel_err(loss, out.loss) <= 1e-5, (loss.item(), out.loss.item())
    _, stats = model(ids, pos, cu, t, real_tokens=torch.ones_like(real))
    with_pads = load_balancing_loss(stats, torch.ones_like(real))
    assert rel_err(with_pads, out.aux_loss) > 1e-3  # the test can tell: padding counted moves the loss
    assert forward_with_aux(model, ids, pos, cu, t, real, "off")[1] is None


# --- packing, FLOPs -------------------------------------------------------------------------------
@pytest.mark.parametrize("kernels", ["ref", "triton"])
def test_packed_rows_equal_documents_one_by_one(kernels):
    """Dropless routing: tokens never interact, so each document routes and computes as it would alone (the
    Triton path through Triton's interpreter and the per-expert loop or torch._grouped_mm)."""
    model = random_moe(5, attention_impl="sdpa", kernels=kernels)
    g = torch.Generator().manual_seed(6)
    docs = [torch.randint(0, V, (n,), generator=g).tolist() for n in (5, 11, 1, 7, 9, 3)]
    check_packed_equals_one_by_one(model, docs, [[0, 1, 2], [3, 4], [5]], seq_len=20)


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_the_flop_counter_counts_active_parameters(mode):
    """matmul_flops (attention, dense MLPs, routers and the k experts each token runs, LoRA's A and B included)
    equals FlopCounterMode on the reference path's matmuls."""
    model = random_moe(0, attention_impl="sdpa", kernels="ref")
    if mode == "lora":
        apply_lora(model, LoraArgs(rank=4, alpha=8.0))  # every target, the experts' adapters too
        model.model.embed_tokens.weight.requires_grad_(True)  # every input-gradient runs (test_model.py's reason)
    else:
        model.requires_grad_(True)
    lens, head_tokens = check_flops_match_counter(model, V)
    assert FAMILY.train_flops(model, lens, head_tokens) == (model.matmul_flops(sum(lens), head_tokens)
                                                           + model.attention_flops(lens))
    a = model.args
    dense_all = Qwen3Moe(a)
    dense_all.requires_grad_(True)
    # active, not total: E/k times fewer expert FLOPs than if every expert ran every token
    experts_all = sum(2 * 3 * 3 * a.dim * a.moe_ffn_dim * a.num_experts * 10 for s in a.sparse_layers if s)
    experts_k = sum(2 * 3 * 3 * a.dim * a.moe_ffn_dim * a.top_k * 10 for s in a.sparse_layers if s)
    assert dense_all.matmul_flops(10, 0) + experts_all - experts_k > dense_all.matmul_flops(10, 0)


# --- LoRA against PEFT ----------------------------------------------------------------------------
def test_lora_adapter_loads_in_peft_and_round_trips(tmp_path):
    """Adapters on attention and on every expert, saved in PEFT's per-expert layout: PEFT (converting them onto
    transformers 5's stacked experts) gives the same logits, as do Atelier's loader and the merged export."""
    import copy

    from peft import PeftModel

    path = save_pretrained(random_moe(3), tmp_path / "base", dtype=torch.float32)
    lora = LoraArgs(rank=4, alpha=8.0)
    ours = apply_lora(load_pretrained(path), lora)
    randomise_adapters(ours, 4)
    ids = torch.randint(0, V, (2, 33), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = ours.eval().logits(run_rows(ours, ids))
    adapter = save_peft_adapter(ours, lora, tmp_path / "adapter", base_model_path=str(path))
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    from safetensors import safe_open

    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:
        assert "base_model.model.model.layers.2.mlp.experts.7.down_proj.lora_B.weight" in set(f.keys())
        assert not any("layers.1.mlp" in k for k in f.keys())  # the dense layer takes no adapter
    peft = PeftModel.from_pretrained(load_hf(path), str(adapter)).eval()
    with torch.no_grad():
        assert rel_err(peft(input_ids=ids).logits, want) <= 1e-5
    again = load_pretrained(path)
    assert load_peft_adapter(again, adapter).targets == tuple(FAMILY.lora_targets)
    with torch.no_grad():
        assert rel_err(again.eval().logits(run_rows(again, ids)), want) <= 1e-5
    merged = merge_lora(copy.deepcopy(ours))
    assert not any(isinstance(m, (LoRALinear, GroupedLoRA)) for m in merged.modules())
    out = save_pretrained(merged, tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        assert rel_err(load_hf(out)(input_ids=ids).logits, want) <= 1e-5
    only = apply_lora(load_pretrained(path), LoraArgs(rank=2, targets=("q", "down")))
    assert {n for n, m in only.named_modules() if isinstance(m, GroupedLoRA)} == {
        f"model.layers.{i}.mlp.experts.lora_adapters.down_proj" for i in (0, 2)}
    with pytest.raises(ValueError, match="dropout 0.1 is not supported on grouped weights"):
        apply_lora(load_pretrained(path), LoraArgs(rank=2, dropout=0.1))


def peft_as_ours(peft, args: Qwen3MoeArgs, r: int, grads: bool = False) -> tuple[dict[str, torch.Tensor], list]:
    """PEFT's adapter tensors (or their gradients) under Atelier's state-dict names, and the off-diagonal blocks.

    On transformers 5 PEFT loads a per-expert gate/up pair as ONE adapter on the stacked gate_up_proj, of rank 2r
    per expert: A = [A_gate; A_up] ([E·2r, D]) and a block-diagonal B = [[B_gate, 0], [0, B_up]] ([2F, 2r·E],
    column c·E + e); down_proj's as A [E·r, F] and B [D, r·E]. (Read off PEFT's own conversion of a saved adapter.)
    """
    out, off = {}, []
    e = args.num_experts
    for name, p in peft.named_parameters():
        if "lora_" not in name:
            continue
        t = p.grad if grads else p.detach()
        if ".experts." not in name:  # base_model.model.<module>.lora_A.default.weight
            out[name.removeprefix("base_model.model.").replace(".default.", ".")] = t
            continue
        host = name.removeprefix("base_model.model.").split(".experts.")[0] + ".experts.lora_adapters."
        ab = "lora_A" if ".lora_A." in name else "lora_B"
        if ".base_layer." in name and ab == "lora_A":  # gate_up's A
            a = t.view(e, 2 * r, -1)
            out[host + "gate_proj.lora_A"], out[host + "up_proj.lora_A"] = a[:, :r], a[:, r:]
        elif ".base_layer." in name:  # gate_up's block-diagonal B
            f = t.shape[0] // 2
            b = t.view(2 * f, 2 * r, e).permute(2, 0, 1)  # [E, 2F, 2r]
            out[host + "gate_proj.lora_B"], out[host + "up_proj.lora_B"] = b[:, :f, :r], b[:, f:, r:]
            off += [b[:, :f, r:], b[:, f:, :r]]
        elif ab == "lora_A":
            out[host + "down_proj.lora_A"] = t.view(e, r, -1)
        else:
            out[host + "down_proj.lora_B"] = t.view(-1, r, e).permute(2, 0, 1)
    return out, off


def test_lora_training_matches_transformers_and_peft(tmp_path):
    """Five SGD steps of LoRA on attention and every expert, on the same one-document rows with padding, through
    Atelier (packed forward, chunked CE, the aux loss over the real tokens) and transformers + PEFT (its loss with the
    aux loss and the attention mask): the same losses and gradients every step, and the same adapters after.
    SGD, not Adam: an update proportional to the gradient keeps the two runs' rounding differences rounding-sized
    (Adam steps each coordinate by ~lr whatever its gradient's size, so a coordinate whose gradient sums to nearly
    0 steps by its rounding noise, and from the second step on the runs compare different adapters); the
    optimizer is torch's on both sides either way.

    PEFT trains a per-expert gate/up pair as one rank-2r adapter on the stacked gate_up_proj whose B is
    block-diagonal only at init (its off-diagonal blocks get gradients); the released per-expert layout (and
    transformers 4's per-expert Linears) has two separate adapters, which is what Atelier trains and saves. A hook
    zeroes PEFT's off-diagonal gradient, so both train the per-expert model; the test checks those blocks stay 0.
    """
    from peft import PeftModel

    path = save_pretrained(random_moe(7), tmp_path / "base", dtype=torch.float32)
    lora = LoraArgs(rank=4, alpha=8.0)
    torch.manual_seed(0)  # apply_lora draws A from the global generator
    ours = apply_lora(load_pretrained(path), lora)
    randomise_adapters(ours, 8)  # non-zero B: every adapter gets a gradient from the first step
    adapter = save_peft_adapter(ours, lora, tmp_path / "adapter", base_model_path=str(path))
    peft = PeftModel.from_pretrained(load_hf(path), str(adapter), is_trainable=True)
    peft.train()
    a, r = ours.args, lora.rank
    f = a.moe_ffn_dim
    for name, p in peft.named_parameters():
        if name.endswith("experts.base_layer.lora_B.default.weight"):
            mask = torch.ones(2 * f, 2 * r, a.num_experts)
            mask[:f, r:] = 0
            mask[f:, :r] = 0
            p.register_hook(lambda grad, m=mask.view(2 * f, -1): grad * m)
    start = {n: p.detach().clone() for n, p in ours.named_parameters() if p.requires_grad}
    assert set(start) == set(peft_as_ours(peft, a, r)[0])
    opt_ours = torch.optim.SGD(lora_parameters(ours), lr=0.1)
    opt_peft = torch.optim.SGD([p for p in peft.parameters() if p.requires_grad], lr=0.1)
    g = torch.Generator().manual_seed(9)
    b, t = 2, 24
    for step in range(5):
        ids = torch.randint(1, V, (b, t), generator=g)
        n = 17 - step  # row 1 holds one document of n tokens, then padding
        real = torch.arange(t)[None, :] < torch.tensor([t, n])[:, None]
        ids[~real] = 0
        labels = torch.where(real, ids, -100)
        cu = torch.tensor([0, t, t + n, 2 * t], dtype=torch.int32)
        pos = torch.stack([torch.arange(t), torch.cat([torch.arange(n), torch.arange(t - n)])])
        hidden, aux = forward_with_aux(ours, ids, pos, cu, t, real, "auto")
        shifted = torch.cat([labels[:, 1:], torch.full((b, 1), -100)], 1).reshape(-1)
        ce = linear_cross_entropy(hidden.reshape(-1, a.dim), ours.lm_head_weight, shifted)
        loss = ce / (shifted != -100).sum() + aux
        loss_peft = peft(input_ids=ids, attention_mask=real.long(), labels=labels).loss
        # the same fp32 training in two implementations: ~1e-6 apart (a few ulps of ~4.6); 1e-4 is ~200 ulps, and
        # leaving out the aux term alone (coef 1e-3 · aux ≈ 1e-3) moves the loss by ten times that
        assert abs(loss.item() - loss_peft.item()) <= 1e-4, f"step {step}: {loss.item()} vs {loss_peft.item()}"
        for opt, l in ((opt_ours, loss), (opt_peft, loss_peft)):
            opt.zero_grad()
            l.backward()
        theirs, _ = peft_as_ours(peft, a, r, grads=True)
        for name, p in ours.named_parameters():
            if p.requires_grad:
                # a gradient sums every routed token's contribution through the layers above, in another order on
                # each side: 1e-5 of its norm is ~100 fp32 ulps (1.3e-6 measured); the aux term's share of a
                # gradient is ~1e-3, a wrong expert or scale O(1)
                err = ((p.grad - theirs[name]).norm() / theirs[name].norm()).item()
                assert err <= 1e-5, f"step {step}: gradient of {name} off by {err:.2e} of its norm"
        opt_ours.step()
        opt_peft.step()
    theirs, off_diagonal = peft_as_ours(peft, a, r)
    assert all(t.abs().max() == 0 for t in off_diagonal)
    for name, want in theirs.items():
        got = dict(ours.named_parameters())[name]
        # five steps of gradients equal to 1e-5 of their norm, each update rounded once per element (eps/2 of the
        # weight): the adapters agree to 1e-5 of how far they moved plus 5 eps of their size
        bound = 1e-5 * (got - start[name]).norm() + 5 * torch.finfo(torch.float32).eps * want.norm()
        assert (got - want).norm() <= bound, (name, (got - want).norm().item(), bound.item())


# --- decoding -------------------------------------------------------------------------------------
def test_generate_from_the_cache_equals_recompute():
    from atelier_studio.designer.generate import generate, generate_greedy_ref

    model = random_moe(7).eval()
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, V, (n,), generator=g).tolist() for n in (9, 4, 13)]
    got = generate(model, None, prompts, max_new_tokens=10, eos_token_id=[], batch_size=3)  # left-padded batch
    assert got == [generate_greedy_ref(model, p, 10) for p in prompts]


# --- through the CLI ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def moe_world(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("moe")
    assert main(["data", "tokenizer", "--corpus", str(FIXTURE), "--vocab-size", "400", "--out", str(d / "tok")]) == 0
    assert main(["designer", "init", "--size", "qwen3-moe-tiny", "--tokenizer", str(d / "tok"), "--out",
                 str(d / "model"), "--dtype", "float32"]) == 0
    return d


def test_init_writes_what_transformers_loads_and_streams_init_weights(moe_world):
    cfg = json.loads((moe_world / "model" / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    ours, hf = load_pretrained(moe_world / "model"), load_hf(moe_world / "model")
    ids = torch.randint(0, cfg["vocab_size"], (1, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert rel_err(ours.logits(run_rows(ours, ids)), hf(input_ids=ids).logits) <= 1e-5
    ref = Qwen3Moe(ours.args).init_weights(0)  # the same draws, streamed per expert to disk
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), ref.state_dict().values()))
    again = init_random("qwen3-moe-tiny", moe_world / "tok", moe_world / "again", seed=0, dtype=torch.float32,
                        max_shard_bytes=60_000)
    assert all(torch.equal(a, b)
               for a, b in zip(ours.state_dict().values(), load_pretrained(again).state_dict().values()))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["lora", "full"])
def test_train_then_generate_through_the_cli(moe_world, tmp_path, mode):
    from peft import PeftModel

    from atelier_studio.data.chat import prompt_ids
    from atelier_studio.designer.captions import load_designer

    from tests.designer.test_train import train_args, train_losses

    out = tmp_path / mode
    extra = {"lora": ["--set", "lora.rank=8", "--set", "train.lr=1e-2"],
             "full": ["--set", "lora.rank=0", "--set", "train.lr=3e-3"]}[mode]
    assert main(train_args(moe_world, out, *extra, "--set", "train.max_steps=30", "--set", "train.warmup_steps=2",
                           "--set", "train.eval_every=0", "--set", "train.save_every=15")) == 0
    losses = [l for _, l in train_losses(out)]
    # it learns. LoRA on a frozen random base moves slower (the embedding and head are not trained), and more so on
    # the MoE than on a dense model: each expert's adapter sees only the quarter of the tokens routed to it (0.94
    # measured after 30 steps, against 0.92 and below for the dense families)
    assert sum(losses[-4:]) / 4 < (0.8 if mode == "full" else 0.96) * sum(losses[:4]) / 4, losses
    exported = out / ("model" if mode == "full" else "adapter")
    ours, tok = load_designer(exported, torch.device("cpu"))
    assert type(ours) is Qwen3Moe
    briefs = [json.loads(line)["brief"] for line in FIXTURE.read_text().splitlines() if "brief" in json.loads(line)][:3]
    rows = [prompt_ids(tok, b) for b in briefs]
    n = min(map(len, rows))
    ids = torch.tensor([r[:n] for r in rows])
    with torch.no_grad():
        want = ours.eval().logits(run_rows(ours, ids))
    hf = load_hf(exported) if mode == "full" else PeftModel.from_pretrained(load_hf(moe_world / "model"),
                                                                            str(exported))
    with torch.no_grad():
        assert rel_err(hf.eval()(input_ids=ids).logits, want) <= 1e-5  # the trained weights, fp32 both sides
    (tmp_path / "briefs.txt").write_text("".join(b + "\n" for b in briefs))
    assert main(["designer", "generate", "--model", str(exported), "--briefs", str(tmp_path / "briefs.txt"),
                 "--out", str(tmp_path / "captions.jsonl"), "--max-new-tokens", "8"]) == 0
    assert len((tmp_path / "captions.jsonl").read_text().splitlines()) == len(briefs)


@pytest.mark.multigpu
@pytest.mark.slow
def test_expert_parallel_two_processes_equal_one(moe_world, tmp_path):
    """Experts sharded over 2 gloo processes (4 of each layer's 8 per rank), tokens exchanged by all-to-all, the rest
    FSDP2, each rank reading only its experts' rows of the per-expert safetensors: the same losses and exports as
    one process on the same global batch, with LoRA on every expert (and activation checkpointing: the recompute in
    the backward exchanges again, in the same order on every rank) and with full fine-tuning; and plain FSDP2 (the
    experts sharded and all-gathered like any weight) the same for LoRA.

    The load-balancing loss is off here: it is a product of batch means, so each rank's term over its own rows
    (what data parallelism computes, in transformers as here) is not the term over both ranks' rows; every other
    part of the loss is a sum, and the bounds are tests/designer/test_distributed.py's. Full fine-tuning runs at lr
    1e-4: at 1e-3 (that file's rate) the two runs drifted to 2.2e-5 apart by step 4 (Adam steps a coordinate whose
    gradient is rounding noise by up to lr, that docstring explains; the MoE has more of them than the dense model:
    the router and the experts a token barely uses), while LoRA stays at 2.4e-7."""
    from tests.designer.test_distributed import (
        FULL,
        LORA,
        args,
        assert_same_losses,
        assert_same_safetensors,
        launch_two,
    )

    common = ("--set", "model.router_aux_loss=off")
    full = (*FULL, "--set", "train.lr=1e-4")
    ep = ("--set", "train.micro_batch=1", "--set", "train.distributed.expert_parallel=2")
    two = tmp_path / "two"
    launch_two({"lora": args(moe_world, two / "lora", *LORA, *common, *ep,  # recomputed blocks exchange again
                             "--set", "train.distributed.activation_checkpointing=full"),
                "full": args(moe_world, two / "full", *full, *common, *ep),
                "lora_fsdp": args(moe_world, two / "lora_fsdp", *LORA, *common, "--set", "train.micro_batch=1")},
               tmp_path)
    for mode, extra, file in (("lora", LORA, "adapter/adapter_model.safetensors"),
                              ("full", full, "model/model.safetensors")):
        one = tmp_path / f"{mode}-one"
        assert main(args(moe_world, one, *extra, *common, "--set", "train.micro_batch=2")) == 0
        assert_same_losses(one, two / mode, range(1, 5))
        assert_same_safetensors(one / file, two / mode / file)
        if mode == "lora":
            assert_same_losses(one, two / "lora_fsdp", range(1, 5))
            assert_same_safetensors(one / file, two / "lora_fsdp" / file)


# --- kernels on == off, compiled blocks on the GPU -------------------------------------------------
def test_kernels_on_equals_kernels_off(monkeypatch):
    """Qwen3MoeArgs.kernels reaches the MoE block: the Triton dispatch / combine and the grouped GEMMs (CPU: Triton's
    interpreter, torch._grouped_mm or the per-expert loop) give the reference's packed loss and gradients in fp32,
    adapters on every expert included. Both are the same math in other orders (test_moe.py's bounds: rounding
    through the layers, 1e-5 of the loss, 1e-4 of each gradient's scale)."""
    import dataclasses

    import atelier_studio.kernels.moe as moe_kernels

    launched = {}
    for name in ("moe_gather_sum", "moe_scatter"):
        real = getattr(moe_kernels, name)
        monkeypatch.setattr(moe_kernels, name, lambda *a, _r=real, _k=name: launched.update({_k: 1}) or _r(*a))
    ref = random_moe(6)
    apply_lora(ref, LoraArgs(rank=4, alpha=8.0))
    randomise_adapters(ref, 7)
    ids = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(10), torch.arange(14)]).repeat(2, 1)
    cu = torch.tensor([0, 10, 24, 34, 48], dtype=torch.int32)
    runs = []
    for kernels in ("ref", "triton"):
        model = apply_lora(Qwen3Moe(dataclasses.replace(ref.args, kernels=kernels)), LoraArgs(rank=4, alpha=8.0))
        model.load_state_dict(ref.state_dict())
        hidden = model(ids, pos, cu, 14).reshape(-1, ref.args.dim)
        loss = linear_cross_entropy(hidden, model.lm_head_weight, ids.reshape(-1), impl="torch")
        loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    (l_ref, g_ref), (l_tri, g_tri) = runs
    assert set(launched) == {"moe_gather_sum", "moe_scatter"}, launched
    assert abs(l_tri - l_ref) <= 1e-5 * abs(l_ref)
    assert any("lora_adapters" in n for n in g_ref)
    for n, g in g_ref.items():
        assert rel_err(g_tri[n], g) <= 1e-4, n


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_blocks_match_eager_on_the_gpu():
    """The bench's configuration at tiny size: bf16 base, LoRA on every expert, per-block torch.compile around the
    Triton dispatch / combine (custom ops) and torch._grouped_mm: the eager loss and adapter gradients, within bf16
    (norm-relative 2e-2: a few bf16 roundings, 2^-9 each; a wrong graph is O(1))."""
    model = random_moe(9, dim=128, num_heads=4, head_dim=32, moe_ffn_dim=64)  # 16-byte rows for the grouped GEMMs
    apply_lora(model, LoraArgs(rank=8, alpha=16.0))
    randomise_adapters(model, 10)
    assert_compiled_blocks_give_the_eager_gradients(model.cuda().to(torch.bfloat16))


def assert_compiled_blocks_give_the_eager_gradients(model) -> None:
    """A CUDA model and its per-block compiled copy on two packed rows: the adapter gradients within bf16
    (norm-relative 2e-2: a few bf16 roundings, 2^-9 each; a wrong graph is O(1))."""
    import copy

    from atelier_studio.pipeline.policies import compile_blocks

    compiled = compile_blocks(copy.deepcopy(model))
    ids = torch.randint(0, model.args.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1)).cuda()
    pos = torch.arange(64).repeat(2, 1).cuda()
    cu = torch.tensor([0, 64, 128], dtype=torch.int32).cuda()
    grads = []
    for m in (model, compiled):
        m(ids, pos, cu, 64).float().pow(2).mean().backward()
        grads.append({n: p.grad.float() for n, p in m.named_parameters() if p.requires_grad})
    assert any("lora_adapters" in n for n in grads[0])
    for n, want in grads[0].items():
        err = ((grads[1][n] - want).norm() / want.norm()).item()
        assert err <= 2e-2, (n, err)
