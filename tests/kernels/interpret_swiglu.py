"""Run by test_triton_cpu.py in the Triton interpreter (TRITON_INTERPRET=1, set before Triton
loads): the SwiGLU operator (kernels/swiglu.py) in fp32 against the plain module's formula in
float64 (the output and both gradients, a hidden width that ends inside a program's block), the
same under torch.compile with fullgraph (bitwise), and torch.library.opcheck on both operators.
Prints "ok" at the end."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from m3run.kernels import swiglu


def reference(gu, w):
    g, u = gu.split(w.shape[1], dim=-1)
    return F.linear(F.silu(g) * u, w)


def run(fn, gu, w, dy):
    gu, w = gu.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(gu, w)
    y.backward(dy)
    return y.detach(), gu.grad, w.grad


def main() -> None:
    torch.manual_seed(0)
    hidden, d_model = 40, 12  # 40 of a 1024-column block: the masks
    gu = torch.randn(2, 3, 2 * hidden, dtype=torch.float64)
    w = torch.randn(d_model, hidden, dtype=torch.float64)
    dy = torch.randn(2, 3, d_model, dtype=torch.float64)
    want = run(reference, gu, w, dy)
    gu, w, dy = gu.float(), w.float(), dy.float()
    got = run(swiglu.swiglu_down, gu, w, dy)
    for name, a, b in zip(("y", "d(gu)", "dw"), got, want, strict=True):
        assert a.dtype == torch.float32 and a.shape == b.shape, (name, a.dtype, a.shape, b.shape)
        err = ((a.double() - b).norm() / b.norm()).item()
        assert err < 1e-6, f"{name}: relative error {err:.2e}"
    compiled = torch.compile(swiglu.swiglu_down, backend="aot_eager", fullgraph=True)
    for a, b in zip(run(compiled, gu, w, dy), got, strict=True):
        assert torch.equal(a, b), "compiled differs from eager"
    wc = w.detach().clone()  # the weight in gu's dtype: here the same values apart
    torch.library.opcheck(swiglu.swiglu_down_op, (gu.requires_grad_(), w.requires_grad_(), wc))
    torch.library.opcheck(swiglu.swiglu_down_bwd_op, (gu.detach(), w.detach(), wc, dy))
    print("ok")


if __name__ == "__main__":
    main()
