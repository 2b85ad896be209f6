"""Triton forward and backward of the Mamba-3 SISO scan (the contract in :mod:`kernels.mamba3.api`).

Forward: one program per (batch, head) walks the sequence chunk by chunk and keeps the augmented
inter-chunk state ``G`` (p × n, fp32; see :mod:`kernels.mamba3.chunk`) in registers, so no
per-chunk state goes to memory on the inference path. Inside a chunk of ``BT`` tokens it builds
the masked (BT × BT) score matrix ``q̄k̄ᵀ ⊙ exp(segsum(adt)) ⊙ W`` (``W`` holds the trapezoid
weights ``w_j`` below the diagonal and ``λ_jΔ_j`` on it: the diagonal correction), multiplies it
into ``x``, adds the inter-chunk term ``exp(A_i)·G q̄_i``, the ``D`` skip and the ``silu(z)``
gate, and folds the chunk into ``G``. The cumulative RoPE angle ``Φ`` is a chunk-local cumsum
plus an offset carried in registers (mod 2π); the rotation is applied to ``q + q_bias`` and
``k + k_bias`` as they are loaded: rows are read whole, split into the even ("E") and odd ("O")
components of each pair ``(2m, 2m+1)``, rotated elementwise and joined back for the dots.

Backward: two versions, chosen by ``SCAN_BWD`` (env ``M3RUN_SCAN_BWD``). "v2", the default, is
the chunk-parallel backward of :mod:`kernels.mamba3.triton_siso_bwd`. "v1", kept for
comparison, runs in two passes per (batch, head), both in reverse chunk order:

1. ``_siso_bwd_state_kernel`` carries ``dG`` (fp32) and does every dot: it recomputes the
   scores and the pre-gate output, writes ``dv``, ``dz``, the gradients of the trapezoid
   weights (``dw``, ``dcur``) and ``dq̄``, ``dk̄`` in the rotated frame. The training forward
   saves the state entering every chunk for it (in the dot dtype: the values its dots used)
   and the angle offset of every chunk.
2. ``_siso_bwd_angle_kernel`` rotates ``dq̄, dk̄`` back in place and carries the reverse
   cumsums of the angle gradient and of the ``adt`` gradient, which uses the identity
   ``∂L/∂B_i = q̄_i·∂L/∂q̄_i − k̄_i·∂L/∂k̄_i`` for the global cumsum ``B`` of ``adt``, plus
   ``<dG_T, G_T>`` for the final state.

What stays in PyTorch (all O(b·t·h) or O(b·h·p·n), no pass over the (b, t, h, p) tensors):
folding a carried ``initial_state`` into the augmented start state, the final ``k_state`` /
``v_state``, the trapezoid chain rule from ``(dw, dcur)`` to ``(ddt, dtrap)`` (it shifts by
one token across chunk borders), and the sums of the per-head ``q``/``k`` gradients over heads
(g = 1) and of the bias and ``d`` gradients over batch and time.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import Tensor

from .naive import State, rotate_pairs

try:  # Triton is optional: CPU machines import this module without it.
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - depends on the machine
    triton = None
    tl = None
    TRITON_IMPORT_ERROR: str | None = f"triton is not importable ({exc})"
else:
    TRITON_IMPORT_ERROR = None

# Tile caps: every (BT, BP, BN) tile lives in registers, and the backward holds about a dozen.
CHUNK_SIZES = (16, 32, 64)
MAX_HEADDIM = 64  # p (p = n = 128 overflows the backward's shared memory on an H200)
MAX_DSTATE = 64  # n
DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Which backward runs: "v1", the two-pass backward below, or "v2", the chunk-parallel one of
# :mod:`kernels.mamba3.triton_siso_bwd`. Read once at import (env M3RUN_SCAN_BWD); tests and
# benchmarks set the attribute. Checked, with a ValueError, when the scan is called.
SCAN_BWD_VERSIONS = ("v1", "v2")
SCAN_BWD_DEFAULT = "v2"
SCAN_BWD = os.environ.get("M3RUN_SCAN_BWD", SCAN_BWD_DEFAULT)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def shape_error(v: Tensor, n: int, chunk_size: int) -> str | None:
    """Why the Triton kernel cannot take these shapes or dtypes (None when it can)."""
    p = v.shape[-1]
    hint = '; use backend="pytorch"'
    if chunk_size not in CHUNK_SIZES:
        return f"the Triton scan takes chunk_size in {CHUNK_SIZES}, got {chunk_size}{hint}"
    if p > MAX_HEADDIM:
        return f"the Triton scan caps the head dim p at {MAX_HEADDIM}, got p={p}{hint}"
    if n > MAX_DSTATE:
        return f"the Triton scan caps the state size n at {MAX_DSTATE}, got n={n}{hint}"
    if v.dtype not in DTYPES:
        return f"the Triton scan takes v in {DTYPES}, got {v.dtype}{hint}"
    return None


if triton is not None:
    _PI = tl.constexpr(math.pi)
    _TWO_PI = tl.constexpr(2.0 * math.pi)

    @triton.jit
    def _tanh(x):
        # exp of a non-positive argument: no overflow, no cancellation near 0 beyond fp32.
        e = tl.exp(-2.0 * tl.abs(x))
        r = (1.0 - e) / (1.0 + e)
        return tl.where(x < 0, -r, r)

    @triton.jit
    def _load_pairs(base, o_r, m_r, row_stride, N, BN2: tl.constexpr):
        """Rows ``o_r`` of a row-major (R, N) matrix as its even and odd columns (zero-padded).
        Rows are read whole (vectorised) and split in registers."""
        o_n = tl.arange(0, 2 * BN2)
        b_x = tl.load(
            base + o_r[:, None] * row_stride + o_n[None, :],
            mask=m_r[:, None] & (o_n < N)[None, :],
            other=0.0,
        )
        return tl.split(tl.reshape(b_x, (o_r.shape[0], BN2, 2)))

    @triton.jit
    def _store_pairs(base, o_r, m_r, row_stride, N, b_e, b_o, BN2: tl.constexpr):
        o_n = tl.arange(0, 2 * BN2)
        b_x = tl.reshape(tl.join(b_e, b_o), (o_r.shape[0], 2 * BN2))
        tl.store(
            base + o_r[:, None] * row_stride + o_n[None, :],
            b_x.to(base.dtype.element_ty),
            mask=m_r[:, None] & (o_n < N)[None, :],
        )

    @triton.jit
    def _load_chunk_scalars(adt, dt, trap, T, o_tc, m_t, o_t, BT: tl.constexpr):
        """Per-token scalars of one chunk: cumulative decay, its last value, w and λΔ."""
        m_n = o_tc + 1 < T
        b_adt = tl.load(adt + o_tc, mask=m_t, other=0.0)
        b_dt = tl.load(dt + o_tc, mask=m_t, other=0.0)
        b_lam = tl.sigmoid(tl.load(trap + o_tc, mask=m_t, other=0.0))
        # Δ_{t+1}, λ_{t+1}; Δ_{T+1} = 0 ends the trapezoid at the last token.
        b_dtn = tl.load(dt + o_tc + 1, mask=m_n, other=0.0)
        b_lamn = tl.sigmoid(tl.load(trap + o_tc + 1, mask=m_n, other=0.0))
        b_cur = b_lam * b_dt
        b_w = b_cur + (1.0 - b_lamn) * b_dtn
        b_A = tl.cumsum(b_adt, axis=0)
        b_AL = tl.sum(tl.where(o_t == BT - 1, b_A, 0.0), axis=0)
        return b_dt, b_cur, b_w, b_A, b_AL

    @triton.jit
    def _decay_weights(b_A, b_w, b_cur, m_strict, m_diag):
        """exp(A_i − A_j)·W_ij: w_j below the diagonal, λ_jΔ_j on it (the diagonal correction)."""
        b_decay = tl.exp(tl.minimum(b_A[:, None] - b_A[None, :], 0.0))
        return tl.where(m_strict, b_decay * b_w[None, :], tl.where(m_diag, b_cur[None, :], 0.0))

    @triton.jit
    def _rotated_natural(x, o_tc, m_t, row_stride, N, b_bias, b_cos, b_sin, BN2: tl.constexpr):
        """R(Φ)(x + bias) for rows ``o_tc``, fp32, columns in natural order (pairs adjacent)."""
        o_n = tl.arange(0, 2 * BN2)
        b_x = tl.load(
            x + o_tc[:, None] * row_stride + o_n[None, :],
            mask=m_t[:, None] & (o_n < N)[None, :],
            other=0.0,
        )
        b_x = b_x.to(tl.float32) + b_bias[None, :]
        b_e, b_o = tl.split(tl.reshape(b_x, (o_tc.shape[0], BN2, 2)))
        b_r = tl.join(b_e * b_cos - b_o * b_sin, b_e * b_sin + b_o * b_cos)
        return tl.reshape(b_r, (o_tc.shape[0], 2 * BN2))

    @triton.jit
    def _rotated_qk(q, k, o_tc, m_t, GN, N, b_qbE, b_qbO, b_kbE, b_kbO, b_cos, b_sin,
                    BN2: tl.constexpr):  # fmt: skip
        """q̄ = R(Φ)(q + q_bias), k̄ likewise, as fp32 (even, odd) halves."""
        b_qE, b_qO = _load_pairs(q, o_tc, m_t, GN, N, BN2)
        b_kE, b_kO = _load_pairs(k, o_tc, m_t, GN, N, BN2)
        b_qE = b_qE.to(tl.float32) + b_qbE[None, :]
        b_qO = b_qO.to(tl.float32) + b_qbO[None, :]
        b_kE = b_kE.to(tl.float32) + b_kbE[None, :]
        b_kO = b_kO.to(tl.float32) + b_kbO[None, :]
        b_qEr = b_qE * b_cos - b_qO * b_sin
        b_qOr = b_qE * b_sin + b_qO * b_cos
        b_kEr = b_kE * b_cos - b_kO * b_sin
        b_kOr = b_kE * b_sin + b_kO * b_cos
        return b_qEr, b_qOr, b_kEr, b_kOr

    # T and NC vary with every batch shape: not worth a compile each.
    @triton.jit(do_not_specialize=["T", "NC"])
    def _siso_fwd_kernel(
        q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, phi0, g0,
        y, phi_t, g_t, g_in, phi_in,
        T, NC, H, HPG, P, N, S,
        s_vb, s_vt, s_vh, s_zb, s_zt, s_zh, s_ab, s_at, s_ah, s_as,
        BT: tl.constexpr, BP: tl.constexpr, BV: tl.constexpr, BN2: tl.constexpr,
        HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_H0: tl.constexpr, SAVE: tl.constexpr,
    ):  # fmt: skip
        i_v, i_bh = tl.program_id(0), tl.program_id(1)
        i_b, i_h = i_bh // H, i_bh % H
        i_g = i_h // HPG
        G = H // HPG
        # Scalar bases: per-element offsets stay 32-bit and block pointers carry the strides.
        q += (i_b.to(tl.int64) * T * G + i_g) * N
        k += (i_b.to(tl.int64) * T * G + i_g) * N
        v += i_b.to(tl.int64) * s_vb + i_h * s_vh
        z += i_b.to(tl.int64) * s_zb + i_h * s_zh
        y += (i_b.to(tl.int64) * T * H + i_h) * P
        angles += i_b.to(tl.int64) * s_ab + i_h * s_ah
        adt += i_bh.to(tl.int64) * T
        dt += i_bh.to(tl.int64) * T
        trap += i_bh.to(tl.int64) * T

        o_t = tl.arange(0, BT)
        o_v = i_v * BV + tl.arange(0, BV)
        o_m = tl.arange(0, BN2)
        m_v = o_v < P
        m_s = o_m < S
        m_strict = o_t[:, None] > o_t[None, :]
        m_diag = o_t[:, None] == o_t[None, :]

        o_n = tl.arange(0, 2 * BN2)
        m_n = o_n < N
        b_qb = tl.load(q_bias + i_h * N + o_n, mask=m_n, other=0.0)
        b_kb = tl.load(k_bias + i_h * N + o_n, mask=m_n, other=0.0)
        if HAS_D:
            b_D = tl.load(d + i_h).to(tl.float32)

        # The augmented state G (p × n), fp32.
        p_g = i_bh.to(tl.int64) * P * N + o_v[:, None] * N + o_n[None, :]
        m_g = m_v[:, None] & m_n[None, :]
        if HAS_H0:
            b_G = tl.load(g0 + p_g, mask=m_g, other=0.0)
            b_phi0 = tl.load(phi0 + i_bh * S + o_m, mask=m_s, other=0.0)
        else:
            b_G = tl.zeros([BV, 2 * BN2], dtype=tl.float32)
            b_phi0 = tl.zeros([BN2], dtype=tl.float32)

        for i_c in range(NC):
            o_tc = i_c * BT + o_t
            m_t = o_tc < T
            b_dt, b_cur, b_w, b_A, b_AL = _load_chunk_scalars(adt, dt, trap, T, o_tc, m_t, o_t, BT)

            # Φ = carried offset + chunk-local cumsum of Δ·π·tanh(θ̃).
            m_a = m_t[:, None] & m_s[None, :]
            b_th = tl.load(angles + o_tc[:, None] * s_at + o_m[None, :] * s_as, mask=m_a, other=0.0)
            b_dphi = b_dt[:, None] * _PI * _tanh(b_th)
            b_phi = b_phi0[None, :] + tl.cumsum(b_dphi, axis=0)
            b_cos, b_sin = tl.cos(b_phi), tl.sin(b_phi)
            if SAVE:  # noqa: SIM102 (SAVE is a compile-time flag, i_v a run-time value)
                if i_v == 0:
                    tl.store(phi_in + (i_bh.to(tl.int64) * NC + i_c) * BN2 + o_m, b_phi0)
            b_phi0 = b_phi0 + tl.sum(b_dphi, axis=0)
            b_phi0 = b_phi0 - _TWO_PI * tl.floor(b_phi0 / _TWO_PI)

            b_q = _rotated_natural(q, o_tc, m_t, G * N, N, b_qb, b_cos, b_sin, BN2)
            b_k = _rotated_natural(k, o_tc, m_t, G * N, N, b_kb, b_cos, b_sin, BN2)
            m_x = m_t[:, None] & m_v[None, :]
            b_x = tl.load(v + o_tc[:, None] * s_vt + o_v[None, :], mask=m_x, other=0.0)
            DT = b_x.dtype
            b_qc = b_q.to(DT)

            # Intra-chunk: (q̄k̄ᵀ ⊙ exp(A_i − A_j) ⊙ W) x, W = w_j below the diagonal, λ_jΔ_j on it.
            b_s = tl.dot(b_qc, tl.trans(b_k.to(DT)))
            b_Dw = _decay_weights(b_A, b_w, b_cur, m_strict, m_diag)
            b_o = tl.dot((b_s * b_Dw).to(DT), b_x)

            # Inter-chunk: exp(A_i) · G q̄_i, with the state entering the chunk.
            b_Gc = b_G.to(DT)
            if SAVE:
                p_gi = g_in + (i_bh.to(tl.int64) * NC + i_c) * BP * 2 * BN2
                tl.store(p_gi + o_v[:, None] * (2 * BN2) + o_n[None, :], b_Gc)
            b_o += tl.exp(b_A)[:, None] * tl.dot(b_qc, tl.trans(b_Gc))

            # Fold the chunk into G: G ← exp(A_L)·G + Σ_j exp(A_L − A_j)·w_j · x_j k̄_jᵀ.
            b_ew = tl.exp(b_AL - b_A) * b_w
            b_G = b_G * tl.exp(b_AL) + tl.dot(tl.trans(b_x), (b_k * b_ew[:, None]).to(DT))

            if HAS_D:
                b_o += b_D * b_x.to(tl.float32)
            if HAS_Z:
                b_z = tl.load(z + o_tc[:, None] * s_zt + o_v[None, :], mask=m_x, other=0.0)
                b_z = b_z.to(tl.float32)
                b_o = b_o * b_z * tl.sigmoid(b_z)
            p_y = y + o_tc[:, None] * (H * P) + o_v[None, :]
            tl.store(p_y, b_o.to(p_y.dtype.element_ty), mask=m_x)

        tl.store(g_t + p_g, b_G, mask=m_g)
        if i_v == 0:
            tl.store(phi_t + i_bh * S + o_m, b_phi0, mask=m_s)

    @triton.jit(do_not_specialize=["T", "NC"])
    def _siso_bwd_state_kernel(
        q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, g_in, phi_in, dy, dg_t,
        dqr, dkr, dv, dz, dw, dcur, dg0, dd,
        T, NC, H, HPG, P, N, S,
        s_vb, s_vt, s_vh, s_zb, s_zt, s_zh, s_ab, s_at, s_ah, s_as,
        BT: tl.constexpr, BP: tl.constexpr, BN2: tl.constexpr,
        HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DGT: tl.constexpr,
    ):  # fmt: skip
        """Backward, part 1: one reverse pass per (batch, head) carrying dG, doing every dot.
        Writes dv, dz, the trapezoid-weight gradients and dq̄, dk̄ in the rotated frame."""
        i_bh = tl.program_id(0)
        i_b, i_h = i_bh // H, i_bh % H
        i_g = i_h // HPG
        G = H // HPG
        q += (i_b.to(tl.int64) * T * G + i_g) * N
        k += (i_b.to(tl.int64) * T * G + i_g) * N
        v += i_b.to(tl.int64) * s_vb + i_h * s_vh
        z += i_b.to(tl.int64) * s_zb + i_h * s_zh
        angles += i_b.to(tl.int64) * s_ab + i_h * s_ah
        # dy, dv, dz: (b, t, h, p); dqr, dkr: (b, t, h, n), all contiguous.
        dy += (i_b.to(tl.int64) * T * H + i_h) * P
        dv += (i_b.to(tl.int64) * T * H + i_h) * P
        dz += (i_b.to(tl.int64) * T * H + i_h) * P
        dqr += (i_b.to(tl.int64) * T * H + i_h) * N
        dkr += (i_b.to(tl.int64) * T * H + i_h) * N
        adt += i_bh.to(tl.int64) * T
        dt += i_bh.to(tl.int64) * T
        trap += i_bh.to(tl.int64) * T
        dw += i_bh.to(tl.int64) * T
        dcur += i_bh.to(tl.int64) * T

        o_t = tl.arange(0, BT)
        o_p = tl.arange(0, BP)
        o_m = tl.arange(0, BN2)
        m_p = o_p < P
        m_s = o_m < S
        m_strict = o_t[:, None] > o_t[None, :]
        m_diag = o_t[:, None] == o_t[None, :]

        o_n = tl.arange(0, 2 * BN2)
        m_n = o_n < N
        b_qb = tl.load(q_bias + i_h * N + o_n, mask=m_n, other=0.0)
        b_kb = tl.load(k_bias + i_h * N + o_n, mask=m_n, other=0.0)
        if HAS_D:
            b_D = tl.load(d + i_h).to(tl.float32)
        b_dDacc = tl.zeros([BP], dtype=tl.float32)

        p_g = i_bh.to(tl.int64) * P * N + o_p[:, None] * N + o_n[None, :]
        m_g = m_p[:, None] & m_n[None, :]
        if HAS_DGT:
            b_dG = tl.load(dg_t + p_g, mask=m_g, other=0.0)
        else:
            b_dG = tl.zeros([BP, 2 * BN2], dtype=tl.float32)

        for i_r in range(NC):
            i_c = NC - 1 - i_r
            o_tc = i_c * BT + o_t
            m_t = o_tc < T
            b_dt, b_cur, b_w, b_A, b_AL = _load_chunk_scalars(adt, dt, trap, T, o_tc, m_t, o_t, BT)
            b_eA = tl.exp(b_A)
            b_eL = tl.exp(b_AL - b_A)

            m_a = m_t[:, None] & m_s[None, :]
            b_th = tl.load(angles + o_tc[:, None] * s_at + o_m[None, :] * s_as, mask=m_a, other=0.0)
            b_phi0 = tl.load(phi_in + (i_bh.to(tl.int64) * NC + i_c) * BN2 + o_m)
            b_phi = b_phi0[None, :] + tl.cumsum(b_dt[:, None] * _PI * _tanh(b_th), axis=0)
            b_cos, b_sin = tl.cos(b_phi), tl.sin(b_phi)
            b_q = _rotated_natural(q, o_tc, m_t, G * N, N, b_qb, b_cos, b_sin, BN2)
            b_k = _rotated_natural(k, o_tc, m_t, G * N, N, b_kb, b_cos, b_sin, BN2)

            m_x = m_t[:, None] & m_p[None, :]
            b_x = tl.load(v + o_tc[:, None] * s_vt + o_p[None, :], mask=m_x, other=0.0)
            DT = b_x.dtype
            b_qc, b_kc = b_q.to(DT), b_k.to(DT)
            o_y = o_tc[:, None] * (H * P) + o_p[None, :]  # dy, dv, dz
            b_dy = tl.load(dy + o_y, mask=m_x, other=0.0).to(tl.float32)
            p_gi = g_in + (i_bh.to(tl.int64) * NC + i_c) * BP * 2 * BN2
            b_Gc = tl.load(p_gi + o_p[:, None] * (2 * BN2) + o_n[None, :])

            b_s = tl.dot(b_qc, tl.trans(b_kc))
            b_Dw = _decay_weights(b_A, b_w, b_cur, m_strict, m_diag)
            b_Mc = (b_s * b_Dw).to(DT)

            if HAS_Z:
                # Recompute the pre-gate output for the silu(z) gradient.
                b_o = tl.dot(b_Mc, b_x)
                b_o += b_eA[:, None] * tl.dot(b_qc, tl.trans(b_Gc))
                if HAS_D:
                    b_o += b_D * b_x.to(tl.float32)
                b_z = tl.load(z + o_tc[:, None] * s_zt + o_p[None, :], mask=m_x, other=0.0)
                b_z = b_z.to(tl.float32)
                b_sg = tl.sigmoid(b_z)
                b_dz = b_dy * b_o * b_sg * (1.0 + b_z * (1.0 - b_sg))
                tl.store(dz + o_y, b_dz.to(dz.dtype.element_ty), mask=m_x)
                b_do = b_dy * b_z * b_sg
            else:
                b_do = b_dy
            b_doc = b_do.to(DT)
            if HAS_D:
                b_dDacc += tl.sum(b_do * b_x.to(tl.float32), axis=0)

            # Through the score matrix: dM = do xᵀ; ds = dM ⊙ decay ⊙ W is the score gradient.
            # The weight gradients are s ⊙ dM ⊙ decay summed by column: s ⊙ ds over the weight.
            b_ds = tl.dot(b_doc, tl.trans(b_x)) * b_Dw
            b_sds = b_s * b_ds
            b_dcur = tl.sum(tl.where(m_diag, b_sds, 0.0), axis=0)
            b_dcur = tl.where(b_cur > 0, b_dcur / b_cur, 0.0)
            b_dw = tl.sum(tl.where(m_strict, b_sds, 0.0), axis=0)
            b_dw = tl.where(b_w > 0, b_dw / b_w, 0.0)

            # Through the chunk's contribution to the state leaving it (gradient dG).
            b_dGc = b_dG.to(DT)
            b_u = tl.dot(b_kc, tl.trans(b_dGc))
            b_ew = b_eL * b_w
            b_dx = tl.dot(tl.trans(b_Mc), b_doc) + b_ew[:, None] * b_u
            if HAS_D:
                b_dx += b_D * b_do
            tl.store(dv + o_y, b_dx.to(dv.dtype.element_ty), mask=m_x)
            b_dw += b_eL * tl.sum(b_x.to(tl.float32) * b_u, axis=1)
            tl.store(dw + o_tc, b_dw, mask=m_t)
            tl.store(dcur + o_tc, b_dcur, mask=m_t)

            o_qk = o_tc[:, None] * (H * N) + o_n[None, :]  # dqr, dkr
            m_qk = m_t[:, None] & m_n[None, :]
            b_xw = (b_x.to(tl.float32) * b_ew[:, None]).to(DT)
            b_dk = tl.dot(tl.trans(b_ds.to(DT)), b_qc) + tl.dot(b_xw, b_dGc)
            tl.store(dkr + o_qk, b_dk, mask=m_qk)
            b_dq = tl.dot(b_ds.to(DT), b_kc) + b_eA[:, None] * tl.dot(b_doc, b_Gc)
            tl.store(dqr + o_qk, b_dq, mask=m_qk)

            # The state entering this chunk is the one leaving the previous chunk.
            b_doA = tl.trans((b_do * b_eA[:, None]).to(DT))
            b_dG = b_dG * tl.exp(b_AL) + tl.dot(b_doA, b_qc)

        tl.store(dg0 + p_g, b_dG, mask=m_g)
        tl.store(dd + i_bh, tl.sum(b_dDacc, axis=0))

    @triton.jit(do_not_specialize=["T", "NC"])
    def _siso_bwd_angle_kernel(
        q, k, dt, q_bias, k_bias, angles, phi_in, dphi_t, dA_t,
        dq, dk, dadt, ddt, dangles, dphi0,
        T, NC, H, HPG, N, S, s_ab, s_at, s_ah, s_as,
        BT: tl.constexpr, BN2: tl.constexpr,
    ):  # fmt: skip
        """Backward, part 2: from dq̄, dk̄ (rotated frame, in dq / dk) to dq, dk (in place), the
        angle gradients and the adt gradient: reverse cumsums carried across chunks."""
        i_bh = tl.program_id(0)
        i_b, i_h = i_bh // H, i_bh % H
        i_g = i_h // HPG
        G = H // HPG
        q += (i_b.to(tl.int64) * T * G + i_g) * N
        k += (i_b.to(tl.int64) * T * G + i_g) * N
        angles += i_b.to(tl.int64) * s_ab + i_h * s_ah
        dq += (i_b.to(tl.int64) * T * H + i_h) * N
        dk += (i_b.to(tl.int64) * T * H + i_h) * N
        dangles += (i_b.to(tl.int64) * T * H + i_h) * S
        dt += i_bh.to(tl.int64) * T
        dadt += i_bh.to(tl.int64) * T
        ddt += i_bh.to(tl.int64) * T

        o_t = tl.arange(0, BT)
        o_m = tl.arange(0, BN2)
        m_e = 2 * o_m < N
        m_o = 2 * o_m + 1 < N
        m_s = o_m < S
        b_qbE = tl.load(q_bias + i_h * N + 2 * o_m, mask=m_e, other=0.0)
        b_qbO = tl.load(q_bias + i_h * N + 2 * o_m + 1, mask=m_o, other=0.0)
        b_kbE = tl.load(k_bias + i_h * N + 2 * o_m, mask=m_e, other=0.0)
        b_kbO = tl.load(k_bias + i_h * N + 2 * o_m + 1, mask=m_o, other=0.0)
        # Reverse-cumsum carries: of dΦ (per angle) and of dB (the adt gradient).
        b_rphi = tl.load(dphi_t + i_bh * S + o_m, mask=m_s, other=0.0)
        b_rA = tl.load(dA_t + i_bh)

        for i_r in range(NC):
            i_c = NC - 1 - i_r
            o_tc = i_c * BT + o_t
            m_t = o_tc < T
            b_dt = tl.load(dt + o_tc, mask=m_t, other=0.0)
            m_a = m_t[:, None] & m_s[None, :]
            b_th = tl.load(angles + o_tc[:, None] * s_at + o_m[None, :] * s_as, mask=m_a, other=0.0)
            b_th = _tanh(b_th)
            b_phi0 = tl.load(phi_in + (i_bh.to(tl.int64) * NC + i_c) * BN2 + o_m)
            b_phi = b_phi0[None, :] + tl.cumsum(b_dt[:, None] * _PI * b_th, axis=0)
            b_cos, b_sin = tl.cos(b_phi), tl.sin(b_phi)
            b_qEr, b_qOr, b_kEr, b_kOr = _rotated_qk(
                q, k, o_tc, m_t, G * N, N, b_qbE, b_qbO, b_kbE, b_kbO, b_cos, b_sin, BN2
            )
            b_dqE, b_dqO = _load_pairs(dq, o_tc, m_t, H * N, N, BN2)
            b_dkE, b_dkO = _load_pairs(dk, o_tc, m_t, H * N, N, BN2)

            # adt: dB_i = q̄_i·dq̄_i − k̄_i·dk̄_i, reverse-cumsummed over the whole sequence.
            b_dB = tl.sum(b_qEr * b_dqE + b_qOr * b_dqO - b_kEr * b_dkE - b_kOr * b_dkO, axis=1)
            b_dB = tl.where(m_t, b_dB, 0.0)
            tl.store(dadt + o_tc, b_rA + tl.cumsum(b_dB, axis=0, reverse=True), mask=m_t)
            b_rA += tl.sum(b_dB, axis=0)

            # Rotation: dΦ_m = Σ_{q,k} (ā_E dā_O − ā_O dā_E); da = Rᵀ dā.
            b_dphi = b_qEr * b_dqO - b_qOr * b_dqE + b_kEr * b_dkO - b_kOr * b_dkE
            b_dphi = tl.where(m_a, b_dphi, 0.0)
            _store_pairs(dq, o_tc, m_t, H * N, N, b_dqE * b_cos + b_dqO * b_sin,
                         b_dqO * b_cos - b_dqE * b_sin, BN2)  # fmt: skip
            _store_pairs(dk, o_tc, m_t, H * N, N, b_dkE * b_cos + b_dkO * b_sin,
                         b_dkO * b_cos - b_dkE * b_sin, BN2)  # fmt: skip

            # Φ_t = Φ_0 + Σ_{u≤t} Δ_u·π·tanh(θ̃_u): the reverse cumsum of dΦ reaches each θ̃_u, Δ_u.
            b_rc = b_rphi[None, :] + tl.cumsum(b_dphi, axis=0, reverse=True)
            b_rphi += tl.sum(b_dphi, axis=0)
            b_dth = b_rc * b_dt[:, None] * _PI * (1.0 - b_th * b_th)
            tl.store(dangles + o_tc[:, None] * (H * S) + o_m[None, :], b_dth, mask=m_a)
            tl.store(ddt + o_tc, _PI * tl.sum(b_rc * b_th, axis=1), mask=m_t)

        tl.store(dphi0 + i_bh * S + o_m, b_rphi, mask=m_s)


def _tiles(p: int, n: int, chunk_size: int) -> tuple[int, int, int]:
    return chunk_size, max(16, _next_pow2(p)), max(16, _next_pow2((n + 1) // 2))


# Launch settings, by (p tile, n half tile). Overridable for benchmarking.
FWD_CONFIG: dict = {"BV": None, "num_warps": 4, "num_stages": 2}
BWD_CONFIG: dict = {"num_warps": 8, "num_stages": 2}  # measured best of (4|8 warps, 1|2 stages)
ANGLE_CONFIG: dict = {"num_warps": 4, "num_stages": 2}


def _siso_fwd(q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, phi0, g0, chunk_size, save):
    b, t, g, n = q.shape
    h, p = v.shape[2], v.shape[3]
    s = angles.shape[3]
    BT, BP, BN2 = _tiles(p, n, chunk_size)
    BV = FWD_CONFIG["BV"] or BP
    BV = min(BV, BP)
    nc = triton.cdiv(t, BT)
    dev = v.device
    y = torch.empty(b, t, h, p, dtype=v.dtype, device=dev)
    phi_t = torch.empty(b, h, s, dtype=torch.float32, device=dev)
    g_t = torch.empty(b, h, p, n, dtype=torch.float32, device=dev)
    if save:
        g_in = torch.empty(b * h, nc, BP, 2 * BN2, dtype=v.dtype, device=dev)
        phi_in = torch.empty(b * h, nc, BN2, dtype=torch.float32, device=dev)
    else:
        g_in = phi_in = y  # never touched
    zz = z if z is not None else v
    grid = (triton.cdiv(BP, BV), b * h)
    _siso_fwd_kernel[grid](
        q, k, v, zz, adt, dt, trap, q_bias, k_bias, angles,
        d if d is not None else q_bias, phi0 if phi0 is not None else phi_t,
        g0 if g0 is not None else g_t,
        y, phi_t, g_t, g_in, phi_in,
        t, triton.cdiv(t, BT), h, h // g, p, n, s,
        v.stride(0), v.stride(1), v.stride(2), zz.stride(0), zz.stride(1), zz.stride(2),
        angles.stride(0), angles.stride(1), angles.stride(2), angles.stride(3),
        BT=BT, BP=BP, BV=BV, BN2=BN2,
        HAS_D=d is not None, HAS_Z=z is not None, HAS_H0=g0 is not None, SAVE=save,
        num_warps=FWD_CONFIG["num_warps"], num_stages=FWD_CONFIG["num_stages"],
    )  # fmt: skip
    return y, phi_t, g_t, g_in, phi_in


def _siso_bwd(q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, g_in, phi_in,
              dy, dg_t, dphi_t, dA_t, chunk_size):  # fmt: skip
    b, t, g, n = q.shape
    h, p = v.shape[2], v.shape[3]
    s = angles.shape[3]
    BT, BP, BN2 = _tiles(p, n, chunk_size)
    dev = v.device
    f32 = dict(dtype=torch.float32, device=dev)
    dq = torch.empty(b, t, h, n, **f32)
    dk = torch.empty(b, t, h, n, **f32)
    dv = torch.empty(b, t, h, p, dtype=v.dtype, device=dev)
    dz = torch.empty(b, t, h, p, dtype=z.dtype, device=dev) if z is not None else None
    dadt, dw, dcur, ddt = (torch.empty(b, h, t, **f32) for _ in range(4))
    dangles = torch.empty(b, t, h, s, **f32)
    dg0 = torch.empty(b, h, p, n, **f32)
    dphi0 = torch.empty(b, h, s, **f32)
    dd = torch.empty(b, h, **f32)
    zz = z if z is not None else v
    nc = triton.cdiv(t, BT)
    _siso_bwd_state_kernel[(b * h,)](
        q, k, v, zz, adt, dt, trap, q_bias, k_bias, angles,
        d if d is not None else q_bias, g_in, phi_in, dy, dg_t if dg_t is not None else dg0,
        dq, dk, dv, dz if dz is not None else dv, dw, dcur, dg0, dd,
        t, nc, h, h // g, p, n, s,
        v.stride(0), v.stride(1), v.stride(2), zz.stride(0), zz.stride(1), zz.stride(2),
        angles.stride(0), angles.stride(1), angles.stride(2), angles.stride(3),
        BT=BT, BP=BP, BN2=BN2,
        HAS_D=d is not None, HAS_Z=z is not None, HAS_DGT=dg_t is not None,
        num_warps=BWD_CONFIG["num_warps"], num_stages=BWD_CONFIG["num_stages"],
    )  # fmt: skip
    _siso_bwd_angle_kernel[(b * h,)](
        q, k, dt, q_bias, k_bias, angles, phi_in, dphi_t, dA_t,
        dq, dk, dadt, ddt, dangles, dphi0,
        t, nc, h, h // g, n, s,
        angles.stride(0), angles.stride(1), angles.stride(2), angles.stride(3),
        BT=BT, BN2=BN2,
        num_warps=ANGLE_CONFIG["num_warps"], num_stages=ANGLE_CONFIG["num_stages"],
    )  # fmt: skip
    return dq, dk, dv, dz, dadt, dw, dcur, ddt, dangles, dg0, dphi0, dd


class _SisoTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, phi0, g0, chunk_size):
        save = any(ctx.needs_input_grad)
        y, phi_t, g_t, g_in, phi_in = _siso_fwd(
            q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, phi0, g0, chunk_size, save
        )
        if save:
            ctx.save_for_backward(q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, g0,
                                  g_in, phi_in, g_t)  # fmt: skip
            ctx.chunk_size = chunk_size
            ctx.bwd = SCAN_BWD
        return y, phi_t, g_t

    @staticmethod
    def backward(ctx, dy, dphi_t, dg_t):
        q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, g0, g_in, phi_in, g_t = (
            ctx.saved_tensors
        )
        b, _, g, _ = q.shape
        h = v.shape[2]
        dy = dy.contiguous()
        if dphi_t is None:
            dphi_t = torch.zeros_like(g_t[..., 0, : angles.shape[3]])
        dphi_t = dphi_t.float().contiguous()
        if dg_t is not None:
            dg_t = dg_t.float().contiguous()
            dA_t = (dg_t * g_t).sum((-2, -1)).contiguous()  # ∂/∂B_T of the final state
        else:
            dA_t = torch.zeros(b, h, dtype=torch.float32, device=v.device)
        args = (q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, g_in, phi_in,
                dy, dg_t, dphi_t, dA_t, ctx.chunk_size)  # fmt: skip
        if ctx.bwd == "v2":
            from .triton_siso_bwd import siso_bwd_v2

            (dq, dk, dq_bias, dk_bias, dv, dz, dadt, dw, dcur, ddt, dangles, dg0, dphi0,
             dd) = siso_bwd_v2(*args)  # fmt: skip
        else:
            dq, dk, dv, dz, dadt, dw, dcur, ddt, dangles, dg0, dphi0, dd = _siso_bwd(*args)
            dq_bias, dk_bias = dq.sum((0, 1)), dk.sum((0, 1))
            if g != h:
                dq, dk = dq.sum(2, keepdim=True), dk.sum(2, keepdim=True)
            dd = dd.sum(0)
        # Trapezoid chain rule: w_u = λ_uΔ_u + (1−λ_{u+1})Δ_{u+1}, cur_u = λ_uΔ_u.
        lam = torch.sigmoid(trap)
        dw_prev = F.pad(dw[..., :-1], (1, 0))
        ddt = ddt + lam * (dw + dcur) + (1.0 - lam) * dw_prev
        dtrap = dt * (dw + dcur - dw_prev) * lam * (1.0 - lam)
        return (
            dq.to(q.dtype), dk.to(k.dtype), dv, dz, dadt, ddt, dtrap,
            dq_bias.to(q_bias.dtype), dk_bias.to(k_bias.dtype), dangles,
            None if d is None else dd.to(d.dtype),
            dphi0 if ctx.needs_input_grad[11] else None,
            dg0 if g0 is not None else None,
            None,
        )  # fmt: skip


def mamba3_siso_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    adt: Tensor,
    dt: Tensor,
    trap: Tensor,
    q_bias: Tensor,
    k_bias: Tensor,
    angles: Tensor,
    d: Tensor | None = None,
    z: Tensor | None = None,
    *,
    chunk_size: int = 64,
    initial_state: State | None = None,
    return_final_state: bool = False,
) -> Tensor | tuple[Tensor, State]:
    """The Mamba-3 SISO scan on CUDA through Triton; same contract as ``mamba3_siso``.

    Shapes: q, k (b, t, g, n) with g = 1 or h; v, z (b, t, h, p) in bf16, fp16 or fp32 (q, k, z
    are cast to v's dtype); adt, dt, trap (b, h, t) and q_bias, k_bias (h, n), angles
    (b, t, h, s) in fp32; d (h,). Dots run in v's dtype with fp32 accumulation; the state,
    decays and angles are fp32. Differentiable in every input, the initial state included.
    Callers go through :func:`kernels.mamba3.api.mamba3_siso`, which validates the shapes.
    """
    if TRITON_IMPORT_ERROR is not None:
        raise RuntimeError(TRITON_IMPORT_ERROR)
    b, t, _, n = k.shape
    h = v.shape[2]
    reason = shape_error(v, n, chunk_size)
    if reason is not None:
        raise ValueError(reason)
    if SCAN_BWD not in SCAN_BWD_VERSIONS:
        raise ValueError(f"M3RUN_SCAN_BWD must be one of {SCAN_BWD_VERSIONS}, got {SCAN_BWD!r}")
    if v.stride(-1) != 1:
        v = v.contiguous()
    if z is not None:
        z = z.to(v.dtype)
        if z.stride(-1) != 1:
            z = z.contiguous()
    q, k = q.to(v.dtype).contiguous(), k.to(v.dtype).contiguous()
    adt, dt, trap = (x.float().contiguous() for x in (adt, dt, trap))
    q_bias, k_bias = q_bias.float().contiguous(), k_bias.float().contiguous()
    angles = angles.float()
    phi0 = g0 = None
    if initial_state is not None:
        phi0, h0, k0, v0 = (x.float() for x in initial_state)
        phi0 = phi0.contiguous()
        # Augmented start state: the carried last token's trapezoid half-term, weighted by the
        # first token's (1−λ)Δ (as in chunk.py); autograd takes it back to h0, k0, v0, dt, trap.
        c0 = (1.0 - torch.sigmoid(trap[..., 0])) * dt[..., 0]
        g0 = (h0 + c0[..., None, None] * (v0[..., :, None] * k0[..., None, :])).contiguous()
    y, phi_t, g_t = _SisoTriton.apply(
        q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, phi0, g0, chunk_size
    )
    if not return_final_state:
        return y
    k_last = k[:, t - 1].float().expand(b, h, n) + k_bias
    final = (phi_t, g_t, rotate_pairs(k_last, phi_t), v[:, t - 1].float())
    return y, final
