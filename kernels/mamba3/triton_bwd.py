"""Triton backward of the Mamba-3 SISO scan: three kernels, two small ones that sum partials
(grouped q, k over their heads; the parameters' gradients over batch and chunks) and no atomics,
so two calls on the same inputs give bitwise-equal gradients.

The only sequential dependency of the backward is the gradient ``dG`` of the augmented state
between chunks (p × n, fp32): ``dG_in = exp(A_L)·dG_out + (exp(A) ⊙ do)ᵀ q̄``. One small kernel
carries it; every other term of a chunk depends on that chunk's inputs, its entering state
``G_in`` (saved by the forward) and its leaving-state gradient ``dG_out`` only, so one
chunk-parallel kernel does all of them. The sequential kernel does nothing else: every load or
store it makes is time on the backward's one serial path.

1. ``siso_bwd_dstate_kernel`` (grid: p blocks × batch·heads, reverse over chunks): carries
   ``dG`` for a block of its rows and writes, per chunk, ``dG_out`` in the dot dtype (the values
   the dots of kernel 2 use), and at the end the start-state gradient. q̄ is rebuilt from q, the
   bias and the angle entering the chunk (saved by the forward) exactly as the forward built
   it; with a gate, ``do = dy ⊙ silu(z)`` is formed in registers and not written.
2. ``siso_bwd_chunk_kernel`` (grid: chunks/cpp × batch·heads/hpp): for one chunk and head, q̄ and k̄
   (rotated in registers), ``do`` and the gate's slope from one load of ``dy`` and ``z``, the
   scores, and every gradient: ``dv``, ``dz`` (recomputing the pre-gate output), ``dq̄``,
   ``dk̄``, the trapezoid-weight gradients ``dw`` and ``dcur``, the ``d`` partial sum and the
   ``adt`` gradient. The latter is chunk-local: ``adt`` enters only through the chunk's
   cumulative decay ``A`` (the carried state sees it through ``exp(A_L)``, whose gradient
   ``exp(A_L)·<dG_out, G_in>`` comes from the two states this kernel reads anyway), so its
   gradient is a reverse cumsum over one chunk of ``∂L/∂A``, never a sequence-long sum.
   Then, still in registers, ``dq̄, dk̄`` are rotated back (``da = Rᵀ dā``), with the per-chunk
   bias partial sums and the per-token angle gradient ``dΦ = ā_E dā_O − ā_O dā_E`` (q and k,
   rotated frame, with the very dot-dtype q̄, k̄ the dots used) and its per-chunk sums. Nothing
   of the rotated frame goes to memory. A program may take several heads of a group of grouped
   q, k in turn (the plan's ``hpp``); ``dq, dk`` are written in the dot dtype per head or per
   such block of heads (their fp32 sum), and what is left of a group's sum is the head sum's
   (below). A program may also take ``cpp`` consecutive chunks in turn, so that under
   num_stages > 1 the compiler loads a chunk's tiles while the one before is worked on.
3. ``siso_bwd_angle_kernel`` (grid: chunks × batch·heads): ``Φ_t`` is a cumsum of
   ``Δ·π·tanh(θ̃)``, so ``∂L/∂θ̃_u`` and the angle term of ``∂L/∂Δ_u`` take the reverse cumsum
   of ``dΦ`` from ``u`` on: a two-level fp32 sum, the chunk-local reverse cumsum plus the sum
   of kernel 2's chunk totals over the later chunks (each program sums them itself, in blocks,
   so no subtraction and no launch between kernels 2 and 3). It also applies the trapezoid
   chain rule from ``(dw, dcur)`` to ``(ddt, dtrap)`` (a shift by one token, read across the
   chunk boundary).

The partial sums that end it, the head sum (grouped q, k over their heads) and the parameters'
gradients over batch and chunks, are :mod:`kernels.mamba3.triton_sums`.
"""

from __future__ import annotations

import torch

from .triton_common import (
    PI,
    LaunchConfig,
    Tiles,
    chunk_phase,
    chunk_scalars,
    decay_weights,
    interpreting,
    launch,
    load_dense,
    load_tile,
    rotate,
    segments,
    sigmoid,
    store_dense,
    store_tile,
    tanh,
    tile_ptr,
    tl,
    to_dot,
    triton,
)
from .triton_sums import head_sums, param_sums

if triton is not None:
    if interpreting():

        @triton.jit
        def _pin(x):
            return x

    else:

        @triton.jit
        def _pin(x):
            """x (fp32) through an opaque copy, so it is computed once, where it is written: the
            compiler would otherwise recompute a value used in several register layouts (a dot
            operand, an elementwise term) from its loads in each of them, for every warp.
            Pinning the rotated q̄, k̄ took the chunk kernel from 1,449 to 1,336 µs on an H200."""
            return tl.inline_asm_elementwise(
                "mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=False, pack=1
            )

    @triton.jit
    def _rotated_tile(p_x, b_bias, b_cos, b_sin, DT: tl.constexpr, BT: tl.constexpr,
                      BN2: tl.constexpr):  # fmt: skip
        """R(Φ)(x + bias) of a loaded (BT × 2·BN2) tile, as a dot operand of dtype DT: the same
        operations, in the same order, as the forward's rotation, so the same values; pinned, so
        every use of the tile (the score and state dots, the angle gradient) sees one value."""
        b_x = load_tile(p_x).to(tl.float32) + b_bias[None, :]
        return to_dot(_pin(rotate(b_x, b_cos, b_sin, BT, BN2)), DT)

    @triton.jit
    def _rotate_back(b_g, b_r, b_cos, b_sin, BT: tl.constexpr, BN2: tl.constexpr):
        """For the gradient ``b_g`` (fp32) of a rotated tile ā = ``b_r`` (dot dtype), in natural
        column order: the even and odd columns of Rᵀ b_g and the angle gradient per pair,
        ā_E g_O − ā_O g_E."""
        b_gE, b_gO = tl.split(tl.reshape(b_g, (BT, BN2, 2)))
        b_rE, b_rO = tl.split(tl.reshape(b_r.to(tl.float32), (BT, BN2, 2)))
        return (b_gE * b_cos + b_gO * b_sin, b_gO * b_cos - b_gE * b_sin,
                b_rE * b_gO - b_rO * b_gE)  # fmt: skip

    @triton.jit
    def _gate(dy, z, s_yt, s_zt, T, P, r0, BT: tl.constexpr, BV: tl.constexpr,
              HAS_Z: tl.constexpr):  # fmt: skip
        """For the (BT × BV) tiles at row r0 of dy and z (pointers at the tiles' first column, P
        columns from there), fp32: do = dy ⊙ silu(z), the gradient of the pre-gate output, and
        dy ⊙ silu'(z), which times the pre-gate output is dz (without z: dy, and dy again)."""
        b_dy = load_tile(tile_ptr(dy, T, P, s_yt, r0, BT, BV)).to(tl.float32)
        if HAS_Z:
            b_z = load_tile(tile_ptr(z, T, P, s_zt, r0, BT, BV)).to(tl.float32)
            b_sg = sigmoid(b_z)
            return b_dy * b_z * b_sg, b_dy * b_sg * (1.0 + b_z * (1.0 - b_sg))
        return b_dy, b_dy

    @triton.jit(do_not_specialize=["T", "NC"])
    def siso_bwd_dstate_kernel(
        q, adt, dt, trap, q_bias, angles, phi_in, z, dy, dg_t, seg, dg_out, dg0,
        T, NC, H, HPG, P, N, S, s_zb, s_zt, s_zh, s_ab, s_at, s_ah, s_as,
        BT: tl.constexpr, BP: tl.constexpr, BV: tl.constexpr, BN2: tl.constexpr,
        HAS_Z: tl.constexpr, HAS_DGT: tl.constexpr, HAS_RESET: tl.constexpr,
    ):  # fmt: skip
        """Rows i_v·BV.. of dG for one (batch, head), chunks in reverse. See the module
        docstring. ``dy`` is (b, t, h, p) contiguous; ``dg_out`` is (b·h, nc, BP, BN) in the
        dot dtype."""
        i_v, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
        i_b, i_h = i_bh // H, i_bh % H
        G = H // HPG
        i_g = i_h // HPG
        v0 = i_v * BV
        q += (i_b.to(tl.int64) * T * G + i_g) * N
        dy += (i_b.to(tl.int64) * T * H + i_h) * P + v0
        z += i_b.to(tl.int64) * s_zb + i_h * s_zh + v0
        angles += i_b.to(tl.int64) * s_ab + i_h * s_ah
        o_s = i_bh * T
        adt += o_s
        dt += o_s
        trap += o_s
        seg += i_b * NC * BT
        o_t = tl.arange(0, BT)
        o_m = tl.arange(0, BN2)
        o_n = tl.arange(0, 2 * BN2)
        b_qb = tl.load(q_bias + i_h * N + o_n, mask=o_n < N, other=0.0)
        DT = dg_out.dtype.element_ty

        o_g = i_bh.to(tl.int64) * P * N
        if HAS_DGT:
            b_dG = load_tile(tile_ptr(dg_t + o_g, P, N, N, v0, BV, 2 * BN2))
        else:
            b_dG = tl.zeros([BV, 2 * BN2], dtype=tl.float32)

        for i_r in range(NC):
            i_c = NC - 1 - i_r
            o_tc = i_c * BT + o_t
            m_t = o_tc < T
            r0 = i_c * BT
            b_dt, _, _, b_A2, b_AL2 = chunk_scalars(adt, dt, trap, T, o_tc, m_t, o_t, BT)
            b_eA = tl.exp2(b_A2)
            b_eAL = tl.exp2(b_AL2)
            if HAS_RESET:  # as in the forward: no decay crosses a reset
                m_in, _m_out, keep, _m_same = segments(seg, o_tc, i_c * BT + BT - 1)
                b_eA = tl.where(m_in, b_eA, 0.0)
                b_eAL = tl.where(keep, b_eAL, 0.0)

            # dG_out of this chunk, for kernel 2 (dot dtype).
            o_gc = (i_bh * NC + i_c) * BP * 2 * BN2
            store_dense(dg_out + o_gc, v0, b_dG, BV, 2 * BN2)

            b_phi0 = tl.load(phi_in + (i_bh * NC + i_c) * BN2 + o_m)
            b_cos, b_sin, _ = chunk_phase(angles, s_at, s_as, b_dt, b_phi0, o_tc, m_t, S, BN2)
            b_qc = _rotated_tile(tile_ptr(q, T, N, G * N, r0, BT, 2 * BN2), b_qb, b_cos, b_sin,
                                 DT, BT, BN2)  # fmt: skip
            b_do, _ = _gate(dy, z, H * P, s_zt, T, P - v0, r0, BT, BV, HAS_Z)
            b_doA = to_dot(to_dot(b_do, DT).to(tl.float32) * b_eA[:, None], DT)
            b_dG = b_dG * b_eAL + tl.dot(tl.trans(b_doA), b_qc)
        store_tile(tile_ptr(dg0 + o_g, P, N, N, v0, BV, 2 * BN2), b_dG)

    @triton.jit
    def _chunk_head(
        q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, phi_in, g_in, dg_out, dy, seg,
        dq, dk, dv, dz, dadt, dw, dcur, dd, dqb, dkb, dphi, dphi_c, acc_q, acc_k, i_c, i_b, i_h,
        T, NC, H, HPG, P, N, S, s_vb, s_vt, s_vh, s_zb, s_zt, s_zh, s_ab, s_at, s_ah, s_as,
        BT: tl.constexpr, BP: tl.constexpr, BN2: tl.constexpr, HPP: tl.constexpr,
        HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_RESET: tl.constexpr,
    ):  # fmt: skip
        """Chunk i_c of head i_h of batch i_b: every gradient written, but with HPP > 1 dq and
        dk, which are added to the (BT × 2·BN2, fp32) ``acc_q``, ``acc_k`` and returned. With
        HPP = 1 each is stored as soon as it is formed, so it holds no registers after. The gated
        ``do`` and the gate's slope are pinned (:func:`_pin`): left to the compiler, the gate was
        recomputed from dy and z in each layout ``do`` is used in, for every warp."""
        i_bh = i_b * H + i_h
        i_g = i_h // HPG
        G = H // HPG
        o_t = tl.arange(0, BT)
        o_m = tl.arange(0, BN2)
        o_n = tl.arange(0, 2 * BN2)
        o_tc = i_c * BT + o_t
        m_t = o_tc < T
        r0 = i_c * BT
        m_a = m_t[:, None] & (o_m < S)[None, :]
        m_strict = o_t[:, None] > o_t[None, :]
        m_diag = o_t[:, None] == o_t[None, :]
        o_qk = (i_b * T * G + i_g) * N
        p_q = tile_ptr(q + o_qk, T, N, G * N, r0, BT, 2 * BN2)
        p_k = tile_ptr(k + o_qk, T, N, G * N, r0, BT, 2 * BN2)
        o_s = i_bh * T
        o_p = (i_b * T * H + i_h) * P  # (b, t, h, p) contiguous: dy, do, dv, dz
        o_out = (i_b * T * H + i_h) * N  # (b, t, h, n): dq, dk with HPP = 1
        b_dt, b_cur, b_w, b_A2, b_AL2 = chunk_scalars(adt + o_s, dt + o_s, trap + o_s, T,
                                                      o_tc, m_t, o_t, BT)  # fmt: skip
        b_eA = tl.exp2(b_A2)
        b_eL = tl.exp2(b_AL2 - b_A2)
        m_low = m_strict
        if HAS_RESET:  # see the forward
            p_seg = seg + i_b * NC * BT
            m_in, m_out, keep, m_same = segments(p_seg, o_tc, r0 + BT - 1)
            b_eA = tl.where(m_in, b_eA, 0.0)
            b_eL = tl.where(m_out, b_eL, 0.0)
            m_low = m_strict & m_same
        b_ew = b_eL * b_w

        b_phi0 = tl.load(phi_in + (i_bh * NC + i_c) * BN2 + o_m)
        p_a = angles + i_b * s_ab + i_h * s_ah
        b_cos, b_sin, _ = chunk_phase(p_a, s_at, s_as, b_dt, b_phi0, o_tc, m_t, S, BN2)
        p_x = tile_ptr(v + i_b * s_vb + i_h * s_vh, T, P, s_vt, r0, BT, BP)
        b_x = load_tile(p_x)
        DT = b_x.dtype
        b_qb = tl.load(q_bias + i_h * N + o_n, mask=o_n < N, other=0.0)
        b_qc = _rotated_tile(p_q, b_qb, b_cos, b_sin, DT, BT, BN2)
        b_kb = tl.load(k_bias + i_h * N + o_n, mask=o_n < N, other=0.0)
        b_kc = _rotated_tile(p_k, b_kb, b_cos, b_sin, DT, BT, BN2)
        b_do, b_gz = _gate(dy + o_p, z + i_b * s_zb + i_h * s_zh, H * P, s_zt, T, P, r0, BT, BP,
                           HAS_Z)  # fmt: skip
        if HAS_Z:
            b_do, b_gz = _pin(b_do), _pin(b_gz)
        b_doc = to_dot(b_do, DT)

        # Scores S = q̄k̄ᵀ, M = S ⊙ decay ⊙ W, dM = do xᵀ, dS = dM ⊙ decay ⊙ W. S ⊙ dS
        # (= M ⊙ dM) gives the decay gradient (row sums minus column sums below the
        # diagonal) and, over w, the weight gradient; the diagonals give dcur and d.
        b_Dw = decay_weights(b_A2, b_w, b_cur, m_low, m_diag)
        b_S = tl.dot(b_qc, tl.trans(b_kc))
        b_Mc = to_dot(b_S * b_Dw, DT)
        b_dS = tl.dot(b_doc, tl.trans(b_x))
        b_dox = tl.sum(tl.where(m_diag, b_dS, 0.0), axis=1)  # do_j·x_j
        tl.store(dd + (i_b * NC + i_c) * H + i_h, tl.sum(b_dox, axis=0))
        b_qk = tl.sum(tl.where(m_diag, b_S, 0.0), axis=1)  # q̄_j·k̄_j = q_j·k_j
        tl.store(dcur + o_s + o_tc, b_qk * b_dox, mask=m_t)
        b_dS = b_dS * b_Dw
        b_MdM = tl.where(m_low, b_S * b_dS, 0.0)
        b_dA = tl.sum(b_MdM, axis=1)
        b_MdM = tl.sum(b_MdM, axis=0)
        b_dA -= b_MdM
        b_dw = tl.where(b_w > 0, b_MdM / tl.where(b_w > 0, b_w, 1.0), 0.0)
        b_dSc = to_dot(b_dS, DT)

        # The entering state G_in: the inter-chunk output exp(A_i)·G_in q̄_i (its decay
        # gradient and, with z, the pre-gate output) and dq̄ = dS k̄ + exp(A) ⊙ do G_in,
        # rotated back at once (da = Rᵀ dā; dΦ = ā_E dā_O − ā_O dā_E).
        o_gc = (i_bh * NC + i_c) * BP * 2 * BN2
        b_Gc = load_dense(g_in + o_gc, 0, BP, 2 * BN2)
        b_qG = tl.dot(b_qc, tl.trans(b_Gc))
        b_dA += b_eA * tl.sum(b_doc.to(tl.float32) * b_qG, axis=1)
        b_dqr = tl.dot(b_dSc, b_kc) + b_eA[:, None] * tl.dot(b_doc, b_Gc)
        o_b = ((i_b * NC + i_c) * H + i_h) * N
        b_daE, b_daO, b_dphi = _rotate_back(b_dqr, b_qc, b_cos, b_sin, BT, BN2)
        b_dq = tl.reshape(tl.join(b_daE, b_daO), (BT, 2 * BN2))
        if HPP == 1:
            store_tile(tile_ptr(dq + o_out, T, N, H * N, r0, BT, 2 * BN2), b_dq)
        else:
            acc_q += b_dq
        tl.store(dqb + o_b + 2 * o_m, tl.sum(b_daE, axis=0), mask=2 * o_m < N)
        tl.store(dqb + o_b + 2 * o_m + 1, tl.sum(b_daO, axis=0), mask=2 * o_m + 1 < N)
        if HAS_Z:
            b_o = tl.dot(b_Mc, b_x) + b_eA[:, None] * b_qG
            if HAS_D:
                b_o += tl.load(d + i_h).to(tl.float32) * b_x.to(tl.float32)
            store_tile(tile_ptr(dz + o_p, T, P, H * P, r0, BT, BP), b_gz * b_o)

        # The leaving state's gradient dG_out: dx = Mᵀ do + exp(A_L − A) w ⊙ (k̄ dGᵀ) + D do,
        # dk̄ = dSᵀ q̄ + exp(A_L − A) w ⊙ (x dG), rotated back like dq̄.
        b_dGc = load_dense(dg_out + o_gc, 0, BP, 2 * BN2)
        b_u = tl.dot(b_kc, tl.trans(b_dGc))
        b_xu = tl.sum(b_x.to(tl.float32) * b_u, axis=1)  # x_jᵀ dG k̄_j
        b_dx = tl.dot(tl.trans(b_Mc), b_doc) + b_ew[:, None] * b_u
        if HAS_D:
            b_dx += tl.load(d + i_h).to(tl.float32) * b_doc.to(tl.float32)
        store_tile(tile_ptr(dv + o_p, T, P, H * P, r0, BT, BP), b_dx)
        b_dkr = tl.dot(tl.trans(b_dSc), b_qc) + b_ew[:, None] * tl.dot(b_x, b_dGc)
        b_daE, b_daO, b_dphik = _rotate_back(b_dkr, b_kc, b_cos, b_sin, BT, BN2)
        b_dk = tl.reshape(tl.join(b_daE, b_daO), (BT, 2 * BN2))
        if HPP == 1:
            store_tile(tile_ptr(dk + o_out, T, N, H * N, r0, BT, 2 * BN2), b_dk)
        else:
            acc_k += b_dk
        tl.store(dkb + o_b + 2 * o_m, tl.sum(b_daE, axis=0), mask=2 * o_m < N)
        tl.store(dkb + o_b + 2 * o_m + 1, tl.sum(b_daO, axis=0), mask=2 * o_m + 1 < N)
        b_dphi = tl.where(m_a, b_dphi + b_dphik, 0.0)
        p_d = dphi + (i_b * T * H + i_h) * S
        tl.store(p_d + o_tc[:, None] * (H * S) + o_m[None, :], b_dphi, mask=m_a)
        tl.store(dphi_c + (i_bh * NC + i_c) * BN2 + o_m, tl.sum(b_dphi, axis=0))

        # The leaving state's exp(A_L)·G_in and its Σ_j exp(A_L − A_j) w_j x_j k̄_jᵀ: ∂/∂A_L,
        # −∂/∂A_j and ∂/∂w_j. Both states are read again here (cache hits) rather than held.
        b_eAL = tl.exp2(b_AL2)
        if HAS_RESET:
            b_eAL = tl.where(keep, b_eAL, 0.0)
        b_GG = load_dense(g_in + o_gc, 0, BP, 2 * BN2).to(tl.float32) * load_dense(
            dg_out + o_gc, 0, BP, 2 * BN2
        ).to(tl.float32)
        b_dAL = b_eAL * tl.sum(tl.sum(b_GG, axis=1), axis=0)
        b_sw = b_ew * b_xu
        b_dAL += tl.sum(b_sw, axis=0)
        b_dA = b_dA - b_sw + tl.where(o_t == BT - 1, b_dAL, 0.0)
        tl.store(dadt + o_s + o_tc, tl.cumsum(b_dA, axis=0, reverse=True), mask=m_t)
        tl.store(dw + o_s + o_tc, b_dw + b_eL * b_xu, mask=m_t)
        return acc_q, acc_k

    @triton.jit
    def _chunk_block(
        q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, phi_in, g_in, dg_out, dy, seg,
        dq, dk, dv, dz, dadt, dw, dcur, dd, dqb, dkb, dphi, dphi_c, i_c, i_b, i_blk,
        T, NC, H, HPG, P, N, S, s_vb, s_vt, s_vh, s_zb, s_zt, s_zh, s_ab, s_at, s_ah, s_as,
        BT: tl.constexpr, BP: tl.constexpr, BN2: tl.constexpr, HPP: tl.constexpr,
        HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_RESET: tl.constexpr,
    ):  # fmt: skip
        """Chunk i_c of the HPP heads of block i_blk of batch i_b: their gradients, dq and dk
        summed over the block."""
        if HPP == 1:
            _chunk_head(
                q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, phi_in, g_in, dg_out, dy,
                seg, dq, dk, dv, dz, dadt, dw, dcur, dd, dqb, dkb, dphi, dphi_c, 0.0, 0.0, i_c,
                i_b, i_blk, T, NC, H, HPG, P, N, S, s_vb, s_vt, s_vh, s_zb, s_zt, s_zh, s_ab,
                s_at, s_ah, s_as, BT, BP, BN2, HPP, HAS_D, HAS_Z, HAS_RESET,
            )  # fmt: skip
        else:
            NB = H // HPP
            b_dq = tl.zeros([BT, 2 * BN2], dtype=tl.float32)
            b_dk = tl.zeros([BT, 2 * BN2], dtype=tl.float32)
            for j in range(HPP):
                b_dq, b_dk = _chunk_head(
                    q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, phi_in, g_in, dg_out,
                    dy, seg, dq, dk, dv, dz, dadt, dw, dcur, dd, dqb, dkb, dphi, dphi_c, b_dq,
                    b_dk, i_c, i_b, i_blk * HPP + j, T, NC, H, HPG, P, N, S, s_vb, s_vt, s_vh,
                    s_zb, s_zt, s_zh, s_ab, s_at, s_ah, s_as, BT, BP, BN2, HPP, HAS_D, HAS_Z,
                    HAS_RESET,
                )  # fmt: skip
            o_out = (i_b * T * NB + i_blk) * N
            r0 = i_c * BT
            store_tile(tile_ptr(dq + o_out, T, N, NB * N, r0, BT, 2 * BN2), b_dq)
            store_tile(tile_ptr(dk + o_out, T, N, NB * N, r0, BT, 2 * BN2), b_dk)

    @triton.jit(do_not_specialize=["T", "NC"])
    def siso_bwd_chunk_kernel(
        q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, phi_in, g_in, dg_out, dy, seg,
        dq, dk, dv, dz, dadt, dw, dcur, dd, dqb, dkb, dphi, dphi_c,
        T, NC, H, HPG, P, N, S, s_vb, s_vt, s_vh, s_zb, s_zt, s_zh, s_ab, s_at, s_ah, s_as,
        BT: tl.constexpr, BP: tl.constexpr, BN2: tl.constexpr, HPP: tl.constexpr,
        CPP: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_RESET: tl.constexpr,
    ):  # fmt: skip
        """CPP consecutive chunks, in turn, of HPP consecutive heads of one group of one batch
        (grid: chunk blocks × batch · h/HPP). See the module docstring. dq, dk are
        (b, t, h/HPP, n) in the dot dtype: each program's heads summed in fp32 (with HPP = 1,
        per head); where that is not a whole group of grouped q, k, the caller sums the rest.
        With CPP > 1 and num_stages > 1 the compiler can load a chunk's tiles while the one
        before is worked on."""
        i_cb, i_bp = tl.program_id(0), tl.program_id(1).to(tl.int64)
        NB = H // HPP
        i_b, i_blk = i_bp // NB, i_bp % NB
        if CPP == 1:
            _chunk_block(
                q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, phi_in, g_in, dg_out, dy,
                seg, dq, dk, dv, dz, dadt, dw, dcur, dd, dqb, dkb, dphi, dphi_c, i_cb, i_b,
                i_blk, T, NC, H, HPG, P, N, S, s_vb, s_vt, s_vh, s_zb, s_zt, s_zh, s_ab, s_at,
                s_ah, s_as, BT, BP, BN2, HPP, HAS_D, HAS_Z, HAS_RESET,
            )  # fmt: skip
        else:
            for i_c in range(i_cb * CPP, tl.minimum(NC, i_cb * CPP + CPP)):
                _chunk_block(
                    q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, phi_in, g_in, dg_out,
                    dy, seg, dq, dk, dv, dz, dadt, dw, dcur, dd, dqb, dkb, dphi, dphi_c, i_c,
                    i_b, i_blk, T, NC, H, HPG, P, N, S, s_vb, s_vt, s_vh, s_zb, s_zt, s_zh, s_ab,
                    s_at, s_ah, s_as, BT, BP, BN2, HPP, HAS_D, HAS_Z, HAS_RESET,
                )  # fmt: skip

    @triton.jit(do_not_specialize=["T", "NC"])
    def siso_bwd_angle_kernel(
        dt, trap, angles, dphi, dphi_c, dphi_t, dw, dcur, ddt, dtrap, dphi0,
        T, NC, H, S, s_ab, s_at, s_ah, s_as,
        BT: tl.constexpr, BN2: tl.constexpr, BNC: tl.constexpr,
    ):  # fmt: skip
        """Chunk i_c of one (batch, head): the reverse cumsum of dΦ (chunk-local, plus the chunk
        totals ``dphi_c`` of the later chunks and the final angle's gradient) to the angle
        gradient, in place in ``dphi``; chunk 0 also writes the start angle's gradient. Then the
        trapezoid chain rule from kernel 2's ``(dw, dcur)``, with
        w_u = λ_uΔ_u + (1−λ_{u+1})Δ_{u+1} and cur_u = λ_uΔ_u: ``ddt`` (plus the angle term) and
        ``dtrap`` (λ = sigmoid(trap))."""
        i_c, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
        i_b, i_h = i_bh // H, i_bh % H
        o_t = tl.arange(0, BT)
        o_m = tl.arange(0, BN2)
        o_j = tl.arange(0, BNC)
        o_tc = i_c * BT + o_t
        m_t = o_tc < T
        m_s = o_m < S
        m_a = m_t[:, None] & m_s[None, :]

        # Σ over the later chunks, in blocks of BNC chunk totals: one pass, no subtraction.
        b_after = tl.load(dphi_t + i_bh * S + o_m, mask=m_s, other=0.0)
        p_c = dphi_c + i_bh * NC * BN2
        for j0 in range(i_c + 1, NC, BNC):
            o_jc = j0 + o_j
            b_c = tl.load(p_c + o_jc[:, None] * BN2 + o_m[None, :], mask=(o_jc < NC)[:, None],
                          other=0.0)  # fmt: skip
            b_after += tl.sum(b_c, axis=0)

        p_d = dphi + (i_b * T * H + i_h) * S + o_tc[:, None] * (H * S) + o_m[None, :]
        b_dphi = tl.load(p_d, mask=m_a, other=0.0)
        b_rc = b_after[None, :] + tl.cumsum(b_dphi, axis=0, reverse=True)
        if i_c == 0:
            tl.store(dphi0 + i_bh * S + o_m, tl.sum(tl.where(o_t[:, None] == 0, b_rc, 0.0), 0),
                     mask=m_s)  # fmt: skip
        o_s = i_bh * T
        b_dt = tl.load(dt + o_s + o_tc, mask=m_t, other=0.0)
        p_a = angles + i_b * s_ab + i_h * s_ah
        b_th = tanh(tl.load(p_a + o_tc[:, None] * s_at + o_m[None, :] * s_as, mask=m_a, other=0.0))
        tl.store(p_d, b_rc * b_dt[:, None] * PI * (1.0 - b_th * b_th), mask=m_a)
        b_ddt = PI * tl.sum(tl.where(m_a, b_rc * b_th, 0.0), axis=1)

        b_lam = sigmoid(tl.load(trap + o_s + o_tc, mask=m_t, other=0.0))
        b_dw = tl.load(dw + o_s + o_tc, mask=m_t, other=0.0)
        b_dcur = tl.load(dcur + o_s + o_tc, mask=m_t, other=0.0)
        b_dwp = tl.load(dw + o_s + o_tc - 1, mask=m_t & (o_tc > 0), other=0.0)
        b_ddt += b_lam * (b_dw + b_dcur) + (1.0 - b_lam) * b_dwp
        tl.store(ddt + o_s + o_tc, b_ddt, mask=m_t)
        b_dtrap = b_dt * (b_dw + b_dcur - b_dwp) * b_lam * (1.0 - b_lam)
        tl.store(dtrap + o_s + o_tc, b_dtrap, mask=m_t)


def siso_bwd(q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, seg, g_in, phi_in,
             dy, dg_t, dphi_t, chunk_size, cfgs: dict[str, LaunchConfig]):  # fmt: skip
    """Launch the kernels. Returns the gradients of every input of the forward kernel:
    dq, dk (b, t, g, n) in the dot dtype, dv, dz, dadt, ddt, dtrap, dq_bias, dk_bias, dangles,
    dd (h,), dphi0 (b, h, s), dg0 (b, h, p, n)."""
    b, t, g, n = q.shape
    h, p = v.shape[2], v.shape[3]
    s = angles.shape[3]
    hpg = h // g
    tiles = Tiles.of(p, n, chunk_size)
    BT, BP, BN2 = tiles.BT, tiles.BP, tiles.BN2
    nc = triton.cdiv(t, BT)
    dev = v.device
    f32 = dict(dtype=torch.float32, device=dev)
    a_strides = (angles.stride(0), angles.stride(1), angles.stride(2), angles.stride(3))
    zz = z if z is not None else v
    z_strides = (zz.stride(0), zz.stride(1), zz.stride(2))

    # 1. dG_out per chunk, in blocks of bv rows of p (16 at least: a dot's smallest side).
    bv = max(16, min(cfgs["bwd_dstate"].bv or BP, BP))
    nv = triton.cdiv(BP, bv)
    dg_out = torch.empty_like(g_in)
    dg0 = torch.empty(b, h, p, n, **f32)
    seg_ = seg if seg is not None else trap  # never read without HAS_RESET
    args = (q, adt, dt, trap, q_bias, angles, phi_in, zz, dy,
            dg_t if dg_t is not None else dg0, seg_, dg_out, dg0,
            t, nc, h, hpg, p, n, s, *z_strides, *a_strides)  # fmt: skip
    flags = dict(BT=BT, BP=BP, BV=bv, BN2=BN2, HAS_Z=z is not None, HAS_DGT=dg_t is not None,
                 HAS_RESET=seg is not None)  # fmt: skip
    launch("bwd_dstate", siso_bwd_dstate_kernel, (nv, b * h), args, flags, cfgs["bwd_dstate"])

    # 2. Every chunk's gradients: a program takes a (chunk, batch, head), or under the plan's
    # cpp and hpp a run of cpp chunks of a block of hpp heads (the largest divisor of a group's
    # heads up to the plan's hpp). dq, dk per head, or per block of heads (their fp32 sum), in
    # the dot dtype: the autograd Function returns them in it, and for grouped q, k what is left
    # of a group's sum is summed in fp32 from values rounded once each (half the bytes of fp32
    # partials, written here and read by the sum).
    want = min(cfgs["bwd_chunk"].hpp, hpg)
    hpp = max(j for j in range(1, want + 1) if hpg % j == 0)
    dq = torch.empty(b, t, h // hpp, n, dtype=v.dtype, device=dev)
    dk = torch.empty(b, t, h // hpp, n, dtype=v.dtype, device=dev)
    dv = torch.empty(b, t, h, p, dtype=v.dtype, device=dev)
    dz = torch.empty(b, t, h, p, dtype=z.dtype, device=dev) if z is not None else None
    dadt, dw, dcur = (torch.empty(b, h, t, **f32) for _ in range(3))
    dd = torch.empty(b, nc, h, **f32)
    dqb = torch.empty(b, nc, h, n, **f32)
    dkb = torch.empty(b, nc, h, n, **f32)
    dangles = torch.empty(b, t, h, s, **f32)
    dphi_c = torch.empty(b * h, nc, BN2, **f32)
    args = (
        q, k, v, zz, adt, dt, trap, q_bias, k_bias, angles, d if d is not None else q_bias,
        phi_in, g_in, dg_out, dy, seg_,
        dq, dk, dv, dz if dz is not None else dv, dadt, dw, dcur, dd, dqb, dkb, dangles, dphi_c,
        t, nc, h, hpg, p, n, s, v.stride(0), v.stride(1), v.stride(2), *z_strides, *a_strides,
    )  # fmt: skip
    cpp = cfgs["bwd_chunk"].cpp
    flags = dict(BT=BT, BP=BP, BN2=BN2, HPP=hpp, CPP=cpp, HAS_D=d is not None,
                 HAS_Z=z is not None, HAS_RESET=seg is not None)  # fmt: skip
    grid = (triton.cdiv(nc, cpp), b * h // hpp)
    launch("bwd_chunk", siso_bwd_chunk_kernel, grid, args, flags, cfgs["bwd_chunk"])
    del dg_out
    if hpg > hpp:
        dq, dk = head_sums(dq, dk, g)

    # 3. The angle gradients and the trapezoid chain rule, chunk by chunk.
    ddt, dtrap = torch.empty(b, h, t, **f32), torch.empty(b, h, t, **f32)
    dphi0 = torch.empty(b, h, s, **f32)
    args = (dt, trap, angles, dangles, dphi_c, dphi_t, dw, dcur, ddt, dtrap, dphi0, t, nc, h, s,
            *a_strides)  # fmt: skip
    flags = dict(BT=BT, BN2=BN2, BNC=min(64, triton.next_power_of_2(nc)))
    launch("bwd_angle", siso_bwd_angle_kernel, (nc, b * h), args, flags, cfgs["bwd_angle"])
    dq_bias, dk_bias, dd_h = param_sums(dqb, dkb, dd if d is not None else None)
    return (dq, dk, dv, dz, dadt, ddt, dtrap, dq_bias, dk_bias, dangles, dd_h, dphi0,
            dg0)  # fmt: skip
