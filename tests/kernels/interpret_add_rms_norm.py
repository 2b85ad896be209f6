"""Run by test_triton_cpu.py in the Triton interpreter (TRITON_INTERPRET=1, set before Triton
loads): the residual add + RMSNorm operator (kernels/add_rms_norm.py) in fp32 against the plain
formula in float64 (both outputs and the three gradients; a width that ends inside the kernel's
column block, rows that end inside a program's span and inside a tile), two backward calls
bitwise equal, the same under torch.compile with fullgraph (bitwise), and torch.library.opcheck
on the backward operator. Prints "ok" at the end."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from m3run.kernels import add_rms_norm as op

EPS = 1e-5


def reference(x, delta, w, eps):
    s = x + delta
    return s, F.rms_norm(s, (s.shape[-1],), w, eps)


def run(fn, x, delta, w, g_s, g_n):
    x, delta, w = (t.clone().requires_grad_() for t in (x, delta, w))
    s, n = fn(x, delta, w, EPS)
    torch.autograd.backward((s, n), (g_s, g_n))
    return s.detach(), n.detach(), x.grad, delta.grad, w.grad


def main() -> None:
    torch.manual_seed(0)
    op.PROGRAMS = 4  # 27 rows: spans of 8 (two tiles of 4), the last one of 3
    shape, d = (3, 9), 40
    x, delta, g_s, g_n = (torch.randn(*shape, d, dtype=torch.float64) for _ in range(4))
    w = 1 + 0.1 * torch.randn(d, dtype=torch.float64)
    want = run(reference, x, delta, w, g_s, g_n)
    args = [t.float() for t in (x, delta, w, g_s, g_n)]
    got = run(op.add_rms_norm, *args)
    names = ("s", "n", "dx", "d(delta)", "dw")
    for name, a, b in zip(names, got, want, strict=True):
        assert a.dtype == torch.float32 and a.shape == b.shape, (name, a.dtype, a.shape, b.shape)
        err = ((a.double() - b).norm() / b.norm()).item()
        assert err < 1e-6, f"{name}: relative error {err:.2e}"
    again = run(op.add_rms_norm, *args)
    assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True)), "not deterministic"
    compiled = torch.compile(op.add_rms_norm, backend="aot_eager", fullgraph=True)
    for a, b in zip(run(compiled, *args), got, strict=True):
        assert torch.equal(a, b), "compiled differs from eager"
    s = args[0] + args[1]
    torch.library.opcheck(
        op.add_rms_norm_bwd_op, (s, args[2], args[3], args[4], EPS, torch.float32)
    )
    print("ok")


if __name__ == "__main__":
    main()
