import pytest
import torch

from atelier_studio.kernels.rope import rope, rope_cos_sin, rope_inv_freq, rope_ref

from tests.kernels._compare import assert_close, assert_error_within


def _rope_complex(x, pos, inv_freq):
    """Independent formulation: pair (x_i, x_{i+Dh/2}) is a complex number rotated by pos·inv_freq_i."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half], x[..., half:])
    rot = torch.polar(torch.ones_like(inv_freq), pos[..., None] * inv_freq)  # [N, Dh/2]
    z = z * rot[:, None, :]
    return torch.cat([z.real, z.imag], dim=-1)


@pytest.mark.parametrize("n,h,hkv,dh", [(1, 1, 1, 2), (7, 4, 2, 32), (13, 3, 1, 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_ref_matches_complex_rotation_with_grads(n, h, hkv, dh, dtype):
    g = torch.Generator().manual_seed(2)
    pos = torch.randint(0, 500, (n,), generator=g)
    q64, k64 = (torch.randn(n, h, dh, generator=g, dtype=torch.float64),
                torch.randn(n, hkv, dh, generator=g, dtype=torch.float64))
    dq, dk = (torch.randn(n, h, dh, generator=g, dtype=torch.float64),
              torch.randn(n, hkv, dh, generator=g, dtype=torch.float64))
    cos, sin = rope_cos_sin(pos, dh, 10000.0)
    q, k = q64.to(dtype).requires_grad_(), k64.to(dtype).requires_grad_()
    qo, ko = rope_ref(q, k, cos, sin)
    ((qo.double() * dq).sum() + (ko.double() * dk).sum()).backward()
    inv = rope_inv_freq(dh, 10000.0)[0].double()
    qe, ke = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    qoe, koe = _rope_complex(qe, pos.double(), inv), _rope_complex(ke, pos.double(), inv)
    ((qoe * dq).sum() + (koe * dk).sum()).backward()
    # fp32 angles at positions up to 500 are accurate to ~3e-5 rad
    tol = dict(atol=2e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=1e-2)
    assert_close(qo, qoe, **tol, what="q'")
    assert_close(ko, koe, **tol, what="k'")
    assert_close(q.grad, qe.grad, **tol, what="dq")
    assert_close(k.grad, ke.grad, **tol, what="dk")


@pytest.mark.parametrize("scaling", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 256},
])
def test_inv_freq_matches_transformers(scaling):
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    cfg = Qwen3Config(hidden_size=64, num_attention_heads=4, head_dim=32, max_position_embeddings=2048,
                      rope_theta=1e6, rope_scaling=dict(scaling) if scaling else None)
    emb = Qwen3RotaryEmbedding(cfg)
    inv, scale = rope_inv_freq(32, 1e6, scaling)
    assert_close(inv, emb.inv_freq, atol=0, rtol=1e-6, what="inv_freq")
    assert scale == pytest.approx(emb.attention_scaling, rel=1e-7)
    pos = torch.randint(0, 2048, (2, 9))
    cos, sin = rope_cos_sin(pos, 32, 1e6, scaling)
    cos_e, sin_e = emb(torch.zeros(1, dtype=torch.float32), pos)
    assert_close(cos, cos_e, atol=1e-6, rtol=0, what="cos")
    assert_close(sin, sin_e, atol=1e-6, rtol=0, what="sin")
    assert ROPE_INIT_FUNCTIONS  # the types we claim exist in transformers


def test_rope_rejects_bad_input():
    with pytest.raises(ValueError, match="dynamic"):
        rope_inv_freq(32, 1e4, {"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="factor"):
        rope_inv_freq(32, 1e4, {"rope_type": "linear"})
    cos, sin = rope_cos_sin(torch.arange(5), 8, 1e4)
    with pytest.raises(ValueError, match="does not match"):
        rope(torch.randn(4, 2, 8), torch.randn(4, 2, 8), cos, sin)


# --- the Triton kernel (CPU: through the interpreter; see conftest.py) ------------------------------
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _run(lead, h, hkv, dh, dtype, device=DEV, seed=0, scaling=None):
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 4096, lead, generator=g)
    q64, k64 = (torch.randn(*lead, h, dh, generator=g, dtype=torch.float64),
                torch.randn(*lead, hkv, dh, generator=g, dtype=torch.float64))
    dq, dk = (torch.randn(*lead, h, dh, generator=g, dtype=torch.float64).to(device),
              torch.randn(*lead, hkv, dh, generator=g, dtype=torch.float64).to(device))
    cos, sin = (t.to(device) for t in rope_cos_sin(pos, dh, 1e6, scaling))  # fp32, as the model passes them

    def go(dt, fn, cs):
        q, k = q64.to(device, dt).requires_grad_(), k64.to(device, dt).requires_grad_()
        qo, ko = fn(q, k, *cs)
        return [qo, ko, *torch.autograd.grad((qo.double() * dq).sum() + (ko.double() * dk).sum(), (q, k))]

    got = go(dtype, lambda *a: rope(*a, impl="triton"), (cos, sin))
    exp = go(torch.float64, rope_ref, (cos.double(), sin.double()))

    def eager(q, k, c, s):  # HF's apply_rotary_pos_emb in the kernel's dtype
        c, s = c.to(q.dtype).unsqueeze(-2), s.to(q.dtype).unsqueeze(-2)
        rh = lambda x: torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), -1)  # noqa: E731
        return q * c + rh(q) * s, k * c + rh(k) * s

    base = go(dtype, eager, (cos, sin))
    return got, exp, base


NAMES = ("q'", "k'", "dq", "dk")


@pytest.mark.parametrize("lead,h,hkv,dh", [((1,), 1, 1, 2), ((7,), 4, 2, 32), ((2, 13), 3, 1, 6), ((5,), 5, 5, 130)])
def test_rope_triton_fp32(lead, h, hkv, dh):
    got, exp, _ = _run(lead, h, hkv, dh, torch.float32)
    assert got[0].shape == (*lead, h, dh) and got[1].shape == (*lead, hkv, dh) and got[0].dtype == torch.float32
    for name, a, e in zip(NAMES, got, exp):
        assert_close(a, e, atol=1e-5, rtol=1e-5, what=f"{name} {lead, h, hkv, dh}")


@pytest.mark.parametrize("lead,h,hkv,dh", [((7,), 4, 2, 32), ((2, 13), 3, 1, 6)])
def test_rope_triton_fp16_within_2x_eager(lead, h, hkv, dh):
    got, exp, base = _run(lead, h, hkv, dh, torch.float16, seed=1)
    assert all(t.dtype == torch.float16 for t in got)
    for name, a, e, b in zip(NAMES, got, exp, base):
        assert_error_within(a, e, b, what=f"{name} {lead, h, hkv, dh}", atol=1e-3)


def test_rope_triton_yarn_scaled_cos_and_strided_q():
    """YaRN's attention factor scales cos/sin (so c² + s² ≠ 1); q a strided view of a fused projection."""
    got, exp, _ = _run((9,), 4, 2, 16, torch.float32, scaling={"rope_type": "yarn", "factor": 4.0,
                                                               "original_max_position_embeddings": 512})
    for name, a, e in zip(NAMES, got, exp):
        assert_close(a, e, atol=1e-5, rtol=1e-5, what=f"yarn {name}")
    qkv = torch.randn(9, 8, 16, device=DEV)
    cos, sin = (t.to(DEV) for t in rope_cos_sin(torch.arange(9), 16, 1e4))
    q, k = qkv[:, :4], qkv[:, 4:6]  # non-contiguous views
    for a, e in zip(rope(q, k, cos, sin, impl="triton"), rope_ref(q, k, cos, sin)):
        assert_close(a, e, atol=1e-5, rtol=1e-5, what="strided")


def test_rope_triton_refuses_cos_with_grad():
    cos, sin = rope_cos_sin(torch.arange(3), 8, 1e4)
    with pytest.raises(ValueError, match="constants"):
        rope(torch.randn(3, 2, 8), torch.randn(3, 1, 8), cos.requires_grad_(), sin, impl="triton")
    with pytest.raises(ValueError, match="impl"):
        rope(torch.randn(3, 2, 8), torch.randn(3, 1, 8), cos.detach(), sin, impl="fast")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("lead,h,hkv", [pytest.param((2, 200), 4, 2, id="small"),
                                        pytest.param((4, 2048), 32, 8, id="qwen3-8b", marks=pytest.mark.slow)])
def test_rope_triton_bf16(lead, h, hkv):
    """Dh=128 (Qwen3's); the slow tier at Qwen3-8B: 4 packed rows of 2048 tokens, H=32, Hkv=8."""
    got, exp, base = _run(lead, h, hkv, 128, torch.bfloat16, device="cuda")
    for name, a, e, b in zip(NAMES, got, exp, base):
        assert_error_within(a, e, b, what=f"{name} {lead, h, hkv}", atol=1e-3)
