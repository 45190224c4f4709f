"""FP8 modules and the policy: Float8Linear and Float8LoRALinear keep the layer's Parameters and state dict, compute
what kernels.fp8_linear computes, rebuild their frozen fp8 copies on load; apply_fp8 swaps what it should; the
models' shared-input projections run as FP8 groups with the members' outputs and gradients; the precision checks
name `train.precision`."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import atelier_studio.kernels.fp8_group as fp8_group
import atelier_studio.kernels.fp8_linear as fp8
import atelier_studio.pipeline.float8 as float8
import atelier_studio.pipeline.shared_input as shared_input
from atelier_studio.designer.lora import LoraArgs, LoRALinear, apply_lora, lora_state_dict
from atelier_studio.designer.qwen3 import Qwen3, Qwen3Args
from atelier_studio.imagegen.model import FAMILY as MMDIT_FAMILY
from atelier_studio.imagegen.model import MMDiT, MMDiTArgs
from atelier_studio.kernels.fp8_linear import fp8_frozen_linear, fp8_linear, fp8_lora_linear_ref, quantize_frozen_weight
from atelier_studio.pipeline.config import ConfigError, TrainConfig
from atelier_studio.pipeline.float8 import Float8Linear, apply_precision, check_precision
from atelier_studio.pipeline.lora_fp8 import FP8_CONVERSIONS, Float8LoRALinear


def apply_fp8(model: nn.Module, recipe: str, skip: tuple[str, ...] = (), impl: str = "auto") -> list[str]:
    """pipeline.float8.apply_fp8 with the designer's LoRA conversion, as designer/task.py calls it."""
    return float8.apply_fp8(model, recipe, skip, impl, conversions=FP8_CONVERSIONS)


def _tiny_qwen3(tie: bool = False) -> Qwen3:
    torch.manual_seed(0)
    return Qwen3(Qwen3Args(vocab_size=96, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, ffn_dim=128,
                           tie_embeddings=tie, kernels="ref", attention_impl="sdpa"))


def test_float8_linear_is_the_same_layer():
    """Same Parameter objects, same state dict (keys and tensors), every attribute of the nn.Linear."""
    lin = nn.Linear(32, 48)
    f = Float8Linear.from_linear(lin, "rowwise")
    assert isinstance(f, nn.Linear) and f.weight is lin.weight and f.bias is lin.bias
    assert set(vars(lin)) <= set(vars(f))
    sd, ref = f.state_dict(), lin.state_dict()
    assert list(sd) == list(ref) and all(torch.equal(sd[k], ref[k]) for k in sd)
    x = torch.randn(5, 32)
    assert torch.equal(f(x), fp8_linear(x, lin.weight, lin.bias, "rowwise"))


@pytest.mark.parametrize("impl", ["scaled_mm", "ref"])
def test_frozen_float8_linear_rebuilds_its_copies_on_load(impl):
    """A frozen Float8Linear computes fp8_frozen_linear; its fp8 copies are not in the state dict and follow a
    load_state_dict of new weights."""
    lin = nn.Linear(32, 48).requires_grad_(False)
    f = Float8Linear.from_linear(lin, "tensorwise", impl)
    x = torch.randn(7, 32)
    want = fp8_frozen_linear(x, lin.weight, lin.bias, quantize_frozen_weight(lin.weight, "tensorwise"), "tensorwise",
                             impl)
    assert torch.equal(f(x), want)
    assert set(f.state_dict()) == {"weight", "bias"}
    new = {"weight": torch.randn(48, 32), "bias": torch.randn(48)}
    f.load_state_dict(new)
    want = fp8_frozen_linear(x, new["weight"], new["bias"], quantize_frozen_weight(new["weight"], "tensorwise"),
                             "tensorwise", impl)
    assert torch.equal(f(x), want)


def test_float8_lora_linear_keeps_the_lora_layer():
    """Float8LoRALinear: the LoRALinear's submodules and attributes, its PEFT state-dict keys, the fp8 copies made
    at once where the fast path reads them (and rebuilt by load_state_dict) and never on the CPU's reference path,
    and the reference's output and adapter gradients."""
    base = nn.Linear(64, 48).requires_grad_(False)
    lora = LoRALinear(base, LoraArgs(rank=4, alpha=8.0))
    nn.init.normal_(lora.lora_B.weight)
    f = Float8LoRALinear.from_lora(lora, "rowwise")
    assert set(vars(lora)) <= set(vars(f)) and f.base_layer is base and f.lora_A is lora.lora_A
    assert list(f.state_dict()) == list(lora.state_dict())
    assert f.fp8_q is None and f.fp8_weight() is None  # "auto" on a CPU: the reference path, no Triton pass
    g = Float8LoRALinear.from_lora(LoRALinear(nn.Linear(64, 48, bias=False), LoraArgs(rank=4), impl="fused"),
                                   "tensorwise")
    ops = g.shared_input_operands()  # no bias, no dropout, the fast path: it joins an FP8 group, with its fp8 copies
    assert ops.fp8.q is g.fp8_q and ops.fp8.recipe == "tensorwise" and ops.impl == "scaled_mm"
    assert ops.lora_a is g.lora_A.weight
    sd = {k: v.clone() for k, v in g.state_dict().items()}
    sd["base_layer.weight"] = torch.randn(48, 64)
    g.load_state_dict(sd)
    assert torch.equal(g.fp8_q.float(), quantize_frozen_weight(sd["base_layer.weight"], "tensorwise").q.float())
    x = torch.randn(3, 5, 64)
    y = f(x)
    y.square().sum().backward()
    grads = [lora.lora_A.weight.grad.clone(), lora.lora_B.weight.grad.clone()]
    for p in (lora.lora_A.weight, lora.lora_B.weight):
        p.grad = None
    want = fp8_lora_linear_ref(x.reshape(15, 64), base.weight, base.bias, lora.lora_A.weight, lora.lora_B.weight,
                               lora.scale).view(3, 5, 48)
    want.square().sum().backward()
    assert torch.equal(y, want)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, (lora.lora_A.weight, lora.lora_B.weight)))
    assert base.weight.grad is None


def test_apply_fp8_full_finetune_swaps_every_block_linear():
    model = _tiny_qwen3()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    names = apply_fp8(model, "rowwise")
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert names == [n for n in linears if n != "lm_head"] and len(names) == 2 * 7
    assert all(isinstance(model.get_submodule(n), Float8Linear) for n in names)
    assert type(model.lm_head) is nn.Linear
    assert all(params[k] is p for k, p in model.named_parameters())  # the optimizer's Parameters stay valid
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert apply_fp8(model, "rowwise") == []  # idempotent


def test_apply_fp8_lora_swaps_bases_not_adapters():
    """LoRA on q and v only: those become Float8LoRALinear (their adapters stay nn.Linear), the other block
    linears frozen Float8Linear; the adapter state dict (PEFT keys) is unchanged."""
    model = _tiny_qwen3()
    apply_lora(model, LoraArgs(rank=4, targets=("q", "v")))
    adapters = {k: v.clone() for k, v in lora_state_dict(model).items()}
    apply_fp8(model, "tensorwise")
    loras = [m for m in model.modules() if isinstance(m, LoRALinear)]
    assert len(loras) == 4 and all(type(m) is Float8LoRALinear for m in loras)
    assert all(type(m.lora_A) is nn.Linear and type(m.lora_B) is nn.Linear and type(m.base_layer) is nn.Linear
               for m in loras)
    o_proj = model.model.layers[0].self_attn.o_proj
    assert type(o_proj) is Float8Linear and not o_proj.weight.requires_grad
    now = lora_state_dict(model)
    assert list(now) == list(adapters) and all(torch.equal(now[k], adapters[k]) for k in now)


def test_fp8_lora_model_step_runs_and_repeats():
    """One LoRA step through the swapped tiny Qwen3 on CPU: a finite loss and non-zero adapter gradients, the same
    bits in a second identical run (the CPU path is deterministic, which exact resume relies on)."""
    losses, grads = [], []
    for _ in range(2):
        model = _tiny_qwen3()
        apply_lora(model, LoraArgs(rank=4))
        for m in model.modules():
            if isinstance(m, LoRALinear):
                nn.init.normal_(m.lora_B.weight, std=0.02)
        apply_fp8(model, "rowwise")
        ids = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(1))
        pos = torch.arange(16)[None]
        cu = torch.tensor([0, 16], dtype=torch.int32)
        hidden = model(ids, pos, cu, 16)
        loss = nn.functional.cross_entropy((hidden @ model.lm_head_weight.t())[0, :-1], ids[0, 1:])
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten() for n, p in model.named_parameters() if p.requires_grad]))
    assert losses[0] == losses[1] and torch.isfinite(torch.tensor(losses)).all()
    assert torch.equal(grads[0], grads[1]) and grads[0].abs().sum() > 0


def test_apply_fp8_imagegen_skips_the_per_image_linears():
    """The imagegen task's skip list: the blocks' projections and the caption projection swap, the per-image
    linears and the final projection stay. With every weight random (no AdaLN-Zero), the output moves by about the
    fp8 rounding: not at all would mean nothing was quantised, a lot would mean a wrong GEMM."""
    torch.manual_seed(0)
    model = MMDiT(MMDiTArgs(kernels="ref"))
    for p in model.parameters():
        nn.init.normal_(p, std=0.2)
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randn(1, 16, 8, 8, generator=g), torch.randn(1, 5, 48, generator=g),
              torch.randn(1, 40, generator=g), torch.tensor([500.0]))
    with torch.no_grad():
        before = model(*inputs)
    names = apply_fp8(model, "rowwise", MMDIT_FAMILY.fp8_skip)
    with torch.no_grad():
        rel = ((model(*inputs) - before).norm() / before.norm()).item()
    assert 2.0**-10 < rel < 2.0**-2, rel
    kept = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    assert "context_embedder" in names and "transformer_blocks.0.attn.to_q" in names
    assert "transformer_blocks.1.ff.net.2" in names and "transformer_blocks.0.attn.add_k_proj" in names
    assert sorted(kept) == sorted(["time_text_embed.timestep_embedder.linear_1",
                                   "time_text_embed.timestep_embedder.linear_2",
                                   "time_text_embed.text_embedder.linear_1", "time_text_embed.text_embedder.linear_2",
                                   "transformer_blocks.0.norm1.linear", "transformer_blocks.0.norm1_context.linear",
                                   "transformer_blocks.1.norm1.linear", "transformer_blocks.1.norm1_context.linear",
                                   "norm_out.linear", "proj_out"])


def test_precision_bf16_changes_nothing():
    model = _tiny_qwen3()
    assert apply_precision(model, TrainConfig()) == []
    assert not any(isinstance(m, Float8Linear) for m in model.modules())
    check_precision(TrainConfig(), torch.device("cpu"), distributed=True)


def test_precision_fp8_refusals_name_the_key(monkeypatch):
    cfg = TrainConfig(precision="fp8")
    with pytest.raises(ConfigError, match=r'train\.precision = "fp8" with LoRA runs on one process.*lora\.rank = 0'):
        check_precision(cfg, torch.device("cpu"), distributed=True, frozen_bases=True)
    check_precision(cfg, torch.device("cpu"), distributed=True)  # full fine-tuning runs under FSDP2
    fp8._capability.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 6))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA RTX A6000")
    try:
        with pytest.raises(ConfigError, match=r'train\.precision = "fp8".*cuda:1 \(NVIDIA RTX A6000\).*8\.6'):
            check_precision(cfg, torch.device("cuda:1"), distributed=False)
    finally:
        fp8._capability.cache_clear()
    check_precision(cfg, torch.device("cpu"), distributed=False)
    with pytest.raises(ConfigError, match="no linear"):
        apply_precision(nn.Sequential(nn.LayerNorm(4)), cfg)


def test_compiled_fp8_modules_equal_eager():
    """torch.compile(fullgraph=True) of each FP8 module runs the same custom ops (opaque to the compiler), so its
    output and every gradient equal eager's bit for bit: trainable, frozen, and LoRA over a tensorwise base."""
    torch.manual_seed(0)
    lora = LoRALinear(nn.Linear(32, 48), LoraArgs(rank=4), impl="fused")
    nn.init.normal_(lora.lora_B.weight)
    modules = [Float8Linear.from_linear(nn.Linear(32, 48), "rowwise", impl="scaled_mm"),
               Float8Linear.from_linear(nn.Linear(32, 48).requires_grad_(False), "tensorwise", impl="scaled_mm"),
               Float8LoRALinear.from_lora(lora, "tensorwise")]
    x = torch.randn(19, 32)
    for mod in modules:
        outs = []
        for fn in (mod, torch.compile(mod, fullgraph=True)):
            xx = x.clone().requires_grad_()
            y = fn(xx)
            y.square().sum().backward()
            outs.append([y.detach(), xx.grad] + [p.grad for p in mod.parameters() if p.requires_grad])
            for p in mod.parameters():
                p.grad = None
        assert all(torch.equal(a, b) for a, b in zip(*outs)), type(mod).__name__


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_leaves_fp8_gradients_unchanged(mode):
    """FP8 first, then activation checkpointing (the trainers' order): recomputing a block re-quantises the same
    values, and selective AC keeps the fp8 forward ops' outputs (pipeline.policies' save list): the loss and every
    gradient equal the un-checkpointed FP8 model's bit for bit (the _scaled_mm path on CPU)."""
    from atelier_studio.pipeline.policies import _SAVE_OPS, apply_activation_checkpointing

    assert torch.ops.atelier.fp8_linear_fwd.default in _SAVE_OPS and torch.ops.atelier.fp8_lora_fwd.default in _SAVE_OPS
    results = []
    for ac in ("none", mode):
        model = _tiny_qwen3()
        apply_fp8(model, "rowwise", impl="scaled_mm")
        apply_activation_checkpointing(model, ac)
        ids = torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(2))
        hidden = model(ids, torch.arange(24)[None], torch.tensor([0, 24], dtype=torch.int32), 24)
        loss = nn.functional.cross_entropy((hidden @ model.lm_head_weight.t())[0, :-1], ids[0, 1:])
        loss.backward()
        results.append([loss.detach()] + [p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def _count_applies(monkeypatch, cls) -> list[int]:
    calls = []
    real = cls.apply

    def counting(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(cls, "apply", counting)
    return calls


def _qwen3_step(lora: bool) -> list[torch.Tensor]:
    """One fp32 forward + backward of the tiny Qwen3 in FP8 on the _scaled_mm path: [loss, every gradient]."""
    model = _tiny_qwen3()
    if lora:
        apply_lora(model, LoraArgs(rank=4))
        for m in model.modules():
            if isinstance(m, LoRALinear):
                nn.init.normal_(m.lora_B.weight, std=0.05)
                m.impl = "fused"  # the layers' fast path (fp8: scaled_mm) on this CPU
    apply_fp8(model, "rowwise", impl="scaled_mm")
    ids = torch.randint(0, 96, (2, 19), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(19).repeat(2, 1)
    hidden = model(ids, pos, torch.tensor([0, 19, 38], dtype=torch.int32), 19)
    loss = nn.functional.cross_entropy((hidden @ model.lm_head_weight.t()).flatten(0, 1), ids.flatten())
    loss.backward()
    return [loss.detach()] + [p.grad for p in model.parameters() if p.requires_grad]


def _close_after_backward(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    """The loss bit-equal (the groups' outputs are the members' bits); each gradient within 2^-14 of its largest
    entry: the groups sum dX in another order than autograd (a few fp32 roundings of 2^-24 relative per sum),
    and the backward carries those differences through a few more fp32 GEMMs, far below this."""
    assert torch.equal(got[0], want[0]), f"{what}: loss"
    for i, (g, w) in enumerate(zip(got[1:], want[1:])):
        assert g.shape == w.shape
        assert (g - w).abs().max() <= 2.0**-14 * w.abs().max(), f"{what}: gradient {i}"


@pytest.mark.parametrize("lora", [False, True])
def test_qwen3_projections_run_as_fp8_groups(monkeypatch, lora):
    """Full fine-tuning and LoRA over FP8 bases: per block, q/k/v and gate/up run as one FP8 group each (x quantised
    once); the loss and gradients are those of the layers one by one (grouping switched off)."""
    cls = fp8_group.Fp8FrozenGroupFunction if lora else fp8_group.Float8LinearGroupFunction
    calls = _count_applies(monkeypatch, cls)
    grouped = _qwen3_step(lora)
    assert len(calls) == 2 * 2  # 2 layers × (q/k/v, gate/up)
    monkeypatch.setattr(shared_input, "float8_group", lambda x, linears: None)
    monkeypatch.setattr(shared_input, "_groupable", lambda operands: False)
    calls.clear()
    alone = _qwen3_step(lora)
    assert not calls
    _close_after_backward(grouped, alone, "lora" if lora else "full")


def test_mmdit_projections_run_as_fp8_groups(monkeypatch):
    """The MMDiT's image to_q/k/v and text add_q/k/v (add_k/v only in the last block, which drops the text queries)
    run as FP8 groups; the output and every gradient equal the layers one by one."""
    calls = _count_applies(monkeypatch, fp8_group.Float8LinearGroupFunction)

    def step():
        torch.manual_seed(0)
        model = MMDiT(MMDiTArgs(kernels="ref"))
        for p in model.parameters():
            nn.init.normal_(p, std=0.1)
        apply_fp8(model, "rowwise", MMDIT_FAMILY.fp8_skip, impl="scaled_mm")
        g = torch.Generator().manual_seed(1)
        out = model(torch.randn(2, 16, 8, 8, generator=g), torch.randn(2, 5, 48, generator=g),
                    torch.randn(2, 40, generator=g), torch.tensor([500.0, 20.0]))
        loss = out.square().mean()
        loss.backward()
        return [loss.detach()] + [p.grad for p in model.parameters() if p.grad is not None]

    grouped = step()
    assert len(calls) == 2 * 2  # 2 blocks × (image q/k/v, text q/k/v or k/v)
    monkeypatch.setattr(shared_input, "float8_group", lambda x, linears: None)
    calls.clear()
    alone = step()
    assert not calls
    _close_after_backward(grouped, alone, "mmdit")


def test_float8_group_only_groups_what_can_share():
    """Mixed recipes, trainable beside frozen, or a plain nn.Linear: no group (None), so the caller runs the layers
    one by one."""
    a, b = (Float8Linear.from_linear(nn.Linear(32, 16), "rowwise"),
            Float8Linear.from_linear(nn.Linear(32, 16), "rowwise"))
    x = torch.randn(3, 32)
    assert float8.float8_group(x, [a]) is None
    assert float8.float8_group(x, [a, Float8Linear.from_linear(nn.Linear(32, 16), "tensorwise")]) is None
    assert float8.float8_group(x, [a, Float8Linear.from_linear(nn.Linear(32, 16).requires_grad_(False),
                                                               "rowwise")]) is None
    assert float8.float8_group(x, [a, nn.Linear(32, 16)]) is None
    ys = float8.float8_group(x, [a, b])
    assert all(torch.equal(y, m(x)) for y, m in zip(ys, (a, b)))  # CPU "auto": the members' reference, one by one
    lin = nn.Linear(32, 16)
    assert all(torch.equal(y, m(x)) for y, m in zip(shared_input.shared_input_linears(x, a, lin), (a, lin)))
