"""pipeline/policies.py: every policy leaves outputs and gradients equal to the plain model (fp32, CPU)."""

from __future__ import annotations

import copy

import pytest
import torch

from atelier_studio.designer.lora import LoraArgs, apply_lora
from atelier_studio.designer.qwen3 import Qwen3, Qwen3Args
from atelier_studio.imagegen.model import MMDiT, MMDiTArgs
from atelier_studio.pipeline.policies import (
    apply_activation_checkpointing,
    compile_blocks,
    cpu_offload,
    model_blocks,
)

TINY = Qwen3Args.from_size("tiny", vocab_size=97, attention_impl="sdpa", tie_embeddings=False)
MMDIT_TINY = MMDiTArgs(num_layers=2, num_heads=2, head_dim=16, joint_attention_dim=24, caption_projection_dim=32,
                       pooled_projection_dim=20, sample_size=16, pos_embed_max_size=16)


def designer(lora: bool) -> Qwen3:
    model = Qwen3(TINY).init_weights(seed=3)
    with torch.no_grad():  # norms start at ones: perturb them so a wrong recompute of a norm shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    if lora:
        apply_lora(model, LoraArgs(rank=4, alpha=8.0))
        with torch.no_grad():  # B starts at zero: make the adapter matter
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.1)
    return model


def packed_batch(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Two rows of 24 tokens, documents of 5, 11, 8 | 17, 7 tokens."""
    g = torch.Generator().manual_seed(seed)
    lens = [[5, 11, 8], [17, 7]]
    ids = torch.randint(0, TINY.vocab_size, (2, 24), generator=g)
    pos = torch.cat([torch.cat([torch.arange(n) for n in row]) for row in lens]).view(2, 24)
    bounds = torch.tensor([0, 5, 16, 24, 41, 48], dtype=torch.int32)
    return ids, pos, bounds


def designer_loss(model: Qwen3, seed: int = 0) -> torch.Tensor:
    ids, pos, cu = packed_batch(seed)
    h = model(ids, pos, cu, 17)
    target = torch.randn(h.shape, generator=torch.Generator().manual_seed(seed + 1))
    return (h * target).sum() + model.logits(h).logsumexp(-1).sum()


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # parameters the loss does not reach (MMDiT's last block has no text output) have no grad on either side
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def run(model: torch.nn.Module, loss_fn, offload: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with cpu_offload(enabled=offload):
        loss = loss_fn(model)
        loss.backward()
    return loss.detach(), grads(model)


def assert_same(a: tuple, b: tuple, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    torch.testing.assert_close(a[0], b[0], rtol=rtol, atol=atol)
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_is_exact(mode, lora):
    plain = designer(lora)
    policy = apply_activation_checkpointing(copy.deepcopy(plain), mode)
    assert all(getattr(b, "_atelier_ac") == mode for b in model_blocks(policy))
    assert policy.state_dict().keys() == plain.state_dict().keys()  # no wrapper prefixes
    assert_same(run(policy, designer_loss), run(plain, designer_loss))


def test_selective_checkpointing_saves_less_than_none_and_more_than_full():
    """Bytes saved for backward: full AC < selective < no AC (the policy really changes what is kept)."""

    def saved_bytes(mode: str) -> int:
        model = apply_activation_checkpointing(designer(False), mode)
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            if not isinstance(t, torch.nn.Parameter) and t.requires_grad is not None:
                total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            designer_loss(model)
        return total

    none, selective, full = saved_bytes("none"), saved_bytes("selective"), saved_bytes("full")
    assert full < selective < none, (full, selective, none)


def test_cpu_offload_is_exact():
    plain = designer(True)
    assert_same(run(copy.deepcopy(plain), designer_loss, offload=True), run(plain, designer_loss))


def test_compile_blocks_is_exact():
    import torch._dynamo

    torch._dynamo.reset()
    plain = designer(True)
    policy = compile_blocks(apply_activation_checkpointing(copy.deepcopy(plain), "selective"))
    assert policy.state_dict().keys() == plain.state_dict().keys()  # no `_orig_mod.` prefix
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in model_blocks(policy))
    want = run(plain, designer_loss)
    assert_same(run(policy, designer_loss), want, rtol=1e-4, atol=1e-5)
    assert_same(run(policy, designer_loss), want, rtol=1e-4, atol=1e-5)  # second call: the cached graphs


def mmdit() -> MMDiT:
    torch.manual_seed(0)
    model = MMDiT(MMDIT_TINY)
    with torch.no_grad():  # AdaLN-Zero starts at zero: make every parameter matter
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def mmdit_loss(model: MMDiT) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    a = MMDIT_TINY
    x = (torch.randn(2, a.in_channels, 8, 12, generator=g), torch.randn(2, 5, a.joint_attention_dim, generator=g),
         torch.randn(2, a.pooled_projection_dim, generator=g), torch.rand(2, generator=g) * 1000)
    return (model(*x) * torch.randn(2, a.out_channels, 8, 12, generator=g)).sum()


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_mmdit_activation_checkpointing_is_exact(mode):
    plain = mmdit()
    policy = apply_activation_checkpointing(copy.deepcopy(plain), mode)
    assert model_blocks(policy) is policy.transformer_blocks
    assert_same(run(policy, mmdit_loss), run(plain, mmdit_loss))


def test_model_blocks_finds_hf_and_peft_layers():
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    hf = Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in TINY.to_hf_config().items()
                                         if k not in ("architectures", "torch_dtype", "dtype")}))
    assert model_blocks(hf) is hf.model.layers
    peft = get_peft_model(hf, LoraConfig(r=4, target_modules=["q_proj"]))
    assert model_blocks(peft) is hf.model.layers


def test_bad_requests_say_what():
    with pytest.raises(ValueError, match="mode must be one of"):
        apply_activation_checkpointing(designer(False), "some")
    model = apply_activation_checkpointing(designer(False), "full")
    with pytest.raises(ValueError, match="block 0 is already checkpointed"):
        apply_activation_checkpointing(model, "selective")
    with pytest.raises(ValueError, match="already compiled"):
        apply_activation_checkpointing(compile_blocks(designer(False)), "full")
    with pytest.raises(TypeError, match="Linear has no `model.layers`"):
        model_blocks(torch.nn.Linear(2, 2))
