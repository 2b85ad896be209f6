"""The cross-entropy kernel (kernels/cross_entropy.py) in the chunked loss on a GPU: in bf16
against the PyTorch form on the same values and float64, with a padded 50k vocabulary and
ignored targets; two calls bitwise equal; compiled as eagerly. CUDA only."""

from __future__ import annotations

import pytest
import torch

from m3run.model.loss import IGNORE_INDEX, linear_cross_entropy

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel needs a CUDA GPU"),
]


def grads(hidden, weight, targets, **kw):
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = linear_cross_entropy(hidden, weight, targets, chunk_tokens=256, **kw)
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_the_kernel_is_as_accurate_as_the_pytorch_loss_and_deterministic():
    torch.manual_seed(0)
    rows, d, v, n_classes = 600, 128, 50304, 50257  # 3 chunks, the last one partial
    hidden = torch.randn(rows, d, device="cuda").bfloat16()
    weight = torch.randn(v, d, device="cuda") / d**0.5
    targets = torch.randint(0, n_classes, (rows,), device="cuda")
    targets[::7] = IGNORE_INDEX
    exact = grads(hidden.double(), weight.double(), targets, n_classes=n_classes)
    kernel = grads(hidden, weight, targets, n_classes=n_classes, backend="triton")
    plain = grads(hidden, weight, targets, n_classes=n_classes, backend="pytorch")
    for name, k, p, e in zip(("loss", "dhidden", "dweight"), kernel, plain, exact, strict=True):
        assert k.dtype == p.dtype and k.shape == p.shape, (name, k.dtype, p.dtype)
        assert rel(k, e) <= 1.5 * rel(p, e) + 1e-4, (name, rel(k, e), rel(p, e))
    assert not kernel[2][n_classes:].any()
    again = grads(hidden, weight, targets, n_classes=n_classes, backend="triton")
    assert all(torch.equal(a, b) for a, b in zip(kernel, again, strict=True))
    compiled = torch.compile(linear_cross_entropy)
    hc, wc = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = compiled(hc, wc, targets, chunk_tokens=256, n_classes=n_classes, backend="triton")
    loss.backward()
    for a, b in zip((loss.detach(), hc.grad, wc.grad), kernel, strict=True):
        assert torch.equal(a, b), "compiled differs from eager"
