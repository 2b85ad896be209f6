"""Resets (document starts in a packed window) in the PyTorch references of the scan: a packed
document scans exactly as if alone, the chunked form equals the recurrence wherever the resets
fall (inside a chunk, on a chunk boundary, on every token), state passing still equals the whole
scan, and a bad mask is a ValueError that names it. All float64."""

from __future__ import annotations

import pytest
import torch
from helpers.scan_inputs import F64, make_inputs, rel, slice_time

from m3run.kernels.mamba3 import mamba3_siso, mamba3_siso_recurrent, zero_state

B, T, H, P, N, S = 2, 29, 3, 4, 8, 2
CHUNK = 8
PER_HEAD = ("q_bias", "k_bias", "d")


def chunked(**kw):
    return mamba3_siso(**kw, chunk_size=CHUNK, backend="pytorch")


SCANS = [
    pytest.param(chunked, id="chunked"),
    pytest.param(mamba3_siso_recurrent, id="recurrent"),
]


def starts(t: int, *positions: int, b: int = B) -> torch.Tensor:
    """A (b, t) reset mask, True at `positions` in every row."""
    reset = torch.zeros(b, t, dtype=torch.bool)
    reset[:, list(positions)] = True
    return reset


def random_state(seed: int = 5) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(*x.shape, dtype=F64, generator=gen)
        for x in zero_state(B, H, P, N, S, dtype=F64, device="cpu")
    )


def leaves(x: dict) -> dict:
    """Fresh leaf copies of the inputs that are given, for autograd."""
    return {k: v.detach().clone().requires_grad_(True) for k, v in x.items() if v is not None}


def grads_of(scan, x: dict, gy: torch.Tensor, **kw) -> tuple[torch.Tensor, dict]:
    """y and the gradients of sum(y·gy) with respect to every input of `x`."""
    inputs = leaves(x)
    y = scan(**inputs, **kw)
    grads = torch.autograd.grad((y * gy).sum(), list(inputs.values()))
    return y.detach(), dict(zip(inputs, grads, strict=True))


@pytest.mark.parametrize("start", [13, 16], ids=["inside-a-chunk", "on-a-chunk-boundary"])
@pytest.mark.parametrize("scan", SCANS)
def test_packed_second_document_equals_scanning_it_alone(scan, start):
    x = make_inputs(b=B, t=T, h=H, p=P, n=N, s=S)
    gy = torch.randn(B, T, H, P, dtype=F64, generator=torch.Generator().manual_seed(2))
    gy[:, :start] = 0.0  # the loss reads the second document only
    y, g = grads_of(scan, x, gy, reset=starts(T, start))
    y_alone, g_alone = grads_of(scan, slice_time(x, start, T), gy[:, start:])

    assert rel(y[:, start:], y_alone) <= 1e-10
    second, first = slice_time(g, start, T), slice_time(g, 0, start)
    for name in g_alone:
        assert rel(second[name], g_alone[name]) <= 1e-10, name
        if name not in PER_HEAD:
            # Nothing of the second document's loss reaches the first document's inputs.
            assert first[name].norm() <= 1e-10 * g_alone[name].norm(), name


@pytest.mark.parametrize("scan", SCANS)
def test_a_reset_on_the_first_token(scan):
    x = make_inputs(b=B, t=T, h=H, p=P, n=N, s=S)
    first = starts(T, 0)
    y, st = scan(**x, return_final_state=True)
    y_r, st_r = scan(**x, reset=first, return_final_state=True)
    assert rel(y_r, y) <= 1e-12
    for name, a, b in zip(("angle", "ssm", "k", "v"), st_r, st, strict=True):
        assert rel(a, b) <= 1e-12, name

    # With an initial state it discards the ssm state and the pending half-term (v_state);
    # the angle runs on.
    state = random_state()
    phi0, h0, k0, v0 = state
    y_r = scan(**x, initial_state=state, reset=first)
    y_zero = scan(**x, initial_state=(phi0, torch.zeros_like(h0), k0, torch.zeros_like(v0)))
    assert rel(y_r, y_zero) <= 1e-12
    assert rel(scan(**x, initial_state=state), y_zero) > 1e-3  # the discarded state mattered


PATTERNS = {
    "inside-chunks": [5, 13],
    "on-chunk-boundaries": [8, 16, 24],
    "one-token-documents": [10, 11, 12],
    "last-token": [T - 1],
    "every-token": list(range(T)),
}


@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "initial-state"])
@pytest.mark.parametrize("positions", PATTERNS.values(), ids=PATTERNS.keys())
def test_chunked_equals_recurrent_with_resets(positions, with_state):
    x = make_inputs(b=B, t=T, h=H, p=P, n=N, s=S, g=H if with_state else 1, seed=1)
    reset = starts(T, *positions)
    gen = torch.Generator().manual_seed(4)
    reset[1] = torch.rand(T, generator=gen) < 0.2  # the second row: resets of its own
    if with_state:
        x["initial_state"] = random_state()
    gy = torch.randn(B, T, H, P, dtype=F64, generator=gen)
    g_state = random_state(seed=6)

    def run(scan):
        inputs = leaves({k: v for k, v in x.items() if k != "initial_state"})
        if with_state:
            inputs["initial_state"] = tuple(leaves(dict(enumerate(x["initial_state"]))).values())
        y, st = scan(**inputs, reset=reset, return_final_state=True)
        loss = (y * gy).sum() + sum((a * b).sum() for a, b in zip(st, g_state, strict=True))
        wrt = [v for k, v in inputs.items() if k != "initial_state"]
        wrt += list(inputs.get("initial_state", ()))
        return y, st, torch.autograd.grad(loss, wrt)

    y_c, st_c, g_c = run(chunked)
    y_r, st_r, g_r = run(mamba3_siso_recurrent)
    assert rel(y_c, y_r) <= 1e-10
    for name, a, b in zip(("angle", "ssm", "k", "v"), st_c, st_r, strict=True):
        assert rel(a, b) <= 1e-10, name
    for i, (a, b) in enumerate(zip(g_c, g_r, strict=True)):
        assert rel(a, b) <= 1e-10, f"gradient {i}"


@pytest.mark.parametrize("t1", [9, 16, 25], ids=lambda t1: f"split-{t1}")
def test_split_with_resets_in_both_halves_equals_the_whole(t1):
    t = 37
    x = make_inputs(t=t, g=3)
    reset = starts(t, 5, 16, 20, 30, b=2)  # t1 = 16 splits at a reset
    y, st = mamba3_siso(
        **x, chunk_size=CHUNK, reset=reset, return_final_state=True, backend="pytorch"
    )
    ya, sa = mamba3_siso(
        **slice_time(x, 0, t1),
        chunk_size=CHUNK,
        reset=reset[:, :t1],
        return_final_state=True,
        backend="pytorch",
    )
    yb, sb = mamba3_siso(
        **slice_time(x, t1, t),
        chunk_size=CHUNK,
        initial_state=sa,
        reset=reset[:, t1:],
        return_final_state=True,
        backend="pytorch",
    )
    assert rel(torch.cat([ya, yb], dim=1), y) <= 1e-12
    for a, b in zip(sb, st, strict=True):
        assert rel(a, b) <= 1e-12


BAD_RESETS = [
    ("shape", torch.zeros(2, 36, dtype=torch.bool), r"reset must be a \(b, t\)=\(2, 37\) bool"),
    ("transposed", torch.zeros(37, 2, dtype=torch.bool), r"got \(37, 2\)"),
    ("list", [[False] * 37] * 2, r"reset must be a \(b, t\)=\(2, 37\) bool tensor .*got list"),
    ("dtype", torch.zeros(2, 37, dtype=torch.long), r"bool tensor, got torch.int64"),
    ("device", torch.zeros(2, 37, dtype=torch.bool, device="meta"), r"on one device.*meta"),
]


@pytest.mark.parametrize("scan", SCANS)
@pytest.mark.parametrize("bad,msg", [b[1:] for b in BAD_RESETS], ids=[b[0] for b in BAD_RESETS])
def test_a_bad_reset_is_a_named_value_error(scan, bad, msg):
    x = make_inputs(t=37)
    with pytest.raises(ValueError, match=msg):
        scan(**x, reset=bad)
