"""Triton forward of the Mamba-3 SISO scan.

One program per (batch, head, p block) walks the sequence chunk by chunk and keeps the augmented
inter-chunk state ``G`` (p × n, fp32; see :mod:`m3run.kernels.mamba3.chunk`) in registers, so no
per-chunk state goes to memory on the inference path. Inside a chunk of ``BT`` tokens it builds
the masked (BT × BT) score matrix ``q̄k̄ᵀ ⊙ exp(segsum(adt)) ⊙ W`` (``W`` holds the trapezoid
weights ``w_j`` below the diagonal and ``λ_jΔ_j`` on it: the diagonal correction), multiplies it
into ``x``, adds the inter-chunk term ``exp(A_i)·G q̄_i``, the ``D`` skip and the ``silu(z)``
gate, and folds the chunk into ``G``. The cumulative RoPE angle ``Φ`` is a chunk-local cumsum
plus an offset carried in registers (mod 2π); the rotation is applied to ``q + q_bias`` and
``k + k_bias`` as they are loaded.

For the backward (``SAVE``) it also writes the state entering every chunk (in the dot dtype:
the values its dots used) and the angle entering every chunk.
"""

from __future__ import annotations

import torch

from .launching import LaunchConfig, launch
from .triton_common import (
    TWO_PI,
    Tiles,
    chunk_phase,
    chunk_scalars,
    decay_weights,
    rotate,
    segments,
    sigmoid,
    tl,
    to_dot,
    triton,
)

if triton is not None:

    @triton.jit
    def _rotated(x, o_tc, m_t, m_n, row_stride, b_bias, b_cos, b_sin, BN2: tl.constexpr,
                 BR: tl.constexpr):
        """R(Φ)(x + bias) for rows ``o_tc`` (masked by ``m_t``, columns by ``m_n``), fp32,
        columns in natural order (pairs adjacent): rows are read whole (vectorised), their first
        BR pairs rotated (:func:`rotate`)."""
        o_n = tl.arange(0, 2 * BN2)
        b_x = tl.load(
            x + o_tc[:, None] * row_stride + o_n[None, :],
            mask=m_t[:, None] & m_n[None, :],
            other=0.0,
        )
        b_x = b_x.to(tl.float32) + b_bias[None, :]
        return rotate(b_x, b_cos, b_sin, o_tc.shape[0], BN2, BR)

    # T and NC vary with every batch shape: not worth a compile each.
    @triton.jit(do_not_specialize=["T", "NC"])
    def siso_fwd_kernel(
        q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, phi0, g0, seg,
        y, phi_t, g_t, g_in, phi_in,
        T, NC, H, HPG, P, N, S,
        s_vb, s_vt, s_vh, s_zb, s_zt, s_zh, s_ab, s_at, s_ah, s_as,
        BT: tl.constexpr, BP: tl.constexpr, BV: tl.constexpr, BN2: tl.constexpr,
        BR: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_H0: tl.constexpr,
        SAVE: tl.constexpr,
        HAS_RESET: tl.constexpr, WG: tl.constexpr, DENSE: tl.constexpr,
    ):
        i_v, i_bh = tl.program_id(0), tl.program_id(1)
        i_b, i_h = i_bh // H, i_bh % H
        i_g = i_h // HPG
        G = H // HPG
        # Scalar 64-bit bases; per-element offsets stay 32-bit.
        q += (i_b.to(tl.int64) * T * G + i_g) * N
        k += (i_b.to(tl.int64) * T * G + i_g) * N
        v += i_b.to(tl.int64) * s_vb + i_h * s_vh
        z += i_b.to(tl.int64) * s_zb + i_h * s_zh
        y += (i_b.to(tl.int64) * T * H + i_h) * P
        angles += i_b.to(tl.int64) * s_ab + i_h * s_ah
        adt += i_bh.to(tl.int64) * T
        dt += i_bh.to(tl.int64) * T
        trap += i_bh.to(tl.int64) * T
        seg += i_b.to(tl.int64) * NC * BT

        o_t = tl.arange(0, BT)
        o_v = i_v * BV + tl.arange(0, BV)
        o_m = tl.arange(0, BR)  # the rotated pairs (Φ = 0 past the S angles)
        o_n = tl.arange(0, 2 * BN2)
        # With DENSE (whole chunks, tiles the shape's size) every bound below holds: the masks
        # fold to true and the loads and stores go unmasked.
        m_v = (o_v < P) | DENSE
        m_s = (o_m < S) | DENSE
        m_n = (o_n < N) | DENSE
        m_strict = o_t[:, None] > o_t[None, :]
        m_diag = o_t[:, None] == o_t[None, :]
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
            b_phi0 = tl.zeros([BR], dtype=tl.float32)

        for i_c in range(NC):
            o_tc = i_c * BT + o_t
            m_t = (o_tc < T) | DENSE
            b_dt, b_cur, b_w, b_A2, b_AL2 = chunk_scalars(adt, dt, trap, T, o_tc, m_t, o_t, BT)
            # exp(A_i) (entering state → token i), exp(A_L − A_j) (token j → leaving state),
            # exp(A_L) (entering → leaving) and the pairs one token reaches another in: with
            # resets, none of them crosses one.
            b_eA = tl.exp2(b_A2)
            b_eL = tl.exp2(b_AL2 - b_A2)
            b_eAL = tl.exp2(b_AL2)
            m_low = m_strict
            if HAS_RESET:
                m_in, m_out, keep, m_same = segments(seg, o_tc)
                b_eA = tl.where(m_in, b_eA, 0.0)
                b_eL = tl.where(m_out, b_eL, 0.0)
                b_eAL = tl.where(keep, b_eAL, 0.0)
                m_low = m_strict & m_same

            # Φ = carried offset + chunk-local cumsum of Δ·π·tanh(θ̃).
            b_cos, b_sin, b_dsum = chunk_phase(angles, s_at, s_as, b_dt, b_phi0, o_tc, m_t, S, BR,
                                               DENSE)
            if SAVE:  # noqa: SIM102 (SAVE is a compile-time flag, i_v a run-time value)
                if i_v == 0:
                    tl.store(phi_in + (i_bh.to(tl.int64) * NC + i_c) * BR + o_m, b_phi0)
            b_phi0 += b_dsum
            b_phi0 = b_phi0 - TWO_PI * tl.floor(b_phi0 / TWO_PI)

            b_q = _rotated(q, o_tc, m_t, m_n, G * N, b_qb, b_cos, b_sin, BN2, BR)
            b_k = _rotated(k, o_tc, m_t, m_n, G * N, b_kb, b_cos, b_sin, BN2, BR)
            m_x = m_t[:, None] & m_v[None, :]
            b_x = tl.load(v + o_tc[:, None] * s_vt + o_v[None, :], mask=m_x, other=0.0)
            DT = b_x.dtype
            b_qc = to_dot(b_q, DT)

            # Intra-chunk: (q̄k̄ᵀ ⊙ exp(A_i − A_j) ⊙ W) x.
            b_s = tl.dot(b_qc, tl.trans(to_dot(b_k, DT)))
            b_Dw = decay_weights(b_A2, b_w, b_cur, m_low, m_diag)
            b_Mc = to_dot(b_s * b_Dw, DT)

            # Inter-chunk: exp(A_i) · G q̄_i, with the state entering the chunk.
            b_Gc = to_dot(b_G, DT)
            if SAVE:
                p_gi = g_in + (i_bh.to(tl.int64) * NC + i_c) * BP * 2 * BN2
                tl.store(p_gi + o_v[:, None] * (2 * BN2) + o_n[None, :], b_Gc)
            if WG:  # both products transposed (64 rows: warpgroup MMAs on sm_90), summed there
                b_o = tl.trans(
                    tl.dot(tl.trans(b_x), tl.trans(b_Mc))
                    + b_eA[None, :] * tl.dot(b_Gc, tl.trans(b_qc))
                )
            else:
                b_o = tl.dot(b_Mc, b_x) + b_eA[:, None] * tl.dot(b_qc, tl.trans(b_Gc))

            # Fold the chunk into G: G ← exp(A_L)·G + Σ_j exp(A_L − A_j)·w_j · x_j k̄_jᵀ.
            b_ew = b_eL * b_w
            b_G = b_G * b_eAL + tl.dot(tl.trans(b_x), to_dot(b_k * b_ew[:, None], DT))

            if HAS_D:
                b_o += b_D * b_x.to(tl.float32)
            if HAS_Z:
                b_z = tl.load(z + o_tc[:, None] * s_zt + o_v[None, :], mask=m_x, other=0.0)
                b_z = b_z.to(tl.float32)
                b_o = b_o * b_z * sigmoid(b_z)
            p_y = y + o_tc[:, None] * (H * P) + o_v[None, :]
            tl.store(p_y, b_o.to(p_y.dtype.element_ty), mask=m_x)

        tl.store(g_t + p_g, b_G, mask=m_g)
        if i_v == 0:
            tl.store(phi_t + i_bh * S + o_m, b_phi0, mask=m_s)


def siso_fwd(q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, phi0, g0, seg, chunk_size,
             save, cfg: LaunchConfig):
    """Launch the forward (``seg``: the resets as triton_siso.segment_ids gives them, or None).
    Returns y, the final angle Φ_T and state G_T (fp32), and for the backward (``save``) the
    state entering every chunk (b·h, nc, BP, BN) in v's dtype and the angle entering every
    chunk (b·h, nc, BR) fp32 (BR: :meth:`Tiles.rot_pairs`)."""
    b, t, g, n = q.shape
    h, p = v.shape[2], v.shape[3]
    s = angles.shape[3]
    angles = angles.expand(b, t, h, s)  # one set for every head: read with a head stride 0
    tiles = Tiles.of(p, n, chunk_size)
    BT, BP, BN2, BR = tiles.BT, tiles.BP, tiles.BN2, tiles.rot_pairs(s)
    BV = min(cfg.bv or BP, BP)
    nc = triton.cdiv(t, BT)
    dev = v.device
    y = torch.empty(b, t, h, p, dtype=v.dtype, device=dev)
    phi_t = torch.empty(b, h, s, dtype=torch.float32, device=dev)
    g_t = torch.empty(b, h, p, n, dtype=torch.float32, device=dev)
    if save:
        g_in = torch.empty(b * h, nc, BP, 2 * BN2, dtype=v.dtype, device=dev)
        phi_in = torch.empty(b * h, nc, BR, dtype=torch.float32, device=dev)
    else:
        g_in = phi_in = y  # never touched
    zz = z if z is not None else v
    args = (
        q, k, v, zz, adt, dt, trap, q_bias, k_bias, angles,
        d if d is not None else q_bias, phi0 if phi0 is not None else phi_t,
        g0 if g0 is not None else g_t, seg if seg is not None else trap,
        y, phi_t, g_t, g_in, phi_in,
        t, nc, h, h // g, p, n, s,
        v.stride(0), v.stride(1), v.stride(2), zz.stride(0), zz.stride(1), zz.stride(2),
        angles.stride(0), angles.stride(1), angles.stride(2), angles.stride(3),
    )
    flags = dict(BT=BT, BP=BP, BV=BV, BN2=BN2, BR=BR, HAS_D=d is not None, HAS_Z=z is not None,
                 HAS_H0=g0 is not None, SAVE=save, HAS_RESET=seg is not None,
                 WG=bool(cfg.wg), DENSE=tiles.dense(t, p, n, s))
    launch("fwd", siso_fwd_kernel, (triton.cdiv(BP, BV), b * h), args, flags, cfg)
    return y, phi_t, g_t, g_in, phi_in
