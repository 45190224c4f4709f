"""Kernels inside per-block torch.compile: a compiled designer trains exactly like the eager model (CPU and GPU)."""

from __future__ import annotations

import copy

import pytest
import torch

from atelier_studio.designer.lora import LoraArgs, apply_lora
from atelier_studio.designer.qwen3 import Qwen3, Qwen3Args
from atelier_studio.pipeline.policies import compile_blocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_blocks_give_the_eager_gradients():
    torch.manual_seed(0)
    args = Qwen3Args.from_size("tiny", vocab_size=512, dim=256, head_dim=64, ffn_dim=512)
    model = Qwen3(args).cuda().to(torch.bfloat16)
    model.init_weights(0)
    apply_lora(model, LoraArgs(rank=8, alpha=16.0, dtype="bfloat16"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    compiled = copy.deepcopy(model)
    compile_blocks(compiled)
    ids = torch.randint(0, 512, (2, 256), device="cuda")
    pos = torch.arange(256, device="cuda").repeat(2, 1)
    cu = torch.tensor([0, 256, 512], dtype=torch.int32, device="cuda")
    grads = []
    for m in (model, compiled):
        h = m(ids, pos, cu, 256)
        h.float().pow(2).mean().backward()
        grads.append({n: p.grad.float() for n, p in m.named_parameters() if p.requires_grad})
    for n, g in grads[0].items():
        err = (grads[1][n] - g).norm() / g.norm().clamp_min(1e-12)
        assert err < 2e-2, f"{n}: relative gradient error {err:.3g} (compiled vs eager)"


def _tiny_lora(layers: int) -> Qwen3:
    args = Qwen3Args.from_size("tiny", vocab_size=128, num_layers=layers, kernels="triton")
    model = Qwen3(args).init_weights(0)
    apply_lora(model, LoraArgs(rank=4, alpha=8.0))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    return model


def _packed_batch():
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(20), torch.arange(12)]).repeat(2, 1)
    return ids, pos, torch.tensor([0, 20, 32, 52, 64], dtype=torch.int32), 32


def test_compiled_triton_blocks_equal_eager_and_compile_once_on_cpu():
    """CPU: the Triton kernels (interpreter) as custom ops inside Inductor-compiled blocks give the eager
    gradients exactly, and the number of compiled graphs does not grow with the number of layers."""
    from torch._dynamo.utils import counters

    graphs = {}
    for layers in (2, 4):
        torch._dynamo.reset()
        counters.clear()
        model = _tiny_lora(layers)
        compiled = copy.deepcopy(model)
        compile_blocks(compiled)
        batch = _packed_batch()
        grads = []
        for m in (model, compiled):
            m(*batch).pow(2).mean().backward()
            grads.append({n: p.grad for n, p in m.named_parameters() if p.requires_grad})
        for n, g in grads[0].items():
            torch.testing.assert_close(grads[1][n], g, rtol=1e-5, atol=1e-7, msg=lambda s: f"{n}: {s}")
        graphs[layers] = counters["stats"]["unique_graphs"]
        compiled(*batch).pow(2).mean().backward()  # a second step: nothing new to compile
        assert counters["stats"]["unique_graphs"] == graphs[layers]
    assert graphs[2] == graphs[4], graphs  # one compiled block serves every layer (no per-layer guards)
