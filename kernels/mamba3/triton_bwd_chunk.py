"""The backward's chunk-parallel kernel (kernel 2 of :mod:`kernels.mamba3.triton_bwd`, whose
docstring gives its terms); its tile helpers are :mod:`kernels.mamba3.triton_bwd_tiles`.

A program's work on one chunk of one head is :func:`_chunk_head`, in one pass over the value
dimension p; :func:`_chunk_head_halves`, the same pass with q̄, k̄, the states and their
gradients held as two halves of n where the angles turn half the pairs (the rotation and its
way back then move no data between threads); or, under the plan's ``bv``,
:func:`_chunk_head_pb`, in three passes over blocks of p that hold no (chunk × p) tile and no
(p × n) state whole: fewer live registers for some more instructions and cache-hit reloads. A
program may take several heads of a group (``hpp``) and several chunks (``cpp``) in turn.
"""

from __future__ import annotations

from .triton_bwd_tiles import (
    angle_grads,
    decay_grads,
    decays,
    gate,
    half_tiles,
    halves_out,
    offsets,
    pin,
    rotated_back_out,
    rotated_qk,
    score_grads,
    state_dot,
    state_half,
)
from .triton_common import (
    chunk_phase,
    decay_weights,
    dot_t,
    load_dense,
    load_tile,
    store_tile,
    tile_ptr,
    tl,
    to_dot,
    triton,
)

if triton is not None:

    @triton.jit
    def _chunk_head(
        q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, phi_in, g_in, dg_out, dy, seg,
        dq, dk, dv, dz, dadt, dw, dcur, dd, dqb, dkb, dphi, dphi_c, acc_q, acc_k, i_c, i_b, i_h,
        T, NC, H, HPG, P, N, S, s_vb, s_vt, s_vh, s_zb, s_zt, s_zh, s_ob, s_ot, s_ab, s_at, s_ah,
        s_as,
        BT: tl.constexpr, BP: tl.constexpr, BN2: tl.constexpr, BR: tl.constexpr,
        HPP: tl.constexpr,
        HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_RESET: tl.constexpr, WG: tl.constexpr,
        DENSE: tl.constexpr,
    ):  # fmt: skip
        """Chunk i_c of head i_h of batch i_b: every gradient written, but with HPP > 1 dq and
        dk, which are added to the (BT × 2·BN2, fp32) ``acc_q``, ``acc_k`` and returned. With
        HPP = 1 each is stored as soon as it is formed, so it holds no registers after. The gated
        ``do`` and the gate's slope are pinned (:func:`pin`): left to the compiler, the gate was
        recomputed from dy and z in each layout ``do`` is used in, for every warp."""
        o_tc, m_t, r0, o_s, o_p, o_out, o_b, o_gc = offsets(i_c, i_b, i_h, T, NC, H, P, N, BT,
                                                            BP, BN2, DENSE)  # fmt: skip
        b_dt, b_cur, b_w, b_A2, b_AL2, b_eA, b_eL, b_ew, m_low, m_diag, keep = decays(
            adt, dt, trap, seg, o_s, o_tc, m_t, i_b, T, NC, BT, HAS_RESET
        )
        b_x = load_tile(tile_ptr(v + i_b * s_vb + i_h * s_vh, T, P, s_vt, r0, BT, BP, DENSE))
        DT = v.dtype.element_ty
        b_cos, b_sin, b_qc, b_kc = rotated_qk(q, k, q_bias, k_bias, angles, phi_in, b_dt, o_tc,
                                              m_t, i_c, i_b, i_h, T, NC, H, HPG, N, S, s_ab,
                                              s_at, s_ah, s_as, DT, BT, BN2, BR,
                                              DENSE)  # fmt: skip
        o_o = i_b * s_ob + i_h * P  # dv, dz
        b_do, b_gz = gate(dy + o_p, z + i_b * s_zb + i_h * s_zh, H * P, s_zt, T, P, r0, BT, BP,
                          HAS_Z, DENSE)  # fmt: skip
        if HAS_Z:
            b_do, b_gz = pin(b_do), pin(b_gz)
        b_doc = to_dot(b_do, DT)

        # Scores S = q̄k̄ᵀ, M = S ⊙ decay ⊙ W, dM = do xᵀ (see score_grads).
        b_Dw = decay_weights(b_A2, b_w, b_cur, m_low, m_diag)
        b_S = tl.dot(b_qc, tl.trans(b_kc))
        b_Mc = to_dot(b_S * b_Dw, DT)
        b_dA, b_dw, b_dSc = score_grads(b_S, tl.dot(b_doc, tl.trans(b_x)), b_Dw, b_w, m_low,
                                        m_diag, dd + (i_b * NC + i_c) * H + i_h,
                                        dcur + o_s + o_tc, m_t, DT)  # fmt: skip

        # The entering state G_in: the inter-chunk output exp(A_i)·G_in q̄_i (its decay
        # gradient and, with z, the pre-gate output) and dq̄ = dS k̄ + exp(A) ⊙ do G_in,
        # rotated back at once (da = Rᵀ dā; dΦ = ā_E dā_O − ā_O dā_E).
        b_Gc = load_dense(g_in + o_gc, 0, BP, 2 * BN2)
        b_qG = dot_t(b_qc, tl.trans(b_Gc), WG)
        b_dA += b_eA * tl.sum(b_doc.to(tl.float32) * b_qG, axis=1)
        if HAS_Z:  # dz first: the gate's slope and q̄G_inᵀ die before dq̄ is formed
            b_o = tl.dot(b_Mc, b_x) + b_eA[:, None] * b_qG
            if HAS_D:
                b_o += tl.load(d + i_h).to(tl.float32) * b_x.to(tl.float32)
            store_tile(tile_ptr(dz + o_o, T, P, s_ot, r0, BT, BP, DENSE), b_gz * b_o)
        b_dqr = tl.dot(b_dSc, b_kc) + b_eA[:, None] * dot_t(b_doc, b_Gc, WG)
        acc_q, b_dphi = rotated_back_out(
            b_dqr, b_qc, b_cos, b_sin, acc_q, dq + o_out, dqb, o_b, T, N, H * N, r0, BT,
            BN2, BR, HPP, DENSE,
        )  # fmt: skip

        # The leaving state's gradient dG_out: dx = Mᵀ do + exp(A_L − A) w ⊙ (k̄ dGᵀ) + D do,
        # dk̄ = dSᵀ q̄ + exp(A_L − A) w ⊙ (x dG), rotated back like dq̄.
        b_dGc = load_dense(dg_out + o_gc, 0, BP, 2 * BN2)
        b_u = dot_t(b_kc, tl.trans(b_dGc), WG)
        b_xu = tl.sum(b_x.to(tl.float32) * b_u, axis=1)  # x_jᵀ dG k̄_j
        b_dx = tl.dot(tl.trans(b_Mc), b_doc) + b_ew[:, None] * b_u
        if HAS_D:
            b_dx += tl.load(d + i_h).to(tl.float32) * b_doc.to(tl.float32)
        store_tile(tile_ptr(dv + o_o, T, P, s_ot, r0, BT, BP, DENSE), b_dx)
        b_dkr = tl.dot(tl.trans(b_dSc), b_qc) + b_ew[:, None] * dot_t(b_x, b_dGc, WG)
        acc_k, b_dphik = rotated_back_out(
            b_dkr, b_kc, b_cos, b_sin, acc_k, dk + o_out, dkb, o_b, T, N, H * N, r0, BT,
            BN2, BR, HPP, DENSE,
        )  # fmt: skip

        angle_grads(b_dphi, b_dphik, dphi, dphi_c, o_tc, m_t, i_c, i_b, i_h, T, NC, H, S, BR,
                    DENSE)  # fmt: skip
        # <dG_out, G_in> for ∂/∂A_L: both states are read again here (cache hits) rather than
        # held.
        decay_grads(b_dA, b_dw, b_xu, state_dot(g_in + o_gc, dg_out + o_gc, BP, BN2), b_AL2,
                    keep, b_eL, b_ew, dadt + o_s + o_tc, dw + o_s + o_tc, m_t, BT,
                    HAS_RESET)  # fmt: skip
        return acc_q, acc_k

    @triton.jit
    def _chunk_head_pb(
        q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, phi_in, g_in, dg_out, dy, seg,
        dq, dk, dv, dz, dadt, dw, dcur, dd, dqb, dkb, dphi, dphi_c, acc_q, acc_k, i_c, i_b, i_h,
        T, NC, H, HPG, P, N, S, s_vb, s_vt, s_vh, s_zb, s_zt, s_zh, s_ob, s_ot, s_ab, s_at, s_ah,
        s_as,
        BT: tl.constexpr, BP: tl.constexpr, BN2: tl.constexpr, BR: tl.constexpr,
        HPP: tl.constexpr,
        HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_RESET: tl.constexpr, BV: tl.constexpr,
        DENSE: tl.constexpr,
    ):  # fmt: skip
        """:func:`_chunk_head` with p in blocks of BV columns (the plan's ``bv``), in three
        passes over them: ``dM = do xᵀ`` summed over the blocks; then, block by block, what the
        entering state gives (dz, the ``do G_in`` term of dq̄, the inter-chunk decay gradient);
        then what the leaving state gives (dv, the ``x dG`` term of dk̄, ``<dG_out, G_in>``).
        The blocks of x, dy and z are loaded and gated again in each pass (cache hits), so no
        (BT × BP) tile and no (BP × N) state is held whole: fewer registers than one pass."""
        o_tc, m_t, r0, o_s, o_p, o_out, o_b, o_gc = offsets(i_c, i_b, i_h, T, NC, H, P, N, BT,
                                                            BP, BN2, DENSE)  # fmt: skip
        p_v = v + i_b * s_vb + i_h * s_vh
        p_z = z + i_b * s_zb + i_h * s_zh
        o_o = i_b * s_ob + i_h * P  # dv, dz
        b_dt, b_cur, b_w, b_A2, b_AL2, b_eA, b_eL, b_ew, m_low, m_diag, keep = decays(
            adt, dt, trap, seg, o_s, o_tc, m_t, i_b, T, NC, BT, HAS_RESET
        )
        DT = v.dtype.element_ty
        b_cos, b_sin, b_qc, b_kc = rotated_qk(q, k, q_bias, k_bias, angles, phi_in, b_dt, o_tc,
                                              m_t, i_c, i_b, i_h, T, NC, H, HPG, N, S, s_ab,
                                              s_at, s_ah, s_as, DT, BT, BN2, BR,
                                              DENSE)  # fmt: skip

        # Pass 1: dM = do xᵀ, over the blocks of p.
        b_dM = tl.zeros([BT, BT], dtype=tl.float32)
        for v0 in range(0, BP, BV):
            b_x = load_tile(tile_ptr(p_v + v0, T, P - v0, s_vt, r0, BT, BV, DENSE))
            b_do = gate(dy + o_p + v0, p_z + v0, H * P, s_zt, T, P - v0, r0, BT, BV, HAS_Z,
                        DENSE)[0]  # fmt: skip
            b_dM += tl.dot(to_dot(b_do, DT), tl.trans(b_x))
        b_Dw = decay_weights(b_A2, b_w, b_cur, m_low, m_diag)
        b_S = tl.dot(b_qc, tl.trans(b_kc))
        b_Mc = to_dot(b_S * b_Dw, DT)
        b_dA, b_dw, b_dSc = score_grads(b_S, b_dM, b_Dw, b_w, m_low, m_diag,
                                        dd + (i_b * NC + i_c) * H + i_h, dcur + o_s + o_tc,
                                        m_t, DT)  # fmt: skip

        # Pass 2: the entering state G_in, block by block: the inter-chunk output (its decay
        # gradient and, with z, the pre-gate output) and dq̄'s exp(A) ⊙ do G_in.
        b_doG = tl.zeros([BT, 2 * BN2], dtype=tl.float32)
        for v0 in range(0, BP, BV):
            b_x = load_tile(tile_ptr(p_v + v0, T, P - v0, s_vt, r0, BT, BV, DENSE))
            b_do, b_gz = gate(dy + o_p + v0, p_z + v0, H * P, s_zt, T, P - v0, r0, BT, BV,
                              HAS_Z, DENSE)  # fmt: skip
            if HAS_Z:
                b_do, b_gz = pin(b_do), pin(b_gz)
            b_doc = to_dot(b_do, DT)
            b_Gc = load_dense(g_in + o_gc, v0, BV, 2 * BN2)
            b_qG = tl.dot(b_qc, tl.trans(b_Gc))
            b_dA += b_eA * tl.sum(b_doc.to(tl.float32) * b_qG, axis=1)
            if HAS_Z:
                b_o = tl.dot(b_Mc, b_x) + b_eA[:, None] * b_qG
                if HAS_D:
                    b_o += tl.load(d + i_h).to(tl.float32) * b_x.to(tl.float32)
                store_tile(tile_ptr(dz + o_o + v0, T, P - v0, s_ot, r0, BT, BV, DENSE), b_gz * b_o)
            b_doG += tl.dot(b_doc, b_Gc)
        b_dqr = tl.dot(b_dSc, b_kc) + b_eA[:, None] * b_doG
        acc_q, b_dphi = rotated_back_out(
            b_dqr, b_qc, b_cos, b_sin, acc_q, dq + o_out, dqb, o_b, T, N, H * N, r0, BT,
            BN2, BR, HPP, DENSE,
        )  # fmt: skip

        # Pass 3: the leaving state's gradient dG_out, block by block: dx = Mᵀ do +
        # exp(A_L − A) w ⊙ (k̄ dGᵀ) + D do, dk̄'s exp(A_L − A) w ⊙ (x dG), and <dG_out, G_in>.
        b_xdG = tl.zeros([BT, 2 * BN2], dtype=tl.float32)
        b_xu = tl.zeros([BT], dtype=tl.float32)  # x_jᵀ dG k̄_j
        b_GG = tl.zeros([BV], dtype=tl.float32)  # <dG_out, G_in>, by row of the block
        for v0 in range(0, BP, BV):
            b_x = load_tile(tile_ptr(p_v + v0, T, P - v0, s_vt, r0, BT, BV, DENSE))
            b_do = gate(dy + o_p + v0, p_z + v0, H * P, s_zt, T, P - v0, r0, BT, BV, HAS_Z,
                        DENSE)[0]  # fmt: skip
            if HAS_Z:
                b_do = pin(b_do)
            b_doc = to_dot(b_do, DT)
            b_dGc = load_dense(dg_out + o_gc, v0, BV, 2 * BN2)
            b_u = tl.dot(b_kc, tl.trans(b_dGc))
            b_xu += tl.sum(b_x.to(tl.float32) * b_u, axis=1)
            b_dx = tl.dot(tl.trans(b_Mc), b_doc) + b_ew[:, None] * b_u
            if HAS_D:
                b_dx += tl.load(d + i_h).to(tl.float32) * b_doc.to(tl.float32)
            store_tile(tile_ptr(dv + o_o + v0, T, P - v0, s_ot, r0, BT, BV, DENSE), b_dx)
            b_xdG += tl.dot(b_x, b_dGc)
            b_GG += tl.sum(load_dense(g_in + o_gc, v0, BV, 2 * BN2).to(tl.float32)
                           * b_dGc.to(tl.float32), axis=1)  # fmt: skip
        b_dkr = tl.dot(tl.trans(b_dSc), b_qc) + b_ew[:, None] * b_xdG
        acc_k, b_dphik = rotated_back_out(
            b_dkr, b_kc, b_cos, b_sin, acc_k, dk + o_out, dkb, o_b, T, N, H * N, r0, BT,
            BN2, BR, HPP, DENSE,
        )  # fmt: skip
        angle_grads(b_dphi, b_dphik, dphi, dphi_c, o_tc, m_t, i_c, i_b, i_h, T, NC, H, S, BR,
                    DENSE)  # fmt: skip
        decay_grads(b_dA, b_dw, b_xu, tl.sum(b_GG, axis=0), b_AL2, keep, b_eL,
                    b_ew, dadt + o_s + o_tc, dw + o_s + o_tc, m_t, BT, HAS_RESET)  # fmt: skip
        return acc_q, acc_k

    @triton.jit
    def _chunk_head_halves(
        q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, phi_in, g_in, dg_out, dy, seg,
        dq, dk, dv, dz, dadt, dw, dcur, dd, dqb, dkb, dphi, dphi_c, i_c, i_b, i_h,
        T, NC, H, HPG, P, N, S, s_vb, s_vt, s_vh, s_zb, s_zt, s_zh, s_ob, s_ot, s_ab, s_at, s_ah,
        s_as,
        BT: tl.constexpr, BP: tl.constexpr, BN2: tl.constexpr, BR: tl.constexpr,
        HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_RESET: tl.constexpr, WG: tl.constexpr,
        DENSE: tl.constexpr,
    ):  # fmt: skip
        """:func:`_chunk_head` (one head a program) where the angles turn half the state's pairs
        (BR = BN2 / 2): q̄, k̄, the states and the q̄, k̄ gradients held as two halves of n, the
        rotated one and the rest, each product over n as two. No tile is split or joined across
        the halves, so the rotation and its way back move no data between threads."""
        o_tc, m_t, r0, o_s, o_p, o_out, o_b, o_gc = offsets(i_c, i_b, i_h, T, NC, H, P, N, BT,
                                                            BP, BN2, DENSE)  # fmt: skip
        b_dt, b_cur, b_w, b_A2, b_AL2, b_eA, b_eL, b_ew, m_low, m_diag, keep = decays(
            adt, dt, trap, seg, o_s, o_tc, m_t, i_b, T, NC, BT, HAS_RESET
        )
        b_x = load_tile(tile_ptr(v + i_b * s_vb + i_h * s_vh, T, P, s_vt, r0, BT, BP, DENSE))
        DT = v.dtype.element_ty
        G = H // HPG
        o_qk = (i_b * T * G + i_h // HPG) * N
        b_phi0 = tl.load(phi_in + ((i_b * H + i_h) * NC + i_c) * BR + tl.arange(0, BR))
        b_cos, b_sin, _ = chunk_phase(angles + i_b * s_ab + i_h * s_ah, s_at, s_as, b_dt, b_phi0,
                                      o_tc, m_t, S, BR, DENSE)  # fmt: skip
        b_q1, b_q2 = half_tiles(q + o_qk, q_bias + i_h * N, b_cos, b_sin, T, N, G * N, r0, DT,
                                BT, BR, DENSE)  # fmt: skip
        b_k1, b_k2 = half_tiles(k + o_qk, k_bias + i_h * N, b_cos, b_sin, T, N, G * N, r0, DT,
                                BT, BR, DENSE)  # fmt: skip
        o_o = i_b * s_ob + i_h * P  # dv, dz
        b_do, b_gz = gate(dy + o_p, z + i_b * s_zb + i_h * s_zh, H * P, s_zt, T, P, r0, BT, BP,
                          HAS_Z, DENSE)  # fmt: skip
        if HAS_Z:
            b_do, b_gz = pin(b_do), pin(b_gz)
        b_doc = to_dot(b_do, DT)

        # Scores, as in _chunk_head, over the two halves of n.
        b_Dw = decay_weights(b_A2, b_w, b_cur, m_low, m_diag)
        b_S = tl.dot(b_q2, tl.trans(b_k2), tl.dot(b_q1, tl.trans(b_k1)))
        if HAS_D:
            b_Mc = to_dot(b_S * b_Dw + tl.where(m_diag, tl.load(d + i_h).to(tl.float32), 0.0), DT)
        else:
            b_Mc = to_dot(b_S * b_Dw, DT)
        b_dA, b_dw, b_dSc = score_grads(b_S, tl.dot(b_doc, tl.trans(b_x)), b_Dw, b_w, m_low,
                                        m_diag, dd + (i_b * NC + i_c) * H + i_h,
                                        dcur + o_s + o_tc, m_t, DT)  # fmt: skip

        # The entering state G_in, its halves of n.
        b_G1 = state_half(g_in + o_gc, 0, BP, BN2, BR)
        b_G2 = state_half(g_in + o_gc, 2 * BR, BP, BN2, BR)
        b_qG = dot_t(b_q1, tl.trans(b_G1), WG) + dot_t(b_q2, tl.trans(b_G2), WG)
        b_dA += b_eA * tl.sum(b_doc.to(tl.float32) * b_qG, axis=1)
        if HAS_Z:
            b_o = tl.dot(b_Mc, b_x) + b_eA[:, None] * b_qG
            store_tile(tile_ptr(dz + o_o, T, P, s_ot, r0, BT, BP, DENSE), b_gz * b_o)
        b_dq1 = tl.dot(b_dSc, b_k1) + b_eA[:, None] * dot_t(b_doc, b_G1, WG)
        b_dq2 = tl.dot(b_dSc, b_k2) + b_eA[:, None] * dot_t(b_doc, b_G2, WG)
        b_dphi = halves_out(b_dq1, b_dq2, b_q1, b_cos, b_sin, dq + o_out, dqb, o_b, T, N, H * N,
                            r0, BT, BR, DENSE)  # fmt: skip

        # The leaving state's gradient dG_out, its halves of n.
        b_dG1 = state_half(dg_out + o_gc, 0, BP, BN2, BR)
        b_dG2 = state_half(dg_out + o_gc, 2 * BR, BP, BN2, BR)
        b_u = dot_t(b_k1, tl.trans(b_dG1), WG) + dot_t(b_k2, tl.trans(b_dG2), WG)
        b_xu = tl.sum(b_x.to(tl.float32) * b_u, axis=1)  # x_jᵀ dG k̄_j
        b_dx = tl.dot(tl.trans(b_Mc), b_doc) + b_ew[:, None] * b_u
        store_tile(tile_ptr(dv + o_o, T, P, s_ot, r0, BT, BP, DENSE), b_dx)
        b_dk1 = tl.dot(tl.trans(b_dSc), b_q1) + b_ew[:, None] * dot_t(b_x, b_dG1, WG)
        b_dk2 = tl.dot(tl.trans(b_dSc), b_q2) + b_ew[:, None] * dot_t(b_x, b_dG2, WG)
        b_dphik = halves_out(b_dk1, b_dk2, b_k1, b_cos, b_sin, dk + o_out, dkb, o_b, T, N,
                             H * N, r0, BT, BR, DENSE)  # fmt: skip

        angle_grads(b_dphi, b_dphik, dphi, dphi_c, o_tc, m_t, i_c, i_b, i_h, T, NC, H, S, BR,
                    DENSE)  # fmt: skip
        decay_grads(b_dA, b_dw, b_xu, state_dot(g_in + o_gc, dg_out + o_gc, BP, BN2), b_AL2,
                    keep, b_eL, b_ew, dadt + o_s + o_tc, dw + o_s + o_tc, m_t, BT,
                    HAS_RESET)  # fmt: skip

    @triton.jit
    def _head(
        q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, phi_in, g_in, dg_out, dy, seg,
        dq, dk, dv, dz, dadt, dw, dcur, dd, dqb, dkb, dphi, dphi_c, acc_q, acc_k, i_c, i_b, i_h,
        T, NC, H, HPG, P, N, S, s_vb, s_vt, s_vh, s_zb, s_zt, s_zh, s_ob, s_ot, s_ab, s_at, s_ah,
        s_as,
        BT: tl.constexpr, BP: tl.constexpr, BN2: tl.constexpr, BR: tl.constexpr,
        HPP: tl.constexpr,
        HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_RESET: tl.constexpr, BV: tl.constexpr,
        WG: tl.constexpr, HALVES: tl.constexpr, DENSE: tl.constexpr,
    ):  # fmt: skip
        """One chunk of one head: in one pass (BV = BP), as halves of n where the angles turn
        half the pairs and the program takes one head, or over blocks of p."""
        if HALVES and BV == BP and HPP == 1 and 2 * BR == BN2:
            _chunk_head_halves(
                q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, phi_in, g_in, dg_out, dy,
                seg, dq, dk, dv, dz, dadt, dw, dcur, dd, dqb, dkb, dphi, dphi_c, i_c, i_b, i_h,
                T, NC, H, HPG, P, N, S, s_vb, s_vt, s_vh, s_zb, s_zt, s_zh, s_ob, s_ot, s_ab,
                s_at, s_ah, s_as, BT, BP, BN2, BR, HAS_D, HAS_Z, HAS_RESET, WG, DENSE,
            )  # fmt: skip
        elif BV == BP:
            acc_q, acc_k = _chunk_head(
                q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, phi_in, g_in, dg_out, dy,
                seg, dq, dk, dv, dz, dadt, dw, dcur, dd, dqb, dkb, dphi, dphi_c, acc_q, acc_k,
                i_c, i_b, i_h, T, NC, H, HPG, P, N, S, s_vb, s_vt, s_vh, s_zb, s_zt, s_zh, s_ob,
                s_ot, s_ab,
                s_at, s_ah, s_as, BT, BP, BN2, BR, HPP, HAS_D, HAS_Z, HAS_RESET, WG, DENSE,
            )  # fmt: skip
        else:
            acc_q, acc_k = _chunk_head_pb(
                q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, phi_in, g_in, dg_out, dy,
                seg, dq, dk, dv, dz, dadt, dw, dcur, dd, dqb, dkb, dphi, dphi_c, acc_q, acc_k,
                i_c, i_b, i_h, T, NC, H, HPG, P, N, S, s_vb, s_vt, s_vh, s_zb, s_zt, s_zh, s_ob,
                s_ot, s_ab,
                s_at, s_ah, s_as, BT, BP, BN2, BR, HPP, HAS_D, HAS_Z, HAS_RESET, BV, DENSE,
            )  # fmt: skip
        return acc_q, acc_k

    @triton.jit
    def _chunk_block(
        q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, phi_in, g_in, dg_out, dy, seg,
        dq, dk, dv, dz, dadt, dw, dcur, dd, dqb, dkb, dphi, dphi_c, i_c, i_b, i_blk,
        T, NC, H, HPG, P, N, S, s_vb, s_vt, s_vh, s_zb, s_zt, s_zh, s_ob, s_ot, s_ab, s_at, s_ah,
        s_as,
        BT: tl.constexpr, BP: tl.constexpr, BN2: tl.constexpr, BR: tl.constexpr,
        HPP: tl.constexpr,
        HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_RESET: tl.constexpr, BV: tl.constexpr,
        WG: tl.constexpr, HALVES: tl.constexpr, DENSE: tl.constexpr,
    ):  # fmt: skip
        """Chunk i_c of the HPP heads of block i_blk of batch i_b: their gradients, dq and dk
        summed over the block."""
        if HPP == 1:
            _head(
                q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, phi_in, g_in, dg_out, dy,
                seg, dq, dk, dv, dz, dadt, dw, dcur, dd, dqb, dkb, dphi, dphi_c, 0.0, 0.0, i_c,
                i_b, i_blk, T, NC, H, HPG, P, N, S, s_vb, s_vt, s_vh, s_zb, s_zt, s_zh, s_ob, s_ot,
                s_ab, s_at, s_ah, s_as, BT, BP, BN2, BR, HPP, HAS_D, HAS_Z, HAS_RESET, BV, WG,
                HALVES, DENSE,
            )  # fmt: skip
        else:
            NB = H // HPP
            b_dq = tl.zeros([BT, 2 * BN2], dtype=tl.float32)
            b_dk = tl.zeros([BT, 2 * BN2], dtype=tl.float32)
            for j in range(HPP):
                b_dq, b_dk = _head(
                    q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, phi_in, g_in, dg_out,
                    dy, seg, dq, dk, dv, dz, dadt, dw, dcur, dd, dqb, dkb, dphi, dphi_c, b_dq,
                    b_dk, i_c, i_b, i_blk * HPP + j, T, NC, H, HPG, P, N, S, s_vb, s_vt, s_vh,
                    s_zb, s_zt, s_zh, s_ob, s_ot, s_ab, s_at, s_ah, s_as, BT, BP, BN2, BR, HPP,
                    HAS_D, HAS_Z,
                    HAS_RESET, BV, WG, HALVES, DENSE,
                )  # fmt: skip
            o_out = (i_b * T * NB + i_blk) * N
            r0 = i_c * BT
            store_tile(tile_ptr(dq + o_out, T, N, NB * N, r0, BT, 2 * BN2, DENSE), b_dq)
            store_tile(tile_ptr(dk + o_out, T, N, NB * N, r0, BT, 2 * BN2, DENSE), b_dk)

    @triton.jit(do_not_specialize=["T", "NC"])
    def siso_bwd_chunk_kernel(
        q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, phi_in, g_in, dg_out, dy, seg,
        dq, dk, dv, dz, dadt, dw, dcur, dd, dqb, dkb, dphi, dphi_c,
        T, NC, H, HPG, P, N, S, s_vb, s_vt, s_vh, s_zb, s_zt, s_zh, s_ob, s_ot, s_ab, s_at, s_ah,
        s_as,
        BT: tl.constexpr, BP: tl.constexpr, BN2: tl.constexpr, BR: tl.constexpr,
        HPP: tl.constexpr,
        CPP: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_RESET: tl.constexpr,
        BV: tl.constexpr, WG: tl.constexpr, HALVES: tl.constexpr, DENSE: tl.constexpr,
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
                i_blk, T, NC, H, HPG, P, N, S, s_vb, s_vt, s_vh, s_zb, s_zt, s_zh, s_ob, s_ot,
                s_ab, s_at,
                s_ah, s_as, BT, BP, BN2, BR, HPP, HAS_D, HAS_Z, HAS_RESET, BV, WG, HALVES,
                DENSE,
            )  # fmt: skip
        else:
            for i_c in range(i_cb * CPP, tl.minimum(NC, i_cb * CPP + CPP)):
                _chunk_block(
                    q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, phi_in, g_in, dg_out,
                    dy, seg, dq, dk, dv, dz, dadt, dw, dcur, dd, dqb, dkb, dphi, dphi_c, i_c,
                    i_b, i_blk, T, NC, H, HPG, P, N, S, s_vb, s_vt, s_vh, s_zb, s_zt, s_zh, s_ob,
                    s_ot, s_ab,
                    s_at, s_ah, s_as, BT, BP, BN2, BR, HPP, HAS_D, HAS_Z, HAS_RESET, BV, WG,
                    HALVES, DENSE,
                )  # fmt: skip
