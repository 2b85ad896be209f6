"""The PyTorch references of the Mamba-3 SISO scan, checked against each other and against an
independent float64 implementation of DESIGN.md's equations written here."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers.scan_inputs import make_inputs, rel, slice_time

from m3run.kernels.mamba3 import (
    BackendUnavailableError,
    mamba3_siso,
    mamba3_siso_recurrent,
    mamba3_siso_step,
    zero_state,
)

F64 = torch.float64


def design_oracle(q, k, v, adt, dt, trap, q_bias, k_bias, angles, d=None, z=None):
    """DESIGN.md's chunked form with one chunk covering the whole sequence, in float64, built
    from explicit loops over (i, j) — independent of both references' code."""
    b, t, g, _ = k.shape
    h, p, s = v.shape[2], v.shape[3], angles.shape[3]
    y = torch.zeros(b, t, h, p, dtype=F64)
    for bi in range(b):
        for hi in range(h):
            gi = 0 if g == 1 else hi
            phi = torch.zeros(t, s, dtype=F64)
            acc = torch.zeros(s, dtype=F64)
            for ti in range(t):
                acc = torch.remainder(
                    acc + dt[bi, hi, ti] * math.pi * torch.tanh(angles[bi, ti, hi]), 2 * math.pi
                )
                phi[ti] = acc

            def rot(vec, ph):
                out = vec.clone()
                for si in range(s):
                    a, c = vec[2 * si], vec[2 * si + 1]
                    out[2 * si] = a * torch.cos(ph[si]) - c * torch.sin(ph[si])
                    out[2 * si + 1] = a * torch.sin(ph[si]) + c * torch.cos(ph[si])
                return out

            kk = [k[bi, ti, gi] + k_bias[hi] for ti in range(t)]
            qq = [q[bi, ti, gi] + q_bias[hi] for ti in range(t)]
            kbar = [rot(kk[ti], phi[ti]) for ti in range(t)]
            qbar = [rot(qq[ti], phi[ti]) for ti in range(t)]
            lam = torch.sigmoid(trap[bi, hi])
            delta = dt[bi, hi]
            nxt = torch.cat([((1 - lam) * delta)[1:], torch.zeros(1, dtype=F64)])
            w = lam * delta + nxt
            cum = torch.cumsum(adt[bi, hi], 0)
            for ti in range(t):
                out = torch.zeros(p, dtype=F64)
                for sj in range(ti + 1):
                    out = (
                        out
                        + (qbar[ti] @ kbar[sj])
                        * torch.exp(cum[ti] - cum[sj])
                        * w[sj]
                        * v[bi, sj, hi]
                    )
                # diagonal correction: q_t·k_t uses the unrotated vectors
                out = out - (qq[ti] @ kk[ti]) * nxt[ti] * v[bi, ti, hi]
                if d is not None:
                    out = out + d[hi] * v[bi, ti, hi]
                if z is not None:
                    out = out * F.silu(z[bi, ti, hi])
                y[bi, ti, hi] = out
    return y


CASES = [
    pytest.param(dict(g=1, with_d=True, with_z=True), id="g1-d-z"),
    pytest.param(dict(g=3, with_d=True, with_z=True), id="gh-d-z"),
    pytest.param(dict(g=1, with_d=False, with_z=False), id="g1-nod-noz"),
    pytest.param(dict(g=3, with_d=False, with_z=True), id="gh-nod-z"),
]


@pytest.mark.parametrize("kw", CASES)
def test_chunked_matches_design_oracle_float64(kw):
    x = make_inputs(b=1, t=21, h=3, p=3, n=6, s=2, **kw)
    want = design_oracle(**x)
    got = mamba3_siso(**x, chunk_size=8, backend="pytorch")
    assert got.dtype == F64
    assert rel(got, want) <= 1e-10


def test_gradients_match_design_oracle_float64():
    x = make_inputs(b=1, t=11, h=2, p=2, n=6, s=2, g=1)
    for v in x.values():
        v.requires_grad_(True)
    gy = torch.randn(1, 11, 2, 2, dtype=F64, generator=torch.Generator().manual_seed(1))
    grads_ref = torch.autograd.grad((design_oracle(**x) * gy).sum(), list(x.values()))
    grads = torch.autograd.grad(
        (mamba3_siso(**x, chunk_size=4, backend="pytorch") * gy).sum(), list(x.values())
    )
    for name, a, b in zip(x, grads, grads_ref, strict=True):
        assert rel(a, b) <= 1e-10, name


@pytest.mark.parametrize("kw", CASES)
@pytest.mark.parametrize("t,chunk", [(37, 8), (64, 16), (5, 64)], ids=lambda v: str(v))
def test_chunked_equals_recurrent(kw, t, chunk):
    x = make_inputs(t=t, **kw)
    y_c, st_c = mamba3_siso(**x, chunk_size=chunk, return_final_state=True, backend="pytorch")
    y_r, st_r = mamba3_siso_recurrent(**x, return_final_state=True)
    assert rel(y_c, y_r) <= 1e-12
    for name, a, b in zip(("angle", "ssm", "k", "v"), st_c, st_r, strict=True):
        assert rel(a, b) <= 1e-12, name


@pytest.mark.parametrize("kw", CASES)
def test_gradients_chunked_equal_recurrent(kw):
    x = make_inputs(t=19, **kw)
    leaves = {k: v.requires_grad_(True) for k, v in x.items() if v is not None}
    gen = torch.Generator().manual_seed(3)
    gy = torch.randn(2, 19, 3, 4, dtype=F64, generator=gen)
    g_state = [
        torch.randn(*s.shape, dtype=F64, generator=gen)
        for s in zero_state(2, 3, 4, 8, 2, dtype=F64, device="cpu")
    ]

    def loss(fn, **kwargs):
        y, st = fn(**x, return_final_state=True, **kwargs)
        return (y * gy).sum() + sum((a * b).sum() for a, b in zip(st, g_state, strict=True))

    g_c = torch.autograd.grad(
        loss(mamba3_siso, chunk_size=8, backend="pytorch"), list(leaves.values())
    )
    g_r = torch.autograd.grad(loss(mamba3_siso_recurrent), list(leaves.values()))
    for name, a, b in zip(leaves, g_c, g_r, strict=True):
        assert rel(a, b) <= 1e-10, name


@pytest.mark.parametrize("t1", [1, 13, 16, 36])
def test_split_sequence_with_carried_state_equals_whole(t1):
    x = make_inputs(t=37, g=3)
    y, st = mamba3_siso(**x, chunk_size=8, return_final_state=True, backend="pytorch")
    ya, sa = mamba3_siso(
        **slice_time(x, 0, t1), chunk_size=8, return_final_state=True, backend="pytorch"
    )
    yb, sb = mamba3_siso(
        **slice_time(x, t1, 37),
        chunk_size=8,
        initial_state=sa,
        return_final_state=True,
        backend="pytorch",
    )
    assert rel(torch.cat([ya, yb], dim=1), y) <= 1e-12
    for a, b in zip(sb, st, strict=True):
        assert rel(a, b) <= 1e-12


def test_step_by_step_decode_equals_scan():
    x = make_inputs(t=9)
    y = mamba3_siso(**x, chunk_size=4, backend="pytorch")
    state = zero_state(2, 3, 4, 8, 2, dtype=F64, device="cpu")
    for i in range(9):
        yi, state = mamba3_siso_step(
            x["q"][:, i],
            x["k"][:, i],
            x["v"][:, i],
            x["adt"][..., i],
            x["dt"][..., i],
            x["trap"][..., i],
            x["q_bias"],
            x["k_bias"],
            x["angles"][:, i],
            x["d"],
            x["z"][:, i],
            state,
        )
        assert rel(yi, y[:, i]) <= 1e-12


def test_low_precision_inputs_accumulate_in_fp32():
    x = make_inputs(t=40, dtype=torch.bfloat16)
    y = mamba3_siso(**x, chunk_size=16, backend="pytorch")
    assert y.dtype == torch.bfloat16
    x64 = {k: (None if v is None else v.to(F64)) for k, v in x.items()}
    ref = mamba3_siso_recurrent(**x64)
    assert rel(y.to(F64), ref) <= 1e-2


def test_triton_backend_is_an_error_not_a_fallback_when_unavailable():
    x = make_inputs(t=8)
    if torch.cuda.is_available():
        pytest.skip(
            "CUDA present: the triton backend is exercised by tests/kernels/test_triton_scan.py"
        )
    with pytest.raises(BackendUnavailableError, match="triton"):
        mamba3_siso(**x, backend="triton")


def test_auto_backend_runs_on_cpu_and_logs_choice_once(caplog):
    import m3run.kernels.mamba3.api as api

    api._auto_logged.clear()
    x = make_inputs(t=8)
    with caplog.at_level("INFO", logger="m3run.kernels.mamba3.api"):
        mamba3_siso(**x, backend="auto")
        mamba3_siso(**x, backend="auto")
    lines = [r.message for r in caplog.records if "backend auto" in r.message]
    assert len(lines) == 1 and "pytorch" in lines[0]


BAD = [
    ("q", lambda x: x["q"][..., :-1], r"q must match k's shape"),
    ("v", lambda x: x["v"][:, :-1], r"v must be \(b=2, t=37"),
    ("adt", lambda x: x["adt"].transpose(1, 2), r"adt must be \(b, h, t\)=\(2, 3, 37\)"),
    ("dt", lambda x: x["dt"].to(torch.bfloat16), r"dt must be float32"),
    ("k_bias", lambda x: x["k_bias"][:, :4], r"k_bias must be \(h, n\)=\(3, 8\)"),
    ("angles", lambda x: torch.zeros(2, 37, 3, 5, dtype=F64), r"s must be ≤ 4, got s=5"),
    ("d", lambda x: torch.ones(4, dtype=F64), r"d must be \(h,\)=\(3,\)"),
    ("z", lambda x: x["z"][..., :2], r"z must match v's shape"),
    ("q", lambda x: torch.zeros(2, 37, 2, 8, dtype=F64), r"must match k's shape"),
]


@pytest.mark.parametrize("field,bad,msg", BAD, ids=[b[0] + "-" + str(i) for i, b in enumerate(BAD)])
def test_bad_shapes_raise_named_value_errors(field, bad, msg):
    x = make_inputs(t=37)
    x[field] = bad(x)
    with pytest.raises(ValueError, match=msg):
        mamba3_siso(**x, backend="pytorch")


def test_bad_groups_chunk_and_backend_are_rejected():
    x = make_inputs(t=8)
    x["q"] = x["k"] = torch.zeros(2, 8, 2, 8, dtype=F64)
    with pytest.raises(ValueError, match=r"g must be 1 or h=3, got g=2"):
        mamba3_siso(**x, backend="pytorch")
    x = make_inputs(t=8)
    with pytest.raises(ValueError, match=r"chunk_size must be a power of two ≥ 1, got 48"):
        mamba3_siso(**x, chunk_size=48, backend="pytorch")
    with pytest.raises(ValueError, match=r"backend must be one of"):
        mamba3_siso(**x, backend="cuda")
    bad_state = list(zero_state(2, 3, 4, 8, 2, dtype=F64, device="cpu"))
    bad_state[1] = torch.zeros(2, 3, 8, 4, dtype=F64)
    with pytest.raises(ValueError, match=r"ssm_state must be \(2, 3, 4, 8\)"):
        mamba3_siso(**x, initial_state=tuple(bad_state), backend="pytorch")


def test_packed_z_and_v_equal_them_apart_and_are_checked():
    """``zv`` (b, t, 2, h, p), z and v packed as the mixer's one product gives them: the same
    output and gradients as z and v apart (the packed gradient is (dz, dv)), up to float64
    rounding (the reference's products read the packed halves with other strides); a zv given
    with v or z, or of the wrong shape, is a named ValueError."""
    x = make_inputs(t=37)
    apart = {k: v.clone().requires_grad_() for k, v in x.items() if v is not None}
    zv = torch.stack([x["z"], x["v"]], dim=2).requires_grad_()
    packed = {k: v.clone().requires_grad_() for k, v in x.items() if k not in ("v", "z")}
    y1 = mamba3_siso(**apart, backend="pytorch")
    y2 = mamba3_siso(**packed, v=None, zv=zv, backend="pytorch")
    torch.testing.assert_close(y1, y2, rtol=1e-12, atol=1e-12)
    gy = torch.randn_like(y1)
    (y1 * gy).sum().backward()
    (y2 * gy).sum().backward()
    want = torch.stack([apart["z"].grad, apart["v"].grad], dim=2)
    torch.testing.assert_close(zv.grad, want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"either packed \(zv\) or apart \(v, z\).*with v"):
        mamba3_siso(**x, zv=zv.detach(), backend="pytorch")
    with pytest.raises(ValueError, match=r"zv must be \(b, t, 2, h, p\).*got \(2, 37, 3, 4\)"):
        mamba3_siso(**packed, v=None, zv=x["v"], backend="pytorch")
