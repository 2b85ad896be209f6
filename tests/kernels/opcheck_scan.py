"""Run by test_triton_cpu.py in the Triton interpreter (TRITON_INTERPRET=1, set before Triton
loads): the scan's two custom operators (kernels/mamba3/triton_siso.py) under torch.compile with
fullgraph equal them eagerly, bitwise (one B/C group, z, d and a reset), and
torch.library.opcheck finds their fake implementations (the shapes torch.compile plans with)
right, there and with one group per head and no z or d; with z and v packed in one tensor
(``zv``) the output and every gradient equal those of z and v apart, bitwise, the packed
gradient holding dz and dv; with one set of angles for every head ((b, t, 1, s)) the output
and the other gradients equal those of the angles expanded over heads, bitwise, and the angles'
gradient is their sum over heads. Prints "ok" at the end. Small shapes: the interpreter runs each
kernel program in Python."""

from __future__ import annotations

import interpret_scan
import torch
import torch.nn.functional as F

from m3run.kernels.mamba3 import triton_siso as ts

CASES = [
    dict(b=1, t=24, h=2, p=16, n=16, s=4, g=1, z=True, d=True, reset=17, compile=True),
    dict(b=1, t=16, h=2, p=16, n=8, s=3, g=2, z=False, d=False, reset=None, compile=False),
]


def inputs(b, t, h, p, n, s, g, z, d):
    def r(*shape):
        return torch.randn(*shape)

    dt = F.softplus(r(b, h, t) - 2.0)
    return dict(
        q=F.rms_norm(r(b, t, g, n), (n,)),
        k=F.rms_norm(r(b, t, g, n), (n,)),
        v=r(b, t, h, p),
        adt=-F.softplus(r(b, h, t)) * dt,
        dt=dt,
        trap=r(b, h, t),
        q_bias=torch.ones(h, n),
        k_bias=torch.ones(h, n),
        angles=r(b, t, h, s),
        d=torch.ones(h) if d else None,
        z=r(b, t, h, p) if z else None,
    )


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

        if case["z"]:
            check_packed(scan, x)
        check_shared_angles(scan, x)

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
        vz = [(x["v"], x["z"], False)]
        if case["z"]:
            vz.append((torch.stack([x["z"], x["v"]], dim=2), None, True))
        for v, z, packed in vz:
            args = (
                x["q"],
                x["k"],
                v,
                z,
                x["adt"],
                x["dt"],
                x["trap"],
                x["q_bias"],
                x["k_bias"],
                x["angles"],
                x["d"],
                None,
                None,
                seg,
                chunk,
                True,
                packed,
            )
            torch.library.opcheck(
                ts.siso_fwd_op, args, test_utils=("test_schema", "test_faketensor")
            )
            y, phi_t, _g_t, g_in, phi_in = ts.siso_fwd_op(*args)
            bargs = (
                *args[:11],
                seg,
                g_in,
                phi_in,
                torch.randn_like(y),
                None,
                torch.zeros_like(phi_t),
                chunk,
                packed,
            )
            torch.library.opcheck(ts.siso_bwd_op, bargs, test_utils=("test_faketensor",))
    print("ok")


def check_packed(scan, x) -> None:
    """z and v packed as ``zv`` give the output and gradients of z and v apart, bitwise."""
    apart = {k: v.clone().requires_grad_() for k, v in x.items() if v is not None}
    packed = {
        k: None if v is None else v.clone().requires_grad_()
        for k, v in x.items()
        if k not in ("v", "z")
    }
    zv = torch.stack([x["z"], x["v"]], dim=2).requires_grad_()
    ys = [scan(**apart), scan(**packed, v=None, zv=zv)]
    probe = torch.linspace(-1, 1, ys[0].numel()).view_as(ys[0])
    for y in ys:
        (y * probe).sum().backward()
    assert torch.equal(ys[0], ys[1]), "packed zv: the output differs"
    assert torch.equal(zv.grad, torch.stack([apart["z"].grad, apart["v"].grad], dim=2)), (
        "packed zv: its gradient is not (dz, dv)"
    )
    for name, leaf in packed.items():
        if leaf is not None:
            assert torch.equal(leaf.grad, apart[name].grad), f"packed zv: d{name} differs"


def check_shared_angles(scan, x) -> None:
    """Angles (b, t, 1, s), one set for every head, summed over heads in the angle kernel: the
    output and the other gradients of the angles expanded to (b, t, h, s), bitwise; the angles'
    gradient their per-head gradients' sum."""
    b, t, h, s = x["angles"].shape
    one = x["angles"][:, :, :1].clone()
    shared = {k: v.clone().requires_grad_() for k, v in x.items() if v is not None}
    shared["angles"] = one.clone().requires_grad_()
    per_head = {k: v.clone().requires_grad_() for k, v in x.items() if v is not None}
    per_head["angles"] = one.expand(b, t, h, s).contiguous().requires_grad_()
    ys = [scan(**shared), scan(**per_head)]
    probe = torch.linspace(-1, 1, ys[0].numel()).view_as(ys[0])
    for y in ys:
        (y * probe).sum().backward()
    assert torch.equal(ys[0], ys[1]), "shared angles: the output differs"
    for name, leaf in shared.items():
        if name != "angles":
            assert torch.equal(leaf.grad, per_head[name].grad), f"shared angles: d{name} differs"
    want = per_head["angles"].grad.sum(2, keepdim=True)
    torch.testing.assert_close(shared["angles"].grad, want, rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
    main()
