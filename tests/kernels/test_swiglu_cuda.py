"""The fused SwiGLU operator (kernels/swiglu.py) on a GPU: in bf16 against the plain module's
formula in float64 on the same bf16 values, as accurate as the plain module in bf16; two
backward calls bitwise equal; and the model's MLP taking it under the Triton backend. CUDA
only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from m3run.model.layers import SwiGLU

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the SwiGLU kernels need a CUDA GPU"),
]


def plain(gu, w):
    g, u = gu.split(w.shape[1], dim=-1)
    return F.linear(F.silu(g) * u, w.to(gu.dtype))


def grads(fn, gu, w, dy):
    gu, w = gu.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(gu, w)
    y.backward(dy)
    return y.detach(), gu.grad, w.grad


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def test_fused_swiglu_is_as_accurate_as_the_plain_module_and_deterministic():
    from m3run.kernels.swiglu import swiglu_down

    torch.manual_seed(0)
    hidden, d_model = 1536 + 40, 256  # not a multiple of the kernel's column block
    gu = torch.randn(4, 100, 2 * hidden, device="cuda").bfloat16()
    w = torch.randn(d_model, hidden, device="cuda") / hidden**0.5
    dy = torch.randn(4, 100, d_model, device="cuda").bfloat16()
    exact = grads(plain, gu.double(), w.double(), dy.double())
    fused = grads(swiglu_down, gu, w, dy)
    bf16 = grads(plain, gu, w, dy)
    for name, f, b, e in zip(("y", "d(gu)", "dw"), fused, bf16, exact, strict=True):
        assert f.dtype == b.dtype, (name, f.dtype, b.dtype)
        assert rel(f, e) <= 1.5 * rel(b, e) + 1e-3, (name, rel(f, e), rel(b, e))
    again = grads(swiglu_down, gu, w, dy)
    assert all(torch.equal(a, b) for a, b in zip(fused, again, strict=True))


def test_the_mlp_takes_the_fused_operator_under_the_triton_backend():
    torch.manual_seed(0)
    mlp = SwiGLU(128, 384, backend="triton").cuda()
    ref = SwiGLU(128, 384, backend="pytorch").cuda()
    ref.load_state_dict(mlp.state_dict())
    x = torch.randn(2, 64, 128, device="cuda")
    with torch.autocast("cuda", torch.bfloat16):
        y, y_ref = mlp(x), ref(x)
    (y.float().square().sum() + y_ref.float().square().sum()).backward()
    assert rel(y.float(), y_ref.double()) < 1e-2
    for p, q in zip(mlp.parameters(), ref.parameters(), strict=True):
        assert rel(p.grad, q.grad.double()) < 2e-2
