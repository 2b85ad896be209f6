"""Run by test_triton_cpu.py in the Triton interpreter (TRITON_INTERPRET=1, set before Triton
loads): the scan's two custom operators (kernels/mamba3/triton_siso.py) under torch.compile with
fullgraph equal them eagerly, bitwise (one B/C group, z, d and a reset), and
torch.library.opcheck finds their fake implementations (the shapes torch.compile plans with)
right, there and with one group per head and no z or d. Prints "ok" at the end. Small shapes:
the interpreter runs each kernel program in Python."""

from __future__ import annotations

import interpret_scan
import torch
import torch.nn.functional as F

from kernels.mamba3 import triton_siso as ts

CASES = [
    dict(b=1, t=24, h=2, p=16, n=16, s=4, g=1, z=True, d=True, reset=17, compile=True),
    dict(b=1, t=16, h=2, p=16, n=8, s=3, g=2, z=False, d=False, reset=None, compile=False),
]


def inputs(b, t, h, p, n, s, g, z, d):
    def r(*shape):
        return torch.randn(*shape)

    dt = F.softplus(r(b, h, t) - 2.0)
    return dict(
        q=F.rms_norm(r(b, t, g, n), (n,)), k=F.rms_norm(r(b, t, g, n), (n,)), v=r(b, t, h, p),
        adt=-F.softplus(r(b, h, t)) * dt, dt=dt, trap=r(b, h, t),
        q_bias=torch.ones(h, n), k_bias=torch.ones(h, n), angles=r(b, t, h, s),
        d=torch.ones(h) if d else None, z=r(b, t, h, p) if z else None,
    )  # fmt: skip


def main() -> None:
    interpret_scan._numpy_scalar_index()
    torch.manual_seed(0)
    chunk = 16
    for case in CASES:
        b, t = case["b"], case["t"]
        x = inputs(**{k: case[k] for k in ("b", "t", "h", "p", "n", "s", "g", "z", "d")})
        reset = None
        if case["reset"] is not None:
            reset = torch.zeros(b, t, dtype=torch.bool)
            reset[:, case["reset"]] = True

        def scan(reset=reset, **kw):
            return ts.mamba3_siso_triton(**kw, chunk_size=chunk, reset=reset)

        outs = []
        fns = (scan, torch.compile(scan, backend="aot_eager", fullgraph=True))
        for fn in fns if case["compile"] else ():
            leaves = {k: v.clone().requires_grad_() for k, v in x.items() if v is not None}
            y = fn(**leaves)
            (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
            outs.append([y.detach(), *(leaf.grad for leaf in leaves.values())])
        for a, c in zip(*outs, strict=True) if outs else ():
            assert torch.equal(a, c), f"{case}: compiled differs from eager"

        seg = None if reset is None else ts.segment_ids(reset, chunk)
        args = (x["q"], x["k"], x["v"], x["z"], x["adt"], x["dt"], x["trap"], x["q_bias"],
                x["k_bias"], x["angles"], x["d"], None, None, seg, chunk, True)  # fmt: skip
        torch.library.opcheck(ts.siso_fwd_op, args, test_utils=("test_schema", "test_faketensor"))
        y, phi_t, _g_t, g_in, phi_in = ts.siso_fwd_op(*args)
        bargs = (*args[:11], seg, g_in, phi_in, torch.randn_like(y), None, torch.zeros_like(phi_t),
                 chunk)  # fmt: skip
        torch.library.opcheck(ts.siso_bwd_op, bargs, test_utils=("test_faketensor",))
    print("ok")


if __name__ == "__main__":
    main()
