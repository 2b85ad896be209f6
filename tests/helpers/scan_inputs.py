"""Scan inputs the kernel tests share."""

from __future__ import annotations

import torch
import torch.nn.functional as F

F64 = torch.float64


def slice_time(x: dict, lo: int, hi: int) -> dict:
    """The scan inputs of tokens [lo, hi) (per-head parameters unchanged)."""
    out = {}
    for key, val in x.items():
        if val is None or key in ("q_bias", "k_bias", "d"):
            out[key] = val
        elif key in ("adt", "dt", "trap"):
            out[key] = val[..., lo:hi]
        else:
            out[key] = val[:, lo:hi]
    return out


def make_inputs(b=2, t=37, h=3, p=4, n=8, s=2, g=1, with_d=True, with_z=True, dtype=F64, seed=0):
    """Random scan inputs of the references' tests: Δ = softplus(·), A·Δ < 0, float64 by default
    (the per-token scalars and per-head parameters in float32 for any other dtype)."""
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, dtype=dt)

    dt = F.softplus(r(b, h, t, dt=F64) - 1.0)
    A = torch.clamp(-F.softplus(r(b, h, t, dt=F64)), max=-1e-4)
    return dict(
        q=r(b, t, g, n),
        k=r(b, t, g, n),
        v=r(b, t, h, p),
        adt=(A * dt).to(dtype if dtype == F64 else torch.float32),
        dt=dt.to(dtype if dtype == F64 else torch.float32),
        trap=r(b, h, t, dt=F64).to(dtype if dtype == F64 else torch.float32),
        q_bias=r(h, n, dt=F64).to(dtype if dtype == F64 else torch.float32),
        k_bias=r(h, n, dt=F64).to(dtype if dtype == F64 else torch.float32),
        angles=(2 * r(b, t, h, s, dt=F64)).to(dtype if dtype == F64 else torch.float32),
        d=r(h) if with_d else None,
        z=r(b, t, h, p) if with_z else None,
    )


def rel(a, b) -> float:
    """‖a − b‖ / ‖b‖."""
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()
