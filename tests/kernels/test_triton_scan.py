"""The Triton Mamba-3 SISO scan (kernels/mamba3/triton_siso.py) against the float64 chunked
reference (itself checked against DESIGN.md's equations in test_scan_reference.py): outputs,
final states and every input gradient, by relative error ‖a − b‖/‖b‖; and the backward's
determinism.

The kernel takes bf16 q/k/v/z; the reference runs on float64 copies of the same bf16 values, so
the errors measured are the kernel's own (bf16 dot operands, fp32 accumulation). CUDA only.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from helpers.scan_inputs import slice_time as _slice

from m3run.kernels.mamba3 import mamba3_siso

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton scan needs a CUDA GPU"),
]

DEV = "cuda"
BF16 = torch.bfloat16

# Bounds on ‖triton − reference‖/‖reference‖ (bf16 dot operands: errors of a few 1e-3 expected).
Y_TOL = 1e-2  # y
STATE_TOL = 1e-2  # ssm_state (G_T) and k_state
ANGLE_TOL = 1e-5  # angle_state, compared modulo 2π (fp32 cumsum in both)
GRAD_TOL = 1e-2  # every input gradient but the angles', at every length
# angles: the output depends only on angle differences, so Σ_t ∂L/∂Φ_t = 0 exactly and the
# reverse cumsum of bf16-rounded terms carries an absolute error that grows like √t against
# values that shrink towards the start.
ANGLE_GRAD_TOL = 4e-2
SPLIT_TOL = 1e-2  # scan of [:t1] then [t1:] with the carried state vs the whole scan


def make_inputs(b=2, t=100, h=4, p=64, n=64, s=16, g=1, with_d=True, with_z=True, seed=0):
    """Leaf tensors on CUDA: bf16 q/k/v/z, fp32 scalars/biases, as the mixer hands them over."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen)

    dt = F.softplus(r(b, h, t) - 2.0)  # Δ around 0.1, like a trained dt_bias
    adt = torch.clamp(-F.softplus(r(b, h, t)), max=-1e-4) * dt
    x = dict(
        q=F.rms_norm(r(b, t, g, n), (n,)).to(BF16),
        k=F.rms_norm(r(b, t, g, n), (n,)).to(BF16),
        v=r(b, t, h, p).to(BF16),
        adt=adt,
        dt=dt,
        trap=r(b, h, t),
        q_bias=1.0 + 0.1 * r(h, n),
        k_bias=1.0 + 0.1 * r(h, n),
        angles=2.0 * r(b, t, h, s),
        d=r(h) if with_d else None,
        z=r(b, t, h, p).to(BF16) if with_z else None,
    )
    return {key: None if val is None else val.to(DEV) for key, val in x.items()}


def make_state(b, h, p, n, s, seed=1):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    st = (
        2 * math.pi * torch.rand(b, h, s, generator=gen),
        torch.randn(b, h, p, n, generator=gen),
        torch.randn(b, h, n, generator=gen),
        torch.randn(b, h, p, generator=gen),
    )
    return tuple(x.to(DEV) for x in st)


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def angle_err(a, b) -> float:
    """Relative error of angles modulo 2π (a wrap at 0/2π is no error)."""
    d = torch.remainder(a.double() - b.double() + math.pi, 2 * math.pi) - math.pi
    return (d.norm() / b.double().norm().clamp_min(1e-30)).item()


def _run(x, state, backend, chunk_size, gy, g_state, f64, reset=None):
    """One scan with leaves requiring grad; returns y, final state, {input: grad}."""
    leaves = {
        key: val.detach().double().requires_grad_() if f64 else val.detach().requires_grad_()
        for key, val in x.items()
        if val is not None
    }
    st = None
    if state is not None:
        st = [(s.detach().double() if f64 else s.detach().clone()).requires_grad_() for s in state]
    args = {key: leaves.get(key) for key in x}
    y, final = mamba3_siso(
        **args,
        chunk_size=chunk_size,
        initial_state=st,
        return_final_state=True,
        backend=backend,
        reset=reset,
    )
    dtype = torch.float64 if f64 else torch.float32
    loss = (y.to(dtype) * gy.to(dtype)).sum() + sum(
        (f * g.to(dtype)).sum() for f, g in zip(final, g_state, strict=True)
    )
    names = list(leaves) + ([f"state{i}" for i in range(4)] if st else [])
    tensors = list(leaves.values()) + (st or [])
    grads = dict(zip(names, torch.autograd.grad(loss, tensors), strict=True))
    return y.detach(), [f.detach() for f in final], grads


def errors(x, chunk_size=64, state=None, seed=7, reset=None) -> dict[str, float]:
    """Relative errors of the Triton scan against the fp32 reference, by output and gradient."""
    b, t, h, p = x["v"].shape
    n, s = x["k"].shape[3], x["angles"].shape[3]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    gy = torch.randn(b, t, h, p, generator=gen).to(DEV)
    g_state = [
        torch.randn(*shape, generator=gen).to(DEV)
        for shape in ((b, h, s), (b, h, p, n), (b, h, n), (b, h, p))
    ]
    y, fin, grads = _run(x, state, "triton", chunk_size, gy, g_state, False, reset)
    y_r, fin_r, grads_r = _run(x, state, "pytorch", chunk_size, gy, g_state, True, reset)
    out = {
        "y": rel(y, y_r),
        "angle_state": angle_err(fin[0], fin_r[0]),
        "ssm_state": rel(fin[1], fin_r[1]),
        "k_state": rel(fin[2], fin_r[2]),
        "v_state": rel(fin[3], fin_r[3]),
    }
    for name, gr in grads_r.items():
        out[f"d{name}"] = rel(grads[name], gr)
    return out


def check(err: dict[str, float]) -> None:
    # dstate0, the gradient of the carried angle, is the angles' reverse cumsum run to t = 0:
    # an angle gradient, with its bound.
    bounds = {
        "y": Y_TOL,
        "angle_state": ANGLE_TOL,
        "ssm_state": STATE_TOL,
        "k_state": STATE_TOL,
        "v_state": 0.0,
        "dangles": ANGLE_GRAD_TOL,
        "dstate0": ANGLE_GRAD_TOL,
    }
    bad = {k: v for k, v in err.items() if not v <= bounds.get(k, GRAD_TOL)}
    assert not bad, f"over bound: {bad}; all: {err}"


SHAPES = [
    pytest.param(t, g, dz, id=f"T{t}-{'g1' if g == 1 else 'gh'}-{dz}")
    for t in (64, 100, 1024, 2048)
    for g in (1, 4)
    for dz in ("d-z", "nod-noz")
] + [
    pytest.param(100, 4, "d-noz", id="T100-gh-d-noz"),
    pytest.param(100, 1, "nod-z", id="T100-g1-nod-z"),
]


@pytest.mark.parametrize("t,g,dz", SHAPES)
def test_outputs_states_and_gradients_match_reference(t, g, dz):
    x = make_inputs(t=t, g=g, with_d=dz.startswith("d-"), with_z=dz.endswith("-z"))
    check(errors(x))


@pytest.mark.parametrize(
    "shape,chunk_size",
    [
        pytest.param(dict(p=32, n=16, s=4), 64, id="tiny-P32-N16-S4"),
        pytest.param(dict(p=64, n=64, s=16), 32, id="chunk32"),
        pytest.param(dict(p=64, n=64, s=16), 16, id="chunk16"),
        pytest.param(dict(p=48, n=40, s=6), 64, id="P48-N40-S6"),
    ],
)
def test_other_tiles_match_reference(shape, chunk_size):
    check(errors(make_inputs(t=100, **shape), chunk_size=chunk_size))


@pytest.mark.parametrize("g", [1, 4], ids=["g1", "gh"])
def test_initial_state_and_its_gradients_match_reference(g):
    x = make_inputs(t=100, g=g)
    check(errors(x, state=make_state(2, 4, 64, 64, 16)))


@pytest.mark.parametrize(
    "t,t1",
    [pytest.param(100, 37, id="T100-split37"), pytest.param(2048, 1000, id="T2048-split1000")],
)
def test_split_sequence_with_carried_state_equals_whole(t, t1):
    x = make_inputs(t=t)
    y, st = mamba3_siso(**x, return_final_state=True, backend="triton")
    ya, sa = mamba3_siso(**_slice(x, 0, t1), return_final_state=True, backend="triton")
    yb, sb = mamba3_siso(
        **_slice(x, t1, t), initial_state=sa, return_final_state=True, backend="triton"
    )
    assert rel(torch.cat([ya, yb], dim=1), y) <= SPLIT_TOL
    assert angle_err(sb[0], st[0]) <= ANGLE_TOL
    for name, a, b in zip(("ssm", "k", "v"), sb[1:], st[1:], strict=True):
        assert rel(a, b) <= SPLIT_TOL, name


def reset_mask(b, t, positions, seed=5):
    """A (b, t) reset mask: the given positions in row 0, random document starts (about one
    per 300 tokens) in the other rows."""
    reset = torch.zeros(b, t, dtype=torch.bool)
    reset[0, list(positions)] = True
    gen = torch.Generator(device="cpu").manual_seed(seed)
    reset[1:] = torch.rand(b - 1, t, generator=gen) < 1 / 300
    return reset.to(DEV)


@pytest.mark.parametrize(
    "t,g,chunk_size",
    [
        pytest.param(100, 1, 64, id="T100-g1"),
        pytest.param(100, 4, 32, id="T100-gh-chunk32"),
        pytest.param(2048, 1, 64, id="T2048-g1"),
    ],
)
def test_resets_match_reference(t, g, chunk_size):
    """Resets on token 0 (with a carried state), on chunk boundaries of every kernel chunk,
    inside chunks and twice in one chunk: outputs, states and gradients within the bounds."""
    x = make_inputs(t=t, g=g)
    reset = reset_mask(2, t, (0, 16, 32, 45, 47, 64, t - 1))
    check(errors(x, chunk_size=chunk_size, state=make_state(2, 4, 64, 64, 16), reset=reset))


def test_packed_document_scans_as_if_alone():
    """The second document of a packed window, with a reset at its start, gives the output of
    scanning it alone within the bf16 bound (both Triton scans; the reset is inside a kernel
    chunk)."""
    t, t1 = 300, 117
    x = make_inputs(t=t)
    reset = torch.zeros(2, t, dtype=torch.bool, device=DEV)
    reset[:, t1] = True
    y = mamba3_siso(**x, reset=reset, backend="triton")
    alone = mamba3_siso(**_slice(x, t1, t), backend="triton")
    assert rel(y[:, t1:], alone) <= Y_TOL


@pytest.mark.parametrize("shared", [True, False], ids=["b-t-1-s", "expanded"])
def test_strided_inputs_as_the_mixer_passes_them(shared):
    """Angles as one set for every head ((b, t, 1, s), as the mixer passes them, their gradient
    summed over heads in the kernel) or expanded over heads (stride 0), (b, h, t) scalars as
    transposed views, v/z as slices of one projection: same numbers as contiguous inputs,
    gradients included."""
    b, t, h, p, n, s = 2, 100, 4, 64, 64, 16
    x = make_inputs(b=b, t=t, h=h, p=p, n=n, s=s)
    proj = torch.randn(b, t, 2 * h * p + 8, device=DEV).to(BF16)
    z_, v_ = proj[..., : h * p].view(b, t, h, p), proj[..., h * p : 2 * h * p].view(b, t, h, p)
    ang = torch.randn(b, t, s, device=DEV).requires_grad_()
    scal = [x[key].transpose(1, 2).contiguous().transpose(1, 2) for key in ("adt", "dt", "trap")]
    angles = ang[:, :, None] if shared else ang[:, :, None].expand(b, t, h, s)
    strided = dict(x, v=v_, z=z_, adt=scal[0], dt=scal[1], trap=scal[2], angles=angles)
    ang_c = ang.detach()[:, :, None].expand(b, t, h, s).contiguous().requires_grad_()
    dense = dict(x, v=v_.contiguous(), z=z_.contiguous(), angles=ang_c)
    gy = torch.randn(b, t, h, p, device=DEV)
    y1 = mamba3_siso(**strided, backend="triton")
    y2 = mamba3_siso(**dense, backend="triton")
    assert torch.equal(y1, y2)
    (g1,) = torch.autograd.grad((y1.float() * gy).sum(), [ang])
    (g2,) = torch.autograd.grad((y2.float() * gy).sum(), [ang_c])
    assert rel(g1, g2.sum(2)) <= 1e-6


def test_packed_z_and_v_equal_them_apart():
    """z and v as one (b, t, 2, h, p) tensor, as the mixer's one product for both gives them
    (with resets, as in training): the output and every gradient equal those of z and v apart,
    bitwise, and the gradient comes back packed as (dz, dv)."""
    b, t = 2, 300
    x = make_inputs(b=b, t=t)
    reset = torch.zeros(b, t, dtype=torch.bool, device=DEV)
    reset[:, [0, 77, 190]] = True
    apart = {k: None if v is None else v.clone().requires_grad_() for k, v in x.items()}
    packed = {k: None if v is None else v.clone().requires_grad_() for k, v in x.items()}
    zv = torch.stack([x["z"], x["v"]], dim=2).requires_grad_()
    packed["v"] = packed["z"] = None
    gy = torch.randn(b, t, 4, 64, device=DEV).to(BF16)
    y1 = mamba3_siso(**apart, reset=reset, backend="triton")
    y2 = mamba3_siso(**packed, zv=zv, reset=reset, backend="triton")
    assert torch.equal(y1, y2)
    (y1 * gy).sum().backward()
    (y2 * gy).sum().backward()
    assert torch.equal(zv.grad, torch.stack([apart["z"].grad, apart["v"].grad], dim=2))
    for name, leaf in packed.items():
        if leaf is not None:
            assert torch.equal(leaf.grad, apart[name].grad), name


@pytest.mark.parametrize("g", [1, 4], ids=["g1", "gh"])
def test_backward_is_deterministic(g):
    """No atomics: two backward calls on the same inputs give bitwise-equal gradients."""
    x = make_inputs(t=1000, g=g)
    st = make_state(2, 4, 64, 64, 16)
    gen = torch.Generator(device="cpu").manual_seed(3)
    gy = torch.randn(2, 1000, 4, 64, generator=gen).to(DEV)
    g_state = [
        torch.randn(*shape, generator=gen).to(DEV)
        for shape in ((2, 4, 16), (2, 4, 64, 64), (2, 4, 64), (2, 4, 64))
    ]
    first = _run(x, st, "triton", 64, gy, g_state, f64=False)[2]
    second = _run(x, st, "triton", 64, gy, g_state, f64=False)[2]
    assert first.keys() == second.keys()
    differ = [name for name in first if not torch.equal(first[name], second[name])]
    assert not differ, f"gradients differ between two identical calls: {differ}"


@pytest.mark.parametrize(
    "hpp,cpp,bv", [(2, 1, 0), (4, 1, 0), (1, 2, 0), (2, 3, 0), (1, 1, 32), (2, 2, 16)]
)
def test_heads_chunks_and_p_blocks_per_program_give_the_same_gradients(hpp, cpp, bv, monkeypatch):
    """The chunk kernel taking hpp heads of a group and cpp chunks in turn, and p in blocks of
    bv (launch plan fields, two pipeline stages; g = 1, four heads, t = 1000: a partial last
    chunk, and a partial last block of chunks at cpp 3) gives the gradients of one head, chunk
    and pass a program: dq, dk within the bf16 rounding of the per-head partials and of dS (summed
    over the blocks of p before it is rounded), and so the bias gradients (summed from those
    bf16 partials at one head a program, in fp32 at several), the rest within 1e-3 (the same
    arithmetic, compiled in loops); and two calls are bitwise equal."""
    from m3run.kernels.mamba3 import plans as lp
    from m3run.kernels.mamba3 import triton_siso

    x = make_inputs(t=1000, g=1)
    st = make_state(2, 4, 64, 64, 16)
    gen = torch.Generator(device="cpu").manual_seed(5)
    gy = torch.randn(2, 1000, 4, 64, generator=gen).to(DEV)
    g_state = [
        torch.randn(*shape, generator=gen).to(DEV)
        for shape in ((2, 4, 16), (2, 4, 64, 64), (2, 4, 64), (2, 4, 64))
    ]
    plan = triton_siso.plan_for(torch.device(DEV), 64, 64, 64, torch.bfloat16)
    base = _run(x, st, "triton", 64, gy, g_state, f64=False)[2]
    chunk_cfg = dataclasses.replace(
        plan.configs["bwd_chunk"], hpp=hpp, cpp=cpp, bv=bv, num_stages=2
    )
    blocked = lp.Plan(plan.chunk, dict(plan.configs, bwd_chunk=chunk_cfg))
    monkeypatch.setattr(triton_siso, "plan_for", lambda *args: blocked)
    first = _run(x, st, "triton", 64, gy, g_state, f64=False)[2]
    second = _run(x, st, "triton", 64, gy, g_state, f64=False)[2]
    assert all(torch.equal(first[k], second[k]) for k in first)
    for name in base:
        bound = 1e-2 if name in ("q", "k", "q_bias", "k_bias") else 1e-3
        assert rel(first[name], base[name]) <= bound, (name, rel(first[name], base[name]))


def test_no_grad_forward_equals_training_forward():
    x = make_inputs(t=100)
    with torch.no_grad():
        y0 = mamba3_siso(**x, backend="triton")
    leaves = {k: (v.clone().requires_grad_() if v is not None else None) for k, v in x.items()}
    assert torch.equal(mamba3_siso(**leaves, backend="triton").detach(), y0)


def test_auto_backend_picks_triton_on_cuda(caplog):
    import m3run.kernels.mamba3.api as api

    api._auto_logged.clear()
    x = make_inputs(t=64)
    with caplog.at_level(logging.INFO, logger="m3run.kernels.mamba3.api"):
        y_auto = mamba3_siso(**x, backend="auto")
    assert any("auto -> triton" in r.message for r in caplog.records)
    assert torch.equal(y_auto, mamba3_siso(**x, backend="triton"))


def test_tile_caps_are_value_errors_that_name_the_cap():
    x = make_inputs(t=64)
    with pytest.raises(ValueError, match=r"chunk_size.*pytorch"):
        mamba3_siso(**x, chunk_size=128, backend="triton")
    big = make_inputs(t=16, h=1, p=128)
    with pytest.raises(ValueError, match=r"head dim p at 64.*pytorch"):
        mamba3_siso(**big, backend="triton")
    x64 = dict(x, v=x["v"].double())
    with pytest.raises(ValueError, match=r"takes v in.*pytorch"):
        mamba3_siso(**x64, backend="triton")
