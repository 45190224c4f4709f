import pytest
import torch

from kernels.cross_entropy import cross_entropy_ref, linear_cross_entropy
from tests.kernels._compare import assert_close


def test_cross_entropy_ref_matches_math():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 17, generator=g)
    labels = torch.randint(0, 17, (9,), generator=g)
    labels[[2, 5]] = -100
    loss, n = cross_entropy_ref(logits, labels)
    keep = labels != -100
    manual = (torch.logsumexp(logits.double(), -1) - logits.double().gather(1, labels.clamp(min=0)[:, None])[:, 0])[keep].sum()
    assert n == 7 and loss.dtype == torch.float32
    assert_close(loss, manual, atol=1e-5, rtol=1e-6, what="loss")


@pytest.mark.parametrize("n,d,v,chunk", [(1, 8, 5, 4), (13, 16, 37, 1), (13, 16, 37, 3), (29, 32, 101, 7), (29, 32, 101, 4096)])
def test_linear_cross_entropy_matches_ref_with_grads(n, d, v, chunk):
    g = torch.Generator().manual_seed(n + chunk)
    h = torch.randn(n, d, generator=g).requires_grad_()
    w = (torch.randn(v, d, generator=g) * 0.3).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.3] = -100  # some chunks may be fully ignored
    loss = linear_cross_entropy(h, w, labels, chunk_size=chunk)
    (loss * 2.5).backward()  # a non-unit upstream gradient must scale dh and dW
    he, we = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref, count = cross_entropy_ref(he @ we.t(), labels)
    (ref * 2.5).backward()
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert_close(loss, ref, atol=1e-5, rtol=1e-5, what="loss")
    assert_close(h.grad, he.grad, atol=1e-5, rtol=1e-5, what="dhidden")
    assert_close(w.grad, we.grad, atol=1e-5, rtol=1e-5, what="dweight")


def test_linear_cross_entropy_bf16_and_frozen_weight():
    g = torch.Generator().manual_seed(3)
    h64, w64 = torch.randn(40, 32, generator=g, dtype=torch.float64), torch.randn(97, 32, generator=g, dtype=torch.float64) * 0.2
    labels = torch.randint(0, 97, (40,), generator=g)
    h = h64.to(torch.bfloat16).requires_grad_()
    w = w64.to(torch.bfloat16)  # frozen: no dW is computed or returned
    loss = linear_cross_entropy(h, w, labels, chunk_size=16)
    loss.backward()
    assert w.grad is None and h.grad.dtype == torch.bfloat16
    he = h.detach().double().requires_grad_()
    ref, _ = cross_entropy_ref(he @ w.double().t(), labels)
    ref.backward()
    eager, _ = cross_entropy_ref(h.detach() @ w.t(), labels)  # eager bf16 logits → fp32 CE
    assert abs(loss.item() - ref.item()) <= 2 * abs(eager.item() - ref.item()) + 1e-3
    assert_close(h.grad, he.grad, atol=2e-3, rtol=2e-2, what="dhidden bf16")


def test_linear_cross_entropy_checks_shapes():
    with pytest.raises(ValueError, match="disagree"):
        linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 7), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="int64"):
        linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.int32))


def test_linear_cross_entropy_under_no_grad_matches():
    g = torch.Generator().manual_seed(4)
    h, w = torch.randn(10, 8, generator=g, requires_grad=True), torch.randn(23, 8, generator=g, requires_grad=True)
    labels = torch.randint(0, 23, (10,), generator=g)
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, labels, chunk_size=3)
    assert not loss.requires_grad
    assert_close(loss, cross_entropy_ref(h.detach() @ w.detach().t(), labels)[0], atol=1e-5, rtol=1e-5, what="loss")
