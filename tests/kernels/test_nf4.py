"""kernels/nf4.py: the quantiser equals torchao's to_nf4 bit for bit (its stored output, and torchao itself where
installed), ragged groups and expert stacks, the error bound holds (and catches a wrong level), all-zero blocks and
equal block maxima."""
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from atelier_studio.kernels.nf4 import (
    BLOCK,
    NF4Weight,
    dequantize_nf4,
    nf4_error_bound,
    nf4_from_torchao,
    nf4_shapes,
    quantize_nf4,
)

FIELDS = ("data", "scalers", "factor", "mean", "code")
# torchao 0.18.0's to_nf4(w, 64, 256) of a 64 x 512 weight (512 blocks: two groups) in bf16 and fp32, with the weight
# and torchao's dequantisation: NF4Tensor's tensors under their own names. The suite does not install torchao
# (diffusers imports whatever torchao it finds and warns on stderr when the versions disagree), so its output is
# kept here; test_quantize_equals_torchao_bit_for_bit compares against torchao itself where it is installed.
TORCHAO = Path(__file__).parents[1] / "fixtures" / "nf4" / "torchao-0.18.0.safetensors"


def torchao_fixture(dtype_name: str) -> tuple[torch.Tensor, NF4Weight, torch.Tensor]:
    """(the weight, torchao's NF4 tensors as an NF4Weight, torchao's dequantised weight) from TORCHAO."""
    t = {k.split(".", 1)[1]: v for k, v in load_file(str(TORCHAO)).items() if k.startswith(dtype_name + ".")}
    o, i = t["weight"].shape
    w = NF4Weight(t["quantized_data"].view(o, i // 2), t["quantized_scalers"].view(o, i // BLOCK),
                  t["quantization_factor"], t["scaler_mean"].view(()), t["nf4"])
    return t["weight"], w, t["dequantized"]


def _weight(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 0.02).to(dtype)


def torchao_nf4():
    """torchao's NF4Tensor module (its path in recent releases, or the older torchao.dtypes.nf4tensor); skips without
    it."""
    pytest.importorskip("torchao")
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError:
        from torchao.dtypes import nf4tensor as nf4_tensor
    return nf4_tensor


@pytest.mark.parametrize("dtype_name", ["bf16", "fp32"])
def test_quantize_equals_torchaos_stored_output_bit_for_bit(dtype_name):
    """Every tensor and the dequantised weight equal what torchao 0.18.0 made of the same weight: the same
    operations in the same dtype, so exact (atol = rtol = 0)."""
    weight, theirs, their_weight = torchao_fixture(dtype_name)
    ours = quantize_nf4(weight)
    for f in FIELDS:
        a, b = getattr(ours, f), getattr(theirs, f)
        assert a.dtype == b.dtype and a.shape == b.shape, f
        assert torch.equal(a, b), f"{f}: {int((a != b).sum())} of {a.numel()} differ"
    assert torch.equal(dequantize_nf4(ours), their_weight)
    assert torch.equal(dequantize_nf4(theirs), their_weight)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(128, 512), (96, 2048)])  # 4 and 12 full groups of 256 blocks
def test_quantize_equals_torchao_bit_for_bit(dtype, shape):
    """Every tensor and the dequantised weight equal torchao's NF4Tensor of the same weight: the same operations in
    the same dtype, so exact (atol = rtol = 0)."""
    nf4_tensor = torchao_nf4()
    w = _weight(shape, dtype, seed=shape[0])
    theirs = nf4_tensor.to_nf4(w, block_size=64, scaler_block_size=256)
    ours, viewed = quantize_nf4(w), nf4_from_torchao(theirs)
    for f in FIELDS:
        a, b = getattr(ours, f), getattr(viewed, f)
        assert a.dtype == b.dtype and a.shape == b.shape, f
        assert torch.equal(a, b), f"{f}: {int((a != b).sum())} of {a.numel()} differ"
    assert torch.equal(dequantize_nf4(ours), theirs.get_original_weight())


def test_ragged_groups_and_expert_stacks():
    """Sizes torchao refuses (here 120 blocks per matrix: one group of fewer than 256) quantise, each expert of a
    stack on its own: the stack's expert e is exactly quantize_nf4 of that expert's matrix."""
    w = _weight((3, 40, 192), torch.float32, seed=1)
    q = quantize_nf4(w)
    assert q.shape == (3, 40, 192) and q.factor.shape == (3, 1) and q.mean.shape == (3,)
    assert {f: tuple(getattr(q, f).shape) for f in FIELDS} == nf4_shapes((3, 40, 192))
    deq = dequantize_nf4(q)
    for e in range(3):
        alone = quantize_nf4(w[e])
        for f in FIELDS:
            assert torch.equal(getattr(q[e], f), getattr(alone, f)), (e, f)
        assert torch.equal(deq[e], dequantize_nf4(alone))
    with pytest.raises(IndexError, match="no leading expert"):
        alone[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_error_bound_holds_is_tight_and_catches_a_wrong_level(dtype):
    """|W − Ŵ| ≤ nf4_error_bound everywhere (the derivation is in its docstring); the largest ratio is above 0.6,
    so the bound says something; moving one element's code index to the opposite end of the table breaks it."""
    w = _weight((64, 1024), dtype, seed=2) * torch.linspace(0.1, 3.0, 64)[:, None].to(dtype)  # scales vary by row
    q = quantize_nf4(w)
    err = (w.double() - dequantize_nf4(q).double()).abs()
    bound = nf4_error_bound(q, w)
    ratio = (err / bound).max().item()
    assert ratio <= 1.0, f"error {ratio:.3f}× the bound"
    assert ratio > 0.6, f"bound {1 / ratio:.1f}× the largest error: too loose to catch anything"
    data = q.data.clone()
    row, col = torch.nonzero(w.abs() == w.abs().max())[0].tolist()  # the largest element: level ±1
    byte, shift = col // 2, 4 if col % 2 == 0 else 0
    idx = (int(data[row, byte]) >> shift) & 15
    flipped = 15 - idx  # the opposite sign's extreme level
    data[row, byte] = (int(data[row, byte]) & ~(15 << shift)) | (flipped << shift)
    wrong = NF4Weight(data, q.scalers, q.factor, q.mean, q.code)
    assert ((w.double() - dequantize_nf4(wrong).double()).abs() > bound).any()


def test_zero_blocks_and_equal_block_maxima_quantise_exactly():
    """An all-zero block dequantises to zeros (torchao would divide 0 by 0), the blocks around it as usual; a
    weight of ±1 has every block maximum equal (every centred scaler 0, a group factor of 1) and round-trips
    exactly (its values are the levels ±1)."""
    w = _weight((8, 256), torch.float32, seed=3)
    w[2, 64:128] = 0.0
    deq = dequantize_nf4(quantize_nf4(w))
    assert torch.equal(deq[2, 64:128], torch.zeros(64))
    assert ((w - deq).abs() <= nf4_error_bound(quantize_nf4(w), w)).all()
    signs = torch.randint(0, 2, (16, 128), generator=torch.Generator().manual_seed(4)).float() * 2 - 1
    q = quantize_nf4(signs)
    assert torch.equal(q.factor, torch.ones_like(q.factor))
    assert torch.equal(dequantize_nf4(q), signs)


def test_shapes_outside_the_format_are_refused():
    with pytest.raises(ValueError, match=f"not a multiple of {BLOCK}"):
        quantize_nf4(torch.randn(4, 96))
    with pytest.raises(ValueError, match="expected a float weight"):
        quantize_nf4(torch.ones(64, dtype=torch.int32))
