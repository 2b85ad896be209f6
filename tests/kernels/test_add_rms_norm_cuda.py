"""The residual add + RMSNorm operator (kernels/add_rms_norm.py) on a GPU: with a bf16 branch
on the fp32 stream, as accurate as the plain add and norm against float64 on the same values;
two backward calls bitwise equal; compiled by inductor as eagerly; and a model block taking it
under the Triton backend with the gradients of the plain block. CUDA only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from m3run.model.config import ModelConfig
from m3run.model.lm import Block

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the norm's kernels need a CUDA GPU"),
]
EPS = 1e-5


def plain(x, delta, w, eps):
    s = x + delta
    return s, F.rms_norm(s.float(), (s.shape[-1],), w.float(), eps).to(delta.dtype)


def grads(fn, x, delta, w, g_s, g_n):
    x, delta, w = (t.clone().requires_grad_() for t in (x, delta, w))
    s, n = fn(x, delta, w, EPS)
    torch.autograd.backward((s, n), (g_s, g_n))
    return s.detach(), n.detach(), x.grad, delta.grad, w.grad


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def inputs(d=1024 + 40):  # not a power of two: the column mask
    torch.manual_seed(0)
    x = torch.randn(3, 333, d, device="cuda")  # rows end inside a program's span
    delta = torch.randn(3, 333, d, device="cuda").bfloat16()
    w = 1 + 0.1 * torch.randn(d, device="cuda")
    return x, delta, w, torch.randn_like(x), torch.randn_like(delta)


def test_the_operator_is_as_accurate_as_the_plain_add_and_norm_and_deterministic():
    from m3run.kernels.add_rms_norm import add_rms_norm

    x, delta, w, g_s, g_n = inputs()
    exact = grads(plain, x.double(), delta.double(), w.double(), g_s.double(), g_n.double())
    fused = grads(add_rms_norm, x, delta, w, g_s, g_n)
    ref = grads(plain, x, delta, w, g_s, g_n)
    names = ("s", "n", "dx", "d(delta)", "dw")
    for name, f, r, e in zip(names, fused, ref, exact, strict=True):
        assert f.dtype == r.dtype, (name, f.dtype, r.dtype)
        assert rel(f, e) <= 1.5 * rel(r, e) + 1e-6, (name, rel(f, e), rel(r, e))
    again = grads(add_rms_norm, x, delta, w, g_s, g_n)
    assert all(torch.equal(a, b) for a, b in zip(fused, again, strict=True))
    compiled = torch.compile(add_rms_norm, fullgraph=True)
    for name, c, f in zip(names, grads(compiled, x, delta, w, g_s, g_n), fused, strict=True):
        assert rel(c, f) < 1e-5, (name, rel(c, f))


def test_a_block_takes_the_operator_under_the_triton_backend(monkeypatch):
    import m3run.kernels.add_rms_norm as op

    cfg = ModelConfig.preset("tiny", scan_backend="triton")
    torch.manual_seed(0)
    block = Block(cfg, 0).cuda()
    x = torch.randn(2, 128, cfg.d_model, device="cuda")
    pending = torch.randn(2, 128, cfg.d_model, device="cuda").bfloat16()
    calls = []

    def counted(*args):
        calls.append(1)
        return fused_op(*args)

    def plain(x, delta, weight, eps):  # RMSNorm.add on an fp32 stream without the operator
        s = x + delta
        return s, F.rms_norm(s, (s.shape[-1],), weight, eps)

    fused_op = op.add_rms_norm

    def run(fused: bool):
        monkeypatch.setattr(op, "add_rms_norm", counted if fused else plain)
        block.zero_grad()
        xi, pi = x.clone().requires_grad_(), pending.clone().requires_grad_()
        with torch.autocast("cuda", torch.bfloat16):
            s, out = block(xi, pi)
        (s.square().sum() + out.float().square().sum()).backward()
        return [s, out, xi.grad, pi.grad, *(p.grad.clone() for p in block.parameters())]

    fused = run(True)
    assert calls, "the block did not take the operator"
    for a, b in zip(fused, run(False), strict=True):
        assert rel(a, b) < 2e-2
