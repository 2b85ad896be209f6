"""The Mamba-3 SISO mixer (Lahoti et al., "Mamba-3", 2026), as DESIGN.md describes it.

One input projection (one weight, taken as two products: z and x together, and the rest; see
_in_proj), per-token Δ, A and trapezoid λ, data-dependent rotation angles (one set for every
head), RMS-normed B/C with per-head biases, the SISO scan, the silu(z) gate inside the scan,
and the output projection. No short convolution: the trapezoid rule's two-token stencil
replaces it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from m3run.kernels.mamba3 import State, mamba3_siso, mamba3_siso_step, zero_state

from .config import ModelConfig
from .layers import linear_rows


def _f32(x: Tensor) -> Tensor:
    """At least fp32: bf16 activations are upcast, float64 (exact tests) stays float64."""
    return x if x.dtype == torch.float64 else x.float()


def heavy_tail(x: Tensor) -> Tensor:
    """f(x) = 1 + x for x ≥ 0 and 1/(1 − x) below: positive, with f and f' continuous at 0
    (both 1). Against softplus, A's magnitude grows linearly rather than exponentially in
    dd_A's positive half, and decays as 1/|x| rather than exp(x) in the negative half, so a
    head keeps a usable gradient towards both long and short memories (the official Mamba-3
    module's activation since mamba_ssm PR #962, adopted there for stability at high learning
    rates). The negative branch reads x clamped at 0, so that where x ≥ 0 selects the other
    branch its gradient is 0, never 0·∞ at x = 1."""
    return torch.where(x >= 0, 1 + x, torch.reciprocal(1 - x.clamp_max(0)))


# model.A_activation: the f of A = min(−f(dd_A), −A_floor).
A_ACTIVATIONS = {"heavy_tail": heavy_tail, "softplus": F.softplus}


class Mamba3Mixer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int = 0):
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        E, N, H, S = cfg.d_inner, cfg.d_state, cfg.nheads, cfg.n_angles
        self.d_inner, self.d_state, self.nheads, self.headdim, self.n_angles = (
            E,
            N,
            H,
            cfg.headdim,
            S,
        )
        self.ngroups = cfg.ngroups
        self.A_activation = A_ACTIVATIONS[cfg.A_activation]
        G = cfg.ngroups
        # order: [z (E), x (E), B (G·N), C (G·N), dd_dt (H), dd_A (H), trap (H), angles (S)]
        self.split_sizes = [E, E, G * N, G * N, H, H, H, S]
        self.in_proj = nn.Linear(cfg.d_model, sum(self.split_sizes), bias=False)
        self.out_proj = nn.Linear(E, cfg.d_model, bias=False)

        # Δ₀ ~ log-uniform[dt_min, dt_max], floored; dt_bias = softplus⁻¹(Δ₀) so that
        # softplus(0 + dt_bias) = Δ₀ at init (Mamba-2's initialisation).
        self.dt_bias = nn.Parameter(torch.empty(H))
        self.D = nn.Parameter(torch.empty(H))
        self.B_bias = nn.Parameter(torch.empty(H, N))
        self.C_bias = nn.Parameter(torch.empty(H, N))
        self.B_norm_weight = nn.Parameter(torch.empty(N))
        self.C_norm_weight = nn.Parameter(torch.empty(N))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        c = self.cfg
        u = torch.rand(self.nheads)
        dt = torch.exp(u * (math.log(c.dt_max) - math.log(c.dt_min)) + math.log(c.dt_min))
        dt = dt.clamp(min=c.dt_init_floor)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        self.D.fill_(1.0)
        self.B_bias.fill_(1.0)
        self.C_bias.fill_(1.0)
        self.B_norm_weight.fill_(1.0)
        self.C_norm_weight.fill_(1.0)

    def _in_proj(self, u: Tensor) -> tuple[Tensor, ...]:
        """in_proj's outputs [zx, B, C, Δ̃, Ã, λ̃, θ̃] as two products of row blocks of its
        weight: z and x in one (b, t, 2E), which the scan takes packed and whose gradient it
        returns packed, so its input and weight gradients are one product each (K or M = 2E);
        and the rest, apart. Split from one product instead, the backward would first concatenate
        the scan's gradient with the rest's into one (b, t, 4,336) gradient, a copy of every
        token's in_proj gradient per layer and micro-batch."""
        w, E = self.in_proj.weight, self.d_inner
        zx, rest = linear_rows(u, w, [2 * E, w.shape[0] - 2 * E], self.cfg.scan_backend)
        return (zx, *rest.split(self.split_sizes[2:], dim=-1))

    def _project(self, u: Tensor):
        """in_proj and the per-token parameters. Returns the scan's inputs, token-major: z and
        x packed as ``zv`` (b, t, 2, h, p) and, as views of it, ``z`` and ``v``."""
        b, t, _ = u.shape
        H, P, N, G = self.nheads, self.headdim, self.d_state, self.ngroups
        zx, B, C, dd_dt, dd_A, trap, angles = self._in_proj(u)
        zv = zx.view(b, t, 2, H, P)
        # Δ and A in fp32: they enter exp() and a cumulative sum.
        dt = F.softplus(_f32(dd_dt) + self.dt_bias)  # (b, t, h)
        A = torch.clamp(-self.A_activation(_f32(dd_A)), max=-self.cfg.A_floor)
        adt = A * dt
        eps = self.cfg.norm_eps
        B = F.rms_norm(_f32(B).view(b, t, G, N), (N,), _f32(self.B_norm_weight), eps)
        C = F.rms_norm(_f32(C).view(b, t, G, N), (N,), _f32(self.C_norm_weight), eps)
        return dict(
            q=C.to(u.dtype),
            k=B.to(u.dtype),
            zv=zv,
            v=zv[:, :, 1],
            z=zv[:, :, 0],
            adt=adt,
            dt=dt,
            trap=_f32(trap),
            angles=_f32(angles).unsqueeze(2),  # (b, t, 1, S): one set for every head
        )

    def forward(
        self,
        u: Tensor,  # (b, t, d_model)
        initial_state: State | None = None,
        return_final_state: bool = False,
        reset: Tensor | None = None,  # (b, t) bool: the scan state is zero before these tokens
    ):
        b, t, _ = u.shape
        p = self._project(u)
        out = mamba3_siso(
            p["q"],
            p["k"],
            None,
            p["adt"].transpose(1, 2),
            p["dt"].transpose(1, 2),
            p["trap"].transpose(1, 2),
            self.C_bias,
            self.B_bias,
            p["angles"],
            self.D,
            None,
            zv=p["zv"],
            chunk_size=self.cfg.chunk_size,
            initial_state=initial_state,
            return_final_state=return_final_state,
            reset=reset,
            backend=self.cfg.scan_backend,
        )
        y, state = out if return_final_state else (out, None)
        w = self.out_proj.weight
        (y,) = linear_rows(y.reshape(b, t, self.d_inner), w, [w.shape[0]], self.cfg.scan_backend)
        return (y, state) if return_final_state else y

    def empty_state(self, batch: int, device, dtype=torch.float32) -> State:
        return zero_state(
            batch,
            self.nheads,
            self.headdim,
            self.d_state,
            self.n_angles,
            dtype=dtype,
            device=device,
        )

    def step(self, u: Tensor, state: State) -> tuple[Tensor, State]:
        """Decode one token: u (b, 1, d_model) → (y (b, 1, d_model), new state). O(1) in t."""
        b = u.shape[0]
        p = self._project(u)
        y, state = mamba3_siso_step(
            p["q"][:, 0],
            p["k"][:, 0],
            p["v"][:, 0],
            p["adt"][:, 0],
            p["dt"][:, 0],
            p["trap"][:, 0],
            self.C_bias,
            self.B_bias,
            p["angles"][:, 0],
            self.D,
            p["z"][:, 0],
            state,
        )
        return self.out_proj(y.reshape(b, 1, self.d_inner)), state
