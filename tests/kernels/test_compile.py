"""Kernels inside per-block torch.compile: a compiled designer trains exactly like the eager reference (GPU)."""

from __future__ import annotations

import copy

import pytest
import torch

from designer.lora import LoraArgs, apply_lora
from designer.model import ModelArgs, Qwen3
from pipeline.policies import compile_blocks

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_blocks_give_the_eager_gradients():
    torch.manual_seed(0)
    args = ModelArgs.from_size("tiny", vocab_size=512, dim=256, head_dim=64, ffn_dim=512)
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
