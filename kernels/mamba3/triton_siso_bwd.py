"""Backward v2 of the Triton Mamba-3 SISO scan: the chunk work in parallel over chunks.

The v1 backward (:mod:`kernels.mamba3.triton_siso`) walks every (batch, head) through its chunks
in one program and does all eleven dots of a chunk while carrying ``dG``: at (BT, p, n) = 64 it
needs more than 255 registers per thread and spills, and only b·h programs run. Only ``dG``
(p × n) is truly sequential, so v2 splits the work the way chunked-attention backwards do,
each kernel recomputing what it needs:

1. ``_siso_bwd_dstate_kernel`` (reverse over chunks, one program per (batch, head, p block)):
   the state-gradient recurrence ``dG ← exp(A_L)·dG + (do ⊙ exp(A))ᵀ q̄`` alone, one dot per
   chunk. It saves ``dG`` leaving every chunk (in the dot dtype, as the forward saves ``G``
   entering it) and returns the gradient of the start state.
2. ``_siso_bwd_dkv_kernel`` (one program per (chunk, batch, head), no state across chunks): the
   gradients through k̄ and x: ``dv``, ``dk̄``, the trapezoid-weight gradients ``dw, dcur``.
3. ``_siso_bwd_dq_kernel`` (likewise, after 2): the gradients through q̄ and the gate: ``dz``,
   ``dq̄`` and the per-chunk partial sum for ``d``.
   Both rotate their ``dā`` back to ``da`` and write the per-token terms of the two reverse
   cumsums (``dB_i = q̄_i·dq̄_i − k̄_i·dk̄_i`` for ``adt``, and ``dΦ``; 3 adds to 2's), computed
   from the unrotated ``a`` since the rotation keeps dot and cross products, and per-chunk
   partial sums for the bias gradients.
4. ``_siso_bwd_cumsum_kernel`` (reverse over chunks, one program per (batch, head)): the two
   reverse cumsums over the whole sequence, in place, and from them the angle and ``Δ`` terms.

The numbers are v1's up to summation order and the trig: the same operands are rounded to the
dot dtype, with fp32 accumulation; on a GPU, cos/sin use the hardware approximations (absolute
error ~1e-6, far below the bf16 rounding of the dot operands). The per-head ``dq, dk`` are
fp32 and summed over heads (g = 1) by PyTorch, as in v1.
"""

from __future__ import annotations

import os

import torch

from .triton_siso import (
    _PI,
    _decay_weights,
    _load_chunk_scalars,
    _rotated_natural,
    _tanh,
    _tiles,
    tl,
    triton,
)

if triton is not None:
    from triton.language.extra import libdevice

    _TWO_PI = tl.constexpr(6.283185307179586)

    @triton.jit
    def _cos_sin(x, FAST_TRIG: tl.constexpr):
        """cos x, sin x. FAST_TRIG: the MUFU approximations (absolute error ~1e-6 after the
        reduction to [0, 2π)) instead of libdevice's exact range reduction, whose local-memory
        table and long code cost registers; the interpreter has only the exact ones."""
        if FAST_TRIG:
            x = x - _TWO_PI * tl.floor(x * (1.0 / _TWO_PI))
            return libdevice.fast_cosf(x), libdevice.fast_sinf(x)
        else:
            return tl.cos(x), tl.sin(x)

    @triton.jit(do_not_specialize=["T", "NC"])
    def _siso_bwd_dstate_kernel(
        q, z, adt, dt, q_bias, angles, phi_in, dy, dg_t,
        dg_out, dg0,
        T, NC, H, HPG, P, N, S,
        s_zb, s_zt, s_zh, s_ab, s_at, s_ah, s_as,
        BT: tl.constexpr, BP: tl.constexpr, BV: tl.constexpr, BN2: tl.constexpr,
        HAS_Z: tl.constexpr, HAS_DGT: tl.constexpr, FAST_TRIG: tl.constexpr,
    ):  # fmt: skip
        """Backward v2, part 1: the reverse recurrence of dG alone. Saves the dG leaving every
        chunk (rows ``i_v·BV …`` of it) and writes the gradient of the start state."""
        i_v, i_bh = tl.program_id(0), tl.program_id(1)
        i_b, i_h = i_bh // H, i_bh % H
        i_g = i_h // HPG
        G = H // HPG
        q += (i_b.to(tl.int64) * T * G + i_g) * N
        z += i_b.to(tl.int64) * s_zb + i_h * s_zh
        dy += (i_b.to(tl.int64) * T * H + i_h) * P
        angles += i_b.to(tl.int64) * s_ab + i_h * s_ah
        adt += i_bh.to(tl.int64) * T
        dt += i_bh.to(tl.int64) * T

        o_t = tl.arange(0, BT)
        o_v = i_v * BV + tl.arange(0, BV)
        o_m = tl.arange(0, BN2)
        o_n = tl.arange(0, 2 * BN2)
        m_v = o_v < P
        m_s = o_m < S
        m_n = o_n < N
        b_qb = tl.load(q_bias + i_h * N + o_n, mask=m_n, other=0.0)

        p_g = i_bh.to(tl.int64) * P * N + o_v[:, None] * N + o_n[None, :]
        m_g = m_v[:, None] & m_n[None, :]
        if HAS_DGT:
            b_dG = tl.load(dg_t + p_g, mask=m_g, other=0.0)
        else:
            b_dG = tl.zeros([BV, 2 * BN2], dtype=tl.float32)

        for i_r in range(NC):
            i_c = NC - 1 - i_r
            o_tc = i_c * BT + o_t
            m_t = o_tc < T
            # dG leaving chunk i_c: what the chunk kernel needs for its dx, dk̄ and dw terms.
            p_go = dg_out + (i_bh.to(tl.int64) * NC + i_c) * BP * 2 * BN2
            tl.store(p_go + o_v[:, None] * (2 * BN2) + o_n[None, :],
                     b_dG.to(dg_out.dtype.element_ty))  # fmt: skip

            b_adt = tl.load(adt + o_tc, mask=m_t, other=0.0)
            b_dt = tl.load(dt + o_tc, mask=m_t, other=0.0)
            b_A = tl.cumsum(b_adt, axis=0)
            b_AL = tl.sum(tl.where(o_t == BT - 1, b_A, 0.0), axis=0)
            m_a = m_t[:, None] & m_s[None, :]
            b_th = tl.load(angles + o_tc[:, None] * s_at + o_m[None, :] * s_as, mask=m_a, other=0.0)
            b_phi0 = tl.load(phi_in + (i_bh.to(tl.int64) * NC + i_c) * BN2 + o_m)
            b_phi = b_phi0[None, :] + tl.cumsum(b_dt[:, None] * _PI * _tanh(b_th), axis=0)
            b_cos, b_sin = _cos_sin(b_phi, FAST_TRIG)
            b_q = _rotated_natural(q, o_tc, m_t, G * N, N, b_qb, b_cos, b_sin, BN2)

            m_x = m_t[:, None] & m_v[None, :]
            o_y = o_tc[:, None] * (H * P) + o_v[None, :]
            b_do = tl.load(dy + o_y, mask=m_x, other=0.0).to(tl.float32)
            if HAS_Z:
                b_z = tl.load(z + o_tc[:, None] * s_zt + o_v[None, :], mask=m_x, other=0.0)
                b_z = b_z.to(tl.float32)
                b_do = b_do * b_z * tl.sigmoid(b_z)
            DT = dg_out.dtype.element_ty
            b_doA = tl.trans((b_do * tl.exp(b_A)[:, None]).to(DT))
            b_dG = b_dG * tl.exp(b_AL) + tl.dot(b_doA, b_q.to(DT))

        tl.store(dg0 + p_g, b_dG, mask=m_g)

    @triton.jit
    def _chunk_rotation(angles, phi_in, b_dt, i_b, i_h, i_c, o_tc, m_t, NC, H, S,
                        s_ab, s_at, s_ah, s_as,
                        BN2: tl.constexpr, FAST_TRIG: tl.constexpr):  # fmt: skip
        """cos Φ, sin Φ for the tokens ``o_tc`` of chunk ``i_c``: the chunk's saved offset plus
        the chunk-local cumsum of Δ·π·tanh(θ̃)."""
        o_m = tl.arange(0, BN2)
        p_a = angles + i_b.to(tl.int64) * s_ab + i_h * s_ah
        m_a = m_t[:, None] & (o_m < S)[None, :]
        b_th = tl.load(p_a + o_tc[:, None] * s_at + o_m[None, :] * s_as, mask=m_a, other=0.0)
        b_phi0 = tl.load(phi_in + ((i_b * H + i_h).to(tl.int64) * NC + i_c) * BN2 + o_m)
        b_phi = b_phi0[None, :] + tl.cumsum(b_dt[:, None] * _PI * _tanh(b_th), axis=0)
        return _cos_sin(b_phi, FAST_TRIG)

    @triton.jit
    def _chunk_operands(q, k, adt, dt, trap, q_bias, k_bias, angles, phi_in,
                        i_b, i_h, i_c, T, NC, H, HPG, N, S, s_ab, s_at, s_ah, s_as,
                        BT: tl.constexpr, BN2: tl.constexpr, FAST_TRIG: tl.constexpr):  # fmt: skip
        """What both chunk kernels recompute for chunk ``i_c`` of head (i_b, i_h): the per-token
        scalars, cos/sin of Φ and q̄, k̄ (natural column order) in the dot dtype."""
        G = H // HPG
        i_bh = i_b * H + i_h
        o_t = tl.arange(0, BT)
        o_n = tl.arange(0, 2 * BN2)
        o_tc = i_c * BT + o_t
        m_t = o_tc < T
        o_bh = i_bh.to(tl.int64) * T
        b_dt, b_cur, b_w, b_A, b_AL = _load_chunk_scalars(
            adt + o_bh, dt + o_bh, trap + o_bh, T, o_tc, m_t, o_t, BT
        )
        b_cos, b_sin = _chunk_rotation(angles, phi_in, b_dt, i_b, i_h, i_c, o_tc, m_t, NC, H, S,
                                       s_ab, s_at, s_ah, s_as, BN2, FAST_TRIG)  # fmt: skip
        b_qb = tl.load(q_bias + i_h * N + o_n, mask=o_n < N, other=0.0)
        b_kb = tl.load(k_bias + i_h * N + o_n, mask=o_n < N, other=0.0)
        o_qk = (i_b.to(tl.int64) * T * G + i_h // HPG) * N
        b_q = _rotated_natural(q + o_qk, o_tc, m_t, G * N, N, b_qb, b_cos, b_sin, BN2)
        b_k = _rotated_natural(k + o_qk, o_tc, m_t, G * N, N, b_kb, b_cos, b_sin, BN2)
        DT = q.dtype.element_ty
        return b_cur, b_w, b_A, b_AL, b_cos, b_sin, b_q.to(DT), b_k.to(DT)

    @triton.jit
    def _angle_terms(x, b_bias, o_tc, m_t, row_stride, N, b_dr, b_cos, b_sin,
                     BT: tl.constexpr, BN2: tl.constexpr):  # fmt: skip
        """For a = x + bias and the gradient dā of ā = R(Φ)a (natural column order): da = Rᵀ dā,
        a·da (= ā·dā) and the rotation gradient a_E da_O − a_O da_E (= ā_E dā_O − ā_O dā_E): the
        rotation keeps dot and cross products, so the unrotated a, reloaded, serves."""
        o_n = tl.arange(0, 2 * BN2)
        b_a = tl.load(x + o_tc[:, None] * row_stride + o_n[None, :],
                      mask=m_t[:, None] & (o_n < N)[None, :], other=0.0)  # fmt: skip
        b_aE, b_aO = tl.split(tl.reshape(b_a.to(tl.float32) + b_bias[None, :], (BT, BN2, 2)))
        b_drE, b_drO = tl.split(tl.reshape(b_dr, (BT, BN2, 2)))
        b_daE = b_drE * b_cos + b_drO * b_sin
        b_daO = b_drO * b_cos - b_drE * b_sin
        b_dot = tl.sum(b_aE * b_daE + b_aO * b_daO, axis=1)
        b_cross = b_aE * b_daO - b_aO * b_daE
        return b_dot, b_cross, tl.reshape(tl.join(b_daE, b_daO), (BT, 2 * BN2))

    @triton.jit
    def _gated_do(b_dy, p_z, o_tc, m_x, o_p, s_zt, HAS_Z: tl.constexpr):
        """do = dy ⊙ silu(z), the gradient of the pre-gate output o, and dz/o."""
        if HAS_Z:
            b_z = tl.load(p_z + o_tc[:, None] * s_zt + o_p[None, :], mask=m_x, other=0.0)
            b_z = b_z.to(tl.float32)
            b_sg = tl.sigmoid(b_z)
            return b_dy * b_z * b_sg, b_dy * b_sg * (1.0 + b_z * (1.0 - b_sg))
        else:
            return b_dy, b_dy

    @triton.jit(do_not_specialize=["T", "NC"])
    def _siso_bwd_dkv_kernel(
        q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, phi_in, dy, dg_out,
        dk, dkb, dv, dw, dcur, dB, dphi,
        T, NC, H, HPG, P, N, S,
        s_vb, s_vt, s_vh, s_zb, s_zt, s_zh, s_ab, s_at, s_ah, s_as,
        BT: tl.constexpr, BP: tl.constexpr, BN2: tl.constexpr,
        HAS_D: tl.constexpr, HAS_Z: tl.constexpr, FAST_TRIG: tl.constexpr,
    ):  # fmt: skip
        """Backward v2, part 2: chunk i_c of one (batch, head), no state across chunks. The
        gradients reached through k̄ and x: dv, dk̄ (rotated back to dk, per head), dw, dcur and
        the k terms of the cumsums (dB = −k̄·dk̄, dΦ)."""
        i_c, i_bh = tl.program_id(0), tl.program_id(1)
        i_b, i_h = i_bh // H, i_bh % H
        b_cur, b_w, b_A, b_AL, _, _, b_qc, b_kc = _chunk_operands(
            q, k, adt, dt, trap, q_bias, k_bias, angles, phi_in, i_b, i_h, i_c,
            T, NC, H, HPG, N, S, s_ab, s_at, s_ah, s_as, BT, BN2, FAST_TRIG,
        )  # fmt: skip
        o_t = tl.arange(0, BT)
        o_p = tl.arange(0, BP)
        o_m = tl.arange(0, BN2)
        o_n = tl.arange(0, 2 * BN2)
        o_tc = i_c * BT + o_t
        m_t = o_tc < T
        m_x = m_t[:, None] & (o_p < P)[None, :]
        m_strict = o_t[:, None] > o_t[None, :]
        m_diag = o_t[:, None] == o_t[None, :]
        # Scalar 64-bit bases, 32-bit tile offsets. dy, dv: contiguous (b, t, h, p); dk (b, t,
        # h, n); dphi (b, t, h, s); dw, dcur, dB (b, h, t).
        o_bth = i_b.to(tl.int64) * T * H + i_h
        o_y = o_tc[:, None] * (H * P) + o_p[None, :]
        p_v = v + i_b.to(tl.int64) * s_vb + i_h * s_vh
        b_x = tl.load(p_v + o_tc[:, None] * s_vt + o_p[None, :], mask=m_x, other=0.0)
        DT = b_x.dtype
        b_dy = tl.load(dy + o_bth * P + o_y, mask=m_x, other=0.0).to(tl.float32)
        p_z = z + i_b.to(tl.int64) * s_zb + i_h * s_zh
        b_do, _ = _gated_do(b_dy, p_z, o_tc, m_x, o_p, s_zt, HAS_Z)
        b_doc = b_do.to(DT)

        # dM = do xᵀ; the score gradient is dM ⊙ decay ⊙ W, the weight gradients the column
        # sums of s ⊙ dM ⊙ decay = M ⊙ dM over the weight.
        b_Dw = _decay_weights(b_A, b_w, b_cur, m_strict, m_diag)
        b_M = tl.dot(b_qc, tl.trans(b_kc)) * b_Dw
        b_dM = tl.dot(b_doc, tl.trans(b_x))
        b_MdM = b_M * b_dM
        b_dcur = tl.sum(tl.where(m_diag, b_MdM, 0.0), axis=0)
        b_dcur = tl.where(b_cur > 0, b_dcur / b_cur, 0.0)
        b_dw = tl.sum(tl.where(m_strict, b_MdM, 0.0), axis=0)
        b_dw = tl.where(b_w > 0, b_dw / b_w, 0.0)
        b_Mc = b_M.to(DT)
        b_dsc = (b_dM * b_Dw).to(DT)

        # x enters the output through M and the state leaving the chunk (gradient dG).
        b_eL = tl.exp(b_AL - b_A)
        b_ew = b_eL * b_w
        o_g = (i_bh.to(tl.int64) * NC + i_c) * BP * 2 * BN2
        b_dGc = tl.load(dg_out + o_g + o_p[:, None] * (2 * BN2) + o_n[None, :])
        b_u = tl.dot(b_kc, tl.trans(b_dGc))
        b_dx = tl.dot(tl.trans(b_Mc), b_doc) + b_ew[:, None] * b_u
        if HAS_D:
            b_dx += tl.load(d + i_h).to(tl.float32) * b_do
        tl.store(dv + o_bth * P + o_y, b_dx.to(dv.dtype.element_ty), mask=m_x)
        b_dw += b_eL * tl.sum(b_x.to(tl.float32) * b_u, axis=1)
        tl.store(dw + i_bh.to(tl.int64) * T + o_tc, b_dw, mask=m_t)
        tl.store(dcur + i_bh.to(tl.int64) * T + o_tc, b_dcur, mask=m_t)

        b_xw = (b_x.to(tl.float32) * b_ew[:, None]).to(DT)
        b_dk = tl.dot(tl.trans(b_dsc), b_qc) + tl.dot(b_xw, b_dGc)

        # adt: dB_i = q̄_i·dq̄_i − k̄_i·dk̄_i, the k term here; rotation: dΦ, dk = Rᵀ dk̄.
        G = H // HPG
        m_n = o_n < N
        b_kb = tl.load(k_bias + i_h * N + o_n, mask=m_n, other=0.0)
        p_k = k + (i_b.to(tl.int64) * T * G + i_h // HPG) * N
        # cos/sin again rather than held across the dots: fewer spills here (not in the dq
        # kernel, which holds them); the reloads hit in cache.
        b_dt = tl.load(dt + i_bh.to(tl.int64) * T + o_tc, mask=m_t, other=0.0)
        b_cos, b_sin = _chunk_rotation(angles, phi_in, b_dt, i_b, i_h, i_c, o_tc, m_t, NC, H, S,
                                       s_ab, s_at, s_ah, s_as, BN2, FAST_TRIG)  # fmt: skip
        b_kdk, b_dphi, b_dk = _angle_terms(p_k, b_kb, o_tc, m_t, G * N, N, b_dk, b_cos, b_sin,
                                           BT, BN2)  # fmt: skip
        tl.store(dB + i_bh.to(tl.int64) * T + o_tc, -b_kdk, mask=m_t)
        m_a = m_t[:, None] & (o_m < S)[None, :]
        tl.store(dphi + o_bth * S + o_tc[:, None] * (H * S) + o_m[None, :], b_dphi, mask=m_a)
        tl.store(dk + o_bth * N + o_tc[:, None] * (H * N) + o_n[None, :], b_dk,
                 mask=m_t[:, None] & m_n[None, :])  # fmt: skip
        tl.store(dkb + ((i_b * NC + i_c) * H + i_h) * N + o_n, tl.sum(b_dk, axis=0), mask=m_n)

    @triton.jit(do_not_specialize=["T", "NC"])
    def _siso_bwd_dq_kernel(
        q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, g_in, phi_in, dy,
        dq, dqb, dz, dB, dphi, dd,
        T, NC, H, HPG, P, N, S,
        s_vb, s_vt, s_vh, s_zb, s_zt, s_zh, s_ab, s_at, s_ah, s_as,
        BT: tl.constexpr, BP: tl.constexpr, BN2: tl.constexpr,
        HAS_D: tl.constexpr, HAS_Z: tl.constexpr, FAST_TRIG: tl.constexpr,
    ):  # fmt: skip
        """Backward v2, part 3: chunk i_c of one (batch, head), after part 2. The gradients
        reached through q̄ and the gate: dz, dq̄ (rotated back to dq, per head), the d partial
        sum, and the q terms of the cumsums, added to part 2's in place."""
        i_c, i_bh = tl.program_id(0), tl.program_id(1)
        i_b, i_h = i_bh // H, i_bh % H
        b_cur, b_w, b_A, _, b_cos, b_sin, b_qc, b_kc = _chunk_operands(
            q, k, adt, dt, trap, q_bias, k_bias, angles, phi_in, i_b, i_h, i_c,
            T, NC, H, HPG, N, S, s_ab, s_at, s_ah, s_as, BT, BN2, FAST_TRIG,
        )  # fmt: skip
        o_t = tl.arange(0, BT)
        o_p = tl.arange(0, BP)
        o_m = tl.arange(0, BN2)
        o_n = tl.arange(0, 2 * BN2)
        o_tc = i_c * BT + o_t
        m_t = o_tc < T
        m_x = m_t[:, None] & (o_p < P)[None, :]
        m_strict = o_t[:, None] > o_t[None, :]
        m_diag = o_t[:, None] == o_t[None, :]
        o_bth = i_b.to(tl.int64) * T * H + i_h
        o_y = o_tc[:, None] * (H * P) + o_p[None, :]
        p_v = v + i_b.to(tl.int64) * s_vb + i_h * s_vh
        b_x = tl.load(p_v + o_tc[:, None] * s_vt + o_p[None, :], mask=m_x, other=0.0)
        DT = b_x.dtype
        b_dy = tl.load(dy + o_bth * P + o_y, mask=m_x, other=0.0).to(tl.float32)
        p_z = z + i_b.to(tl.int64) * s_zb + i_h * s_zh
        b_do, b_dzo = _gated_do(b_dy, p_z, o_tc, m_x, o_p, s_zt, HAS_Z)
        b_doc = b_do.to(DT)
        if HAS_D:
            b_xd = tl.sum(b_do * b_x.to(tl.float32), axis=1)
            tl.store(dd + (i_b * NC + i_c) * H + i_h, tl.sum(b_xd, axis=0))

        # The score gradient dM ⊙ decay ⊙ W, and (for the gate) M = s ⊙ decay ⊙ W.
        b_Dw = _decay_weights(b_A, b_w, b_cur, m_strict, m_diag)
        b_dsc = (tl.dot(b_doc, tl.trans(b_x)) * b_Dw).to(DT)
        b_eA = tl.exp(b_A)
        o_g = (i_bh.to(tl.int64) * NC + i_c) * BP * 2 * BN2
        b_Gc = tl.load(g_in + o_g + o_p[:, None] * (2 * BN2) + o_n[None, :])  # entering state
        if HAS_Z:
            # Recompute the pre-gate output for the silu(z) gradient.
            b_Mc = (tl.dot(b_qc, tl.trans(b_kc)) * b_Dw).to(DT)
            b_o = tl.dot(b_Mc, b_x) + b_eA[:, None] * tl.dot(b_qc, tl.trans(b_Gc))
            if HAS_D:
                b_o += tl.load(d + i_h).to(tl.float32) * b_x.to(tl.float32)
            tl.store(dz + o_bth * P + o_y, (b_dzo * b_o).to(dz.dtype.element_ty), mask=m_x)
        b_dq = tl.dot(b_dsc, b_kc) + b_eA[:, None] * tl.dot(b_doc, b_Gc)

        # adt: the q̄·dq̄ term, added to part 2's; rotation: dΦ (added), dq = Rᵀ dq̄.
        G = H // HPG
        m_n = o_n < N
        b_qb = tl.load(q_bias + i_h * N + o_n, mask=m_n, other=0.0)
        p_q = q + (i_b.to(tl.int64) * T * G + i_h // HPG) * N
        b_qdq, b_dphi, b_dq = _angle_terms(p_q, b_qb, o_tc, m_t, G * N, N, b_dq, b_cos, b_sin,
                                           BT, BN2)  # fmt: skip
        p_dB = dB + i_bh.to(tl.int64) * T + o_tc
        tl.store(p_dB, tl.load(p_dB, mask=m_t, other=0.0) + b_qdq, mask=m_t)
        m_a = m_t[:, None] & (o_m < S)[None, :]
        p_dphi = dphi + o_bth * S + o_tc[:, None] * (H * S) + o_m[None, :]
        tl.store(p_dphi, tl.load(p_dphi, mask=m_a, other=0.0) + b_dphi, mask=m_a)
        tl.store(dq + o_bth * N + o_tc[:, None] * (H * N) + o_n[None, :], b_dq,
                 mask=m_t[:, None] & m_n[None, :])  # fmt: skip
        tl.store(dqb + ((i_b * NC + i_c) * H + i_h) * N + o_n, tl.sum(b_dq, axis=0), mask=m_n)

    @triton.jit(do_not_specialize=["T", "NC"])
    def _siso_bwd_cumsum_kernel(
        dt, angles, dphi_t, dA_t, dadt, ddt, dangles, dphi0,
        T, NC, H, S, s_ab, s_at, s_ah, s_as,
        BT: tl.constexpr, BN2: tl.constexpr,
    ):  # fmt: skip
        """Backward v2, part 3: the reverse cumsums over the whole sequence, in place: dB (in
        ``dadt``) to the adt gradient, dΦ (in ``dangles``) to the angle gradient, plus the
        angle term of the Δ gradient (in ``ddt``)."""
        i_bh = tl.program_id(0)
        i_b, i_h = i_bh // H, i_bh % H
        angles += i_b.to(tl.int64) * s_ab + i_h * s_ah
        dangles += (i_b.to(tl.int64) * T * H + i_h) * S
        dt += i_bh.to(tl.int64) * T
        dadt += i_bh.to(tl.int64) * T
        ddt += i_bh.to(tl.int64) * T

        o_t = tl.arange(0, BT)
        o_m = tl.arange(0, BN2)
        m_s = o_m < S
        b_rphi = tl.load(dphi_t + i_bh * S + o_m, mask=m_s, other=0.0)
        b_rA = tl.load(dA_t + i_bh)
        for i_r in range(NC):
            i_c = NC - 1 - i_r
            o_tc = i_c * BT + o_t
            m_t = o_tc < T
            m_a = m_t[:, None] & m_s[None, :]
            b_dB = tl.load(dadt + o_tc, mask=m_t, other=0.0)
            tl.store(dadt + o_tc, b_rA + tl.cumsum(b_dB, axis=0, reverse=True), mask=m_t)
            b_rA += tl.sum(b_dB, axis=0)

            # Φ_t = Φ_0 + Σ_{u≤t} Δ_u·π·tanh(θ̃_u): the reverse cumsum of dΦ reaches each θ̃_u, Δ_u.
            p_d = dangles + o_tc[:, None] * (H * S) + o_m[None, :]
            b_dphi = tl.load(p_d, mask=m_a, other=0.0)
            b_rc = b_rphi[None, :] + tl.cumsum(b_dphi, axis=0, reverse=True)
            b_rphi += tl.sum(b_dphi, axis=0)
            b_dt = tl.load(dt + o_tc, mask=m_t, other=0.0)
            b_th = tl.load(angles + o_tc[:, None] * s_at + o_m[None, :] * s_as, mask=m_a, other=0.0)
            b_th = _tanh(b_th)
            tl.store(p_d, b_rc * b_dt[:, None] * _PI * (1.0 - b_th * b_th), mask=m_a)
            tl.store(ddt + o_tc, _PI * tl.sum(b_rc * b_th, axis=1), mask=m_t)

        tl.store(dphi0 + i_bh * S + o_m, b_rphi, mask=m_s)


# Launch settings of the v2 kernels. Overridable for benchmarking. Chosen by ptxas spills at
# (BT, p, n) = 64 on sm_90 (dkv/dq: ~40 B at 8 warps, ~100 B at 4; dstate: none, 192 regs).
DSTATE_CONFIG: dict = {"BV": 64, "num_warps": 4, "num_stages": 2}
DKV_CONFIG: dict = {"num_warps": 8, "num_stages": 1}
DQ_CONFIG: dict = {"num_warps": 8, "num_stages": 1}
CUMSUM_CONFIG: dict = {"num_warps": 4, "num_stages": 2}


def siso_bwd_v2(q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, g_in, phi_in,
                dy, dg_t, dphi_t, dA_t, chunk_size):  # fmt: skip
    """Launch the three v2 kernels. Returns the gradients with the head and batch sums done:
    dq, dk (b, t, g, n) fp32, dq_bias, dk_bias (h, n), dv, dz, dadt, dw, dcur, ddt (angle
    term), dangles, dg0, dphi0, dd (h,)."""
    b, t, g, n = q.shape
    h, p = v.shape[2], v.shape[3]
    s = angles.shape[3]
    hpg = h // g
    BT, BP, BN2 = _tiles(p, n, chunk_size)
    nc = triton.cdiv(t, BT)
    dev = v.device
    f32 = dict(dtype=torch.float32, device=dev)
    fast_trig = os.environ.get("TRITON_INTERPRET", "0") != "1"
    dg_out = torch.empty_like(g_in)
    dg0 = torch.empty(b, h, p, n, **f32)
    zz = z if z is not None else v
    BV = min(DSTATE_CONFIG["BV"] or BP, BP)
    _siso_bwd_dstate_kernel[(triton.cdiv(BP, BV), b * h)](
        q, zz, adt, dt, q_bias, angles, phi_in, dy, dg_t if dg_t is not None else dg0,
        dg_out, dg0,
        t, nc, h, hpg, p, n, s,
        zz.stride(0), zz.stride(1), zz.stride(2),
        angles.stride(0), angles.stride(1), angles.stride(2), angles.stride(3),
        BT=BT, BP=BP, BV=BV, BN2=BN2, HAS_Z=z is not None, HAS_DGT=dg_t is not None,
        FAST_TRIG=fast_trig,
        num_warps=DSTATE_CONFIG["num_warps"], num_stages=DSTATE_CONFIG["num_stages"],
    )  # fmt: skip

    # Per head: dq, dk (b, t, h, n) fp32, summed over heads below when g = 1.
    dq = torch.empty(b, t, h, n, **f32)
    dk = torch.empty(b, t, h, n, **f32)
    dqb = torch.empty(b, nc, h, n, **f32)
    dkb = torch.empty(b, nc, h, n, **f32)
    dv = torch.empty(b, t, h, p, dtype=v.dtype, device=dev)
    dz = torch.empty(b, t, h, p, dtype=z.dtype, device=dev) if z is not None else None
    dadt, dw, dcur, ddt = (torch.empty(b, h, t, **f32) for _ in range(4))
    dangles = torch.empty(b, t, h, s, **f32)
    dd = torch.empty(b, nc, h, **f32)
    dims = (t, nc, h, hpg, p, n, s,
            v.stride(0), v.stride(1), v.stride(2), zz.stride(0), zz.stride(1), zz.stride(2),
            angles.stride(0), angles.stride(1), angles.stride(2), angles.stride(3))  # fmt: skip
    flags = dict(BT=BT, BP=BP, BN2=BN2, HAS_D=d is not None, HAS_Z=z is not None,
                 FAST_TRIG=fast_trig)  # fmt: skip
    dd_ = d if d is not None else q_bias
    _siso_bwd_dkv_kernel[(nc, b * h)](
        q, k, v, zz, adt, dt, trap, q_bias, k_bias, angles, dd_, phi_in, dy, dg_out,
        dk, dkb, dv, dw, dcur, dadt, dangles, *dims, **flags,
        num_warps=DKV_CONFIG["num_warps"], num_stages=DKV_CONFIG["num_stages"],
    )  # fmt: skip
    _siso_bwd_dq_kernel[(nc, b * h)](
        q, k, v, zz, adt, dt, trap, q_bias, k_bias, angles, dd_, g_in, phi_in, dy,
        dq, dqb, dz if dz is not None else dv, dadt, dangles, dd, *dims, **flags,
        num_warps=DQ_CONFIG["num_warps"], num_stages=DQ_CONFIG["num_stages"],
    )  # fmt: skip

    dphi0 = torch.empty(b, h, s, **f32)
    _siso_bwd_cumsum_kernel[(b * h,)](
        dt, angles, dphi_t, dA_t, dadt, ddt, dangles, dphi0,
        t, nc, h, s, angles.stride(0), angles.stride(1), angles.stride(2), angles.stride(3),
        BT=BT, BN2=BN2,
        num_warps=CUMSUM_CONFIG["num_warps"], num_stages=CUMSUM_CONFIG["num_stages"],
    )  # fmt: skip
    dd_h = dd.sum((0, 1)) if d is not None else None
    if g != h:
        dq, dk = dq.sum(2, keepdim=True), dk.sum(2, keepdim=True)
    return (dq, dk, dqb.sum((0, 1)), dkb.sum((0, 1)), dv, dz, dadt, dw, dcur, ddt, dangles,
            dg0, dphi0, dd_h)  # fmt: skip
