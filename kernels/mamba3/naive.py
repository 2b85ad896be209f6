"""Recurrent (token-by-token) reference of the Mamba-3 SISO scan: the ground truth.

One call of :func:`siso_step` advances the state by one token exactly as the recurrence in
README.md is written; :func:`siso_recurrent` loops it over a sequence. Generation reuses
``siso_step`` directly, so decoding does O(1) work per new token.

Inputs are already in the compute dtype (float32 or float64) and already expanded from
``g`` groups to ``h`` heads; :mod:`m3run.kernels.mamba3.api` does the validation and casting.

A ``reset`` token (a document start in a packed window) sees a zero state: neither the state
before it nor the previous token's pending trapezoid half-term enters. The cumulative angle Φ
goes on accumulating across it: scores depend on Φ_i − Φ_j inside a document only, so a
document's outputs and gradients do not depend on the angle it starts from.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

TWO_PI = 2.0 * math.pi

# (angle_state (b,h,s), ssm_state (b,h,p,n), k_state (b,h,n), v_state (b,h,p))
State = tuple[Tensor, Tensor, Tensor, Tensor]


def rotate_pairs(x: Tensor, phi: Tensor) -> Tensor:
    """Rotate pairs (0,1), (2,3), …, (2S-2, 2S-1) of the last dim of ``x`` by ``phi`` (…, S).

    ``[a, b] -> [a cos(phi) - b sin(phi), a sin(phi) + b cos(phi)]``; dims past 2S are unchanged.
    """
    s = phi.shape[-1]
    if s == 0:
        return x
    pairs = x[..., : 2 * s].unflatten(-1, (s, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    cos, sin = torch.cos(phi), torch.sin(phi)
    rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((rotated, x[..., 2 * s :]), dim=-1)


def zero_state(b: int, h: int, p: int, n: int, s: int, *, dtype, device) -> State:
    return (
        torch.zeros(b, h, s, dtype=dtype, device=device),
        torch.zeros(b, h, p, n, dtype=dtype, device=device),
        torch.zeros(b, h, n, dtype=dtype, device=device),
        torch.zeros(b, h, p, dtype=dtype, device=device),
    )


def siso_step(
    q: Tensor,  # (b, h, n) RMS-normed C, no bias
    k: Tensor,  # (b, h, n) RMS-normed B, no bias
    v: Tensor,  # (b, h, p)
    adt: Tensor,  # (b, h)  A·Δ
    dt: Tensor,  # (b, h)  Δ
    trap: Tensor,  # (b, h)  pre-sigmoid λ
    q_bias: Tensor,  # (h, n)
    k_bias: Tensor,  # (h, n)
    angles: Tensor,  # (b, h, s) pre-tanh θ
    d: Tensor | None,  # (h,)
    z: Tensor | None,  # (b, h, p)
    state: State,
    reset: Tensor | None = None,  # (b,) bool: the state before this token is zero
) -> tuple[Tensor, State]:
    """Advance the scan by one token. Returns ``y_t`` (b, h, p) and the new state."""
    phi_prev, h_prev, k_prev, v_prev = state
    if reset is not None:
        # Zeroing x_{t-1} drops the pending half-term (1-λ_t)Δ_t·α_t·x_{t-1}k̄_{t-1}ᵀ with h.
        h_prev = torch.where(reset[:, None, None, None], 0.0, h_prev)
        v_prev = torch.where(reset[:, None, None], 0.0, v_prev)
    # Φ_t = (Φ_{t-1} + Δ_t·π·tanh(θ̃_t)) mod 2π — the cumulative (data-dependent) RoPE angle.
    phi = torch.remainder(phi_prev + dt[..., None] * math.pi * torch.tanh(angles), TWO_PI)
    k_bar = rotate_pairs(k + k_bias, phi)
    q_bar = rotate_pairs(q + q_bias, phi)
    lam = torch.sigmoid(trap)[..., None, None]
    alpha = torch.exp(adt)[..., None, None]
    delta = dt[..., None, None]
    # Exponential-trapezoidal rule: the previous token's outer product enters with weight
    # (1-λ_t)Δ_t·α_t, the current one with λ_tΔ_t (Mamba-3, §3).
    h_new = (
        alpha * h_prev
        + (1.0 - lam) * delta * alpha * (v_prev[..., :, None] * k_prev[..., None, :])
        + lam * delta * (v[..., :, None] * k_bar[..., None, :])
    )
    y = torch.einsum("bhpn,bhn->bhp", h_new, q_bar)
    if d is not None:
        y = y + d[:, None] * v
    if z is not None:
        y = y * torch.nn.functional.silu(z)
    return y, (phi, h_new, k_bar, v)


def siso_recurrent(
    q: Tensor,  # (b, t, h, n)
    k: Tensor,  # (b, t, h, n)
    v: Tensor,  # (b, t, h, p)
    adt: Tensor,  # (b, h, t)
    dt: Tensor,  # (b, h, t)
    trap: Tensor,  # (b, h, t)
    q_bias: Tensor,
    k_bias: Tensor,
    angles: Tensor,  # (b, t, h, s)
    d: Tensor | None,
    z: Tensor | None,  # (b, t, h, p)
    initial_state: State | None,
    reset: Tensor | None = None,  # (b, t) bool
) -> tuple[Tensor, State]:
    """Scan a whole sequence token by token. Returns y (b, t, h, p) and the final state."""
    b, t, h, n = k.shape
    p, s = v.shape[-1], angles.shape[-1]
    state = initial_state
    if state is None:
        state = zero_state(b, h, p, n, s, dtype=v.dtype, device=v.device)
    ys = []
    for i in range(t):
        y, state = siso_step(
            q[:, i],
            k[:, i],
            v[:, i],
            adt[..., i],
            dt[..., i],
            trap[..., i],
            q_bias,
            k_bias,
            angles[:, i],
            d,
            None if z is None else z[:, i],
            state,
            None if reset is None else reset[:, i],
        )
        ys.append(y)
    return torch.stack(ys, dim=1), state
