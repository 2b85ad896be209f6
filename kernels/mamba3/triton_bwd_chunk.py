"""The backward's chunk-parallel kernel (kernel 2 of :mod:`m3run.kernels.mamba3.triton_bwd`, whose
docstring gives its terms), and the tile helpers it shares with the state kernel: q̄, k̄ rotated
as the forward rotates them, and the gated ``do`` with the gate's slope.

A program's work on one chunk of one head is :func:`_chunk_head`, in one pass over the value
dimension p, or, under the plan's ``bv``, :func:`_chunk_head_pb`, in three passes over blocks of
p that hold no (chunk × p) tile and no (p × n) state whole: fewer live registers for some more
instructions and cache-hit reloads. A program may take several heads of a group (``hpp``) and
several chunks (``cpp``) in turn.
"""

from __future__ import annotations

from .triton_common import (
    chunk_phase,
    chunk_scalars,
    decay_weights,
    dot_t,
    halves,
    interpreting,
    load_dense,
    load_tile,
    rotate,
    segments,
    sigmoid,
    store_tile,
    tile_ptr,
    tl,
    to_dot,
    triton,
    unhalves,
)

if triton is not None:
    if interpreting():

        @triton.jit
        def pin(x):
            return x

    else:

        @triton.jit
        def pin(x):
            """x (fp32) through an opaque copy, so it is computed once, where it is written: the
            compiler would otherwise recompute a value used in several register layouts (a dot
            operand, an elementwise term) from its loads in each of them, for every warp. The
            rotated q̄, k̄ are pinned: it shortens the chunk kernel."""
            return tl.inline_asm_elementwise(
                "mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=False, pack=1
            )

    @triton.jit
    def rotated_tile(p_x, b_bias, b_cos, b_sin, DT: tl.constexpr, BT: tl.constexpr,
                     BN2: tl.constexpr, BR: tl.constexpr):
        """R(Φ)(x + bias) of a loaded (BT × 2·BN2) tile, its first BR pairs turned, as a dot
        operand of dtype DT: the same operations, in the same order, as the forward's rotation,
        so the same values; pinned, so every use of the tile (the score and state dots, the
        angle gradient) sees one value."""
        b_x = load_tile(p_x).to(tl.float32) + b_bias[None, :]
        return to_dot(pin(rotate(b_x, b_cos, b_sin, BT, BN2, BR)), DT)

    @triton.jit
    def _rotate_back(b_g, b_r, b_cos, b_sin, BT: tl.constexpr, BN2: tl.constexpr,
                     BR: tl.constexpr):
        """For the gradient ``b_g`` (fp32, BT × 2·BN2) of a rotated tile ā = ``b_r`` (dot
        dtype), in natural column order: Rᵀ b_g (the first BR pairs turned back, the rest as
        they are) and the angle gradient of each of those pairs, ā_E g_O − ā_O g_E."""
        if BR == BN2:
            b_g1, b_r1 = b_g, b_r.to(tl.float32)
        else:
            b_g1, b_g2 = halves(b_g, BT, BN2)
            b_r1 = halves(b_r.to(tl.float32), BT, BN2)[0]
        b_gE, b_gO = tl.split(tl.reshape(b_g1, (BT, BR, 2)))
        b_rE, b_rO = tl.split(tl.reshape(b_r1, (BT, BR, 2)))
        b_d = tl.join(b_gE * b_cos + b_gO * b_sin, b_gO * b_cos - b_gE * b_sin)
        b_d = tl.reshape(b_d, (BT, 2 * BR))
        if BR != BN2:
            b_d = unhalves(b_d, b_g2, BT, BN2)
        return b_d, b_rE * b_gO - b_rO * b_gE

    @triton.jit
    def gate(dy, z, s_yt, s_zt, T, P, r0, BT: tl.constexpr, BV: tl.constexpr,
              HAS_Z: tl.constexpr, DENSE: tl.constexpr):
        """For the (BT × BV) tiles at row r0 of dy and z (pointers at the tiles' first column, P
        columns from there), fp32: do = dy ⊙ silu(z), the gradient of the pre-gate output, and
        dy ⊙ silu'(z), which times the pre-gate output is dz (without z: dy, and dy again)."""
        b_dy = load_tile(tile_ptr(dy, T, P, s_yt, r0, BT, BV, DENSE)).to(tl.float32)
        if HAS_Z:
            b_z = load_tile(tile_ptr(z, T, P, s_zt, r0, BT, BV, DENSE)).to(tl.float32)
            b_sg = sigmoid(b_z)
            b_silu = b_z * b_sg  # silu'(z) = σ + silu(z)·(1 − σ): five operations, not six
            return b_dy * b_silu, b_dy * (b_sg + b_silu * (1.0 - b_sg))
        return b_dy, b_dy

    @triton.jit
    def _decays(adt, dt, trap, seg, o_s, o_tc, m_t, i_b, T, NC, BT: tl.constexpr,
                HAS_RESET: tl.constexpr):
        """One chunk's per-token scalars (``o_s`` offsets the (batch, head) row; ``o_tc``, ``m_t``
        the chunk's positions and their mask, :func:`_offsets`'): Δ, λΔ, w, the
        cumulative decay A and its last value A_L (log2), exp(A), exp(A_L − A), exp(A_L − A)·w,
        the masks of the pairs below the diagonal (in one segment) and on it, and whether the
        entering state survives the chunk (no reset in it). As in the forward, no decay crosses
        a reset. (exp(A_L) is :func:`_decay_grads`': formed here, it cost the chunk kernel 120 B
        of spills.)"""
        o_t = tl.arange(0, BT)
        b_dt, b_cur, b_w, b_A2, b_AL2 = chunk_scalars(adt + o_s, dt + o_s, trap + o_s, T,
                                                      o_tc, m_t, o_t, BT)
        b_eA = tl.exp2(b_A2)
        b_eL = tl.exp2(b_AL2 - b_A2)
        m_low = o_t[:, None] > o_t[None, :]
        keep = tl.full([], 1, tl.int1)
        if HAS_RESET:
            m_in, m_out, keep, m_same = segments(seg + i_b * NC * BT, o_tc)
            b_eA = tl.where(m_in, b_eA, 0.0)
            b_eL = tl.where(m_out, b_eL, 0.0)
            m_low = m_low & m_same
        return (b_dt, b_cur, b_w, b_A2, b_AL2, b_eA, b_eL, b_eL * b_w, m_low,
                o_t[:, None] == o_t[None, :], keep)

    @triton.jit
    def _rotated_qk(q, k, q_bias, k_bias, angles, phi_in, b_dt, o_tc, m_t, i_c, i_b, i_h, T,
                    NC, H, HPG, N, S, s_ab, s_at, s_ah, s_as, DT: tl.constexpr, BT: tl.constexpr,
                    BN2: tl.constexpr, BR: tl.constexpr, DENSE: tl.constexpr):
        """cos Φ, sin Φ (of the BR rotated pairs) of one chunk of one head, and its q̄, k̄ (dot
        dtype DT)."""
        G = H // HPG
        o_m = tl.arange(0, BR)
        o_n = tl.arange(0, 2 * BN2)
        o_qk = (i_b * T * G + i_h // HPG) * N
        p_q = tile_ptr(q + o_qk, T, N, G * N, i_c * BT, BT, 2 * BN2, DENSE)
        p_k = tile_ptr(k + o_qk, T, N, G * N, i_c * BT, BT, 2 * BN2, DENSE)
        b_phi0 = tl.load(phi_in + ((i_b * H + i_h) * NC + i_c) * BR + o_m)
        p_a = angles + i_b * s_ab + i_h * s_ah
        b_cos, b_sin, _ = chunk_phase(p_a, s_at, s_as, b_dt, b_phi0, o_tc, m_t, S, BR, DENSE)
        m_n = (o_n < N) | DENSE
        b_qb = tl.load(q_bias + i_h * N + o_n, mask=m_n, other=0.0)
        b_qc = rotated_tile(p_q, b_qb, b_cos, b_sin, DT, BT, BN2, BR)
        b_kb = tl.load(k_bias + i_h * N + o_n, mask=m_n, other=0.0)
        b_kc = rotated_tile(p_k, b_kb, b_cos, b_sin, DT, BT, BN2, BR)
        return b_cos, b_sin, b_qc, b_kc

    @triton.jit
    def _score_grads(b_S, b_dM, b_Dw, b_w, m_low, m_diag, p_dd, p_dcur, m_t, DT: tl.constexpr):
        """From the scores S = q̄k̄ᵀ and dM = do xᵀ (fp32): dS = dM ⊙ decay ⊙ W. S ⊙ dS
        (= M ⊙ dM) gives the decay gradient (row sums minus column sums below the diagonal) and,
        over w, the weight gradient; the diagonals give dcur and the ``d`` partial sum, which are
        stored (at ``p_dcur``, ``p_dd``). Returns the decay and weight gradients and dS as a dot
        operand."""
        b_dox = tl.sum(tl.where(m_diag, b_dM, 0.0), axis=1)  # do_j·x_j
        tl.store(p_dd, tl.sum(b_dox, axis=0))
        b_qk = tl.sum(tl.where(m_diag, b_S, 0.0), axis=1)  # q̄_j·k̄_j = q_j·k_j
        tl.store(p_dcur, b_qk * b_dox, mask=m_t)
        b_dS = b_dM * b_Dw
        b_MdM = tl.where(m_low, b_S * b_dS, 0.0)
        b_dA = tl.sum(b_MdM, axis=1)
        b_MdM = tl.sum(b_MdM, axis=0)
        b_dA -= b_MdM
        b_dw = tl.where(b_w > 0, b_MdM / tl.where(b_w > 0, b_w, 1.0), 0.0)
        return b_dA, b_dw, to_dot(b_dS, DT)

    @triton.jit
    def _rotated_back_out(b_dr, b_r, b_cos, b_sin, acc, out, bias, o_b, T, N, row_stride, r0,
                          BT: tl.constexpr, BN2: tl.constexpr, BR: tl.constexpr,
                          HPP: tl.constexpr, DENSE: tl.constexpr):
        """The gradient ``b_dr`` (fp32) of the rotated tile ā = ``b_r`` rotated back: stored
        (HPP = 1) as the tile at row r0 of ``out`` (T × N, rows ``row_stride`` apart; its
        pointers formed here, at the store, not held before) or added to ``acc``, and its column
        sums (the bias partial) stored at ``bias + o_b``, unless ``bias`` is None (the head sum
        forms them). Returns ``acc`` and the angle gradient of the BR rotated pairs."""
        b_da, b_dphi = _rotate_back(b_dr, b_r, b_cos, b_sin, BT, BN2, BR)
        if HPP == 1:
            store_tile(tile_ptr(out, T, N, row_stride, r0, BT, 2 * BN2, DENSE), b_da)
        else:
            acc += b_da
        if bias is not None:
            o_m = tl.arange(0, BN2)
            b_daE, b_daO = tl.split(tl.reshape(b_da, (BT, BN2, 2)))
            tl.store(bias + o_b + 2 * o_m, tl.sum(b_daE, axis=0), mask=2 * o_m < N)
            tl.store(bias + o_b + 2 * o_m + 1, tl.sum(b_daO, axis=0), mask=2 * o_m + 1 < N)
        return acc, b_dphi

    @triton.jit
    def _offsets(i_c, i_b, i_h, T, NC, H, P, N, BT: tl.constexpr, BP: tl.constexpr,
                 BN2: tl.constexpr, DENSE: tl.constexpr):
        """Where chunk i_c of head i_h of batch i_b lies: its token positions and their mask, its
        first row, and the offsets of its (batch, head) row of the per-token scalars, of dy
        ((b, t, h, p) contiguous; dv and dz, which may be the halves of one tensor, take their
        strides s_ob, s_ot), of dq, dk with HPP = 1 ((b, t, h, n)), of its bias partials and of
        its states."""
        i_bh = i_b * H + i_h
        o_tc = i_c * BT + tl.arange(0, BT)
        return (o_tc, (o_tc < T) | DENSE, i_c * BT, i_bh * T, (i_b * T * H + i_h) * P,
                (i_b * T * H + i_h) * N, ((i_b * NC + i_c) * H + i_h) * N,
                (i_bh * NC + i_c) * BP * 2 * BN2)

    @triton.jit
    def _angle_grads(b_dphiq, b_dphik, dphi, dphi_c, o_tc, m_t, i_c, i_b, i_h, T, NC, H, S,
                     BR: tl.constexpr, DENSE: tl.constexpr):
        """dΦ per token (its q and k terms summed) of the chunk's tokens ``o_tc`` (masked by
        ``m_t``) of head i_h of batch i_b, stored in ``dphi`` ((b, t, h, S)), and its chunk sum
        in ``dphi_c`` ((b·h, nc, BR))."""
        o_m = tl.arange(0, BR)
        m_a = m_t[:, None] & ((o_m < S) | DENSE)[None, :]
        p_d = dphi + (i_b * T * H + i_h) * S + o_tc[:, None] * (H * S) + o_m[None, :]
        b_dphi = tl.where(m_a, b_dphiq + b_dphik, 0.0)
        tl.store(p_d, b_dphi, mask=m_a)
        tl.store(dphi_c + ((i_b * H + i_h) * NC + i_c) * BR + o_m, tl.sum(b_dphi, axis=0))

    @triton.jit
    def _decay_grads(b_dA, b_dw, b_xu, b_GG, b_AL2, keep, b_eL, b_ew, p_dadt, p_dw, m_t,
                     BT: tl.constexpr, HAS_RESET: tl.constexpr):
        """The leaving state's terms of the decay gradient, ∂/∂A_L = exp(A_L)·<dG_out, G_in>
        (``b_GG``; no decay when the chunk has a reset) + Σ_j exp(A_L − A_j) w_j x_jᵀ dG k̄_j,
        and −∂/∂A_j; the chunk-local reverse cumsum of ∂L/∂A stored at ``p_dadt``, and ∂L/∂w at
        ``p_dw``."""
        b_eAL = tl.exp2(b_AL2)
        if HAS_RESET:
            b_eAL = tl.where(keep, b_eAL, 0.0)
        b_dAL = b_eAL * b_GG
        b_sw = b_ew * b_xu
        b_dAL += tl.sum(b_sw, axis=0)
        b_dA = b_dA - b_sw + tl.where(tl.arange(0, BT) == BT - 1, b_dAL, 0.0)
        tl.store(p_dadt, tl.cumsum(b_dA, axis=0, reverse=True), mask=m_t)
        tl.store(p_dw, b_dw + b_eL * b_xu, mask=m_t)

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
    ):
        """Chunk i_c of head i_h of batch i_b: every gradient written, but with HPP > 1 dq and
        dk, which are added to the (BT × 2·BN2, fp32) ``acc_q``, ``acc_k`` and returned. With
        HPP = 1 each is stored as soon as it is formed, so it holds no registers after. The gated
        ``do`` and the gate's slope are pinned (:func:`pin`): left to the compiler, the gate was
        recomputed from dy and z in each layout ``do`` is used in, for every warp."""
        o_tc, m_t, r0, o_s, o_p, o_out, o_b, o_gc = _offsets(i_c, i_b, i_h, T, NC, H, P, N, BT,
                                                             BP, BN2, DENSE)
        b_dt, b_cur, b_w, b_A2, b_AL2, b_eA, b_eL, b_ew, m_low, m_diag, keep = _decays(
            adt, dt, trap, seg, o_s, o_tc, m_t, i_b, T, NC, BT, HAS_RESET
        )
        b_x = load_tile(tile_ptr(v + i_b * s_vb + i_h * s_vh, T, P, s_vt, r0, BT, BP, DENSE))
        DT = v.dtype.element_ty
        b_cos, b_sin, b_qc, b_kc = _rotated_qk(q, k, q_bias, k_bias, angles, phi_in, b_dt, o_tc,
                                               m_t, i_c, i_b, i_h, T, NC, H, HPG, N, S, s_ab,
                                               s_at, s_ah, s_as, DT, BT, BN2, BR,
                                               DENSE)
        o_o = i_b * s_ob + i_h * P  # dv, dz
        b_do, b_gz = gate(dy + o_p, z + i_b * s_zb + i_h * s_zh, H * P, s_zt, T, P, r0, BT, BP,
                          HAS_Z, DENSE)
        if HAS_Z:
            b_do, b_gz = pin(b_do), pin(b_gz)
        b_doc = to_dot(b_do, DT)

        # Scores S = q̄k̄ᵀ, M = S ⊙ decay ⊙ W, dM = do xᵀ (see _score_grads).
        b_Dw = decay_weights(b_A2, b_w, b_cur, m_low, m_diag)
        b_S = tl.dot(b_qc, tl.trans(b_kc))
        b_Mc = to_dot(b_S * b_Dw, DT)
        b_dA, b_dw, b_dSc = _score_grads(b_S, tl.dot(b_doc, tl.trans(b_x)), b_Dw, b_w, m_low,
                                         m_diag, dd + (i_b * NC + i_c) * H + i_h,
                                         dcur + o_s + o_tc, m_t, DT)

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
        acc_q, b_dphi = _rotated_back_out(
            b_dqr, b_qc, b_cos, b_sin, acc_q, dq + o_out, dqb, o_b, T, N, H * N, r0, BT,
            BN2, BR, HPP, DENSE,
        )

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
        acc_k, b_dphik = _rotated_back_out(
            b_dkr, b_kc, b_cos, b_sin, acc_k, dk + o_out, dkb, o_b, T, N, H * N, r0, BT,
            BN2, BR, HPP, DENSE,
        )

        _angle_grads(b_dphi, b_dphik, dphi, dphi_c, o_tc, m_t, i_c, i_b, i_h, T, NC, H, S, BR,
                     DENSE)
        # <dG_out, G_in> for ∂/∂A_L: both states are read again here (cache hits) rather than
        # held.
        b_GG = load_dense(g_in + o_gc, 0, BP, 2 * BN2).to(tl.float32) * load_dense(
            dg_out + o_gc, 0, BP, 2 * BN2
        ).to(tl.float32)
        _decay_grads(b_dA, b_dw, b_xu, tl.sum(tl.sum(b_GG, axis=1), axis=0), b_AL2, keep, b_eL,
                     b_ew, dadt + o_s + o_tc, dw + o_s + o_tc, m_t, BT, HAS_RESET)
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
    ):
        """:func:`_chunk_head` with p in blocks of BV columns (the plan's ``bv``), in three
        passes over them: ``dM = do xᵀ`` summed over the blocks; then, block by block, what the
        entering state gives (dz, the ``do G_in`` term of dq̄, the inter-chunk decay gradient);
        then what the leaving state gives (dv, the ``x dG`` term of dk̄, ``<dG_out, G_in>``).
        The blocks of x, dy and z are loaded and gated again in each pass (cache hits), so no
        (BT × BP) tile and no (BP × N) state is held whole: fewer registers than one pass."""
        o_tc, m_t, r0, o_s, o_p, o_out, o_b, o_gc = _offsets(i_c, i_b, i_h, T, NC, H, P, N, BT,
                                                             BP, BN2, DENSE)
        p_v = v + i_b * s_vb + i_h * s_vh
        p_z = z + i_b * s_zb + i_h * s_zh
        o_o = i_b * s_ob + i_h * P  # dv, dz
        b_dt, b_cur, b_w, b_A2, b_AL2, b_eA, b_eL, b_ew, m_low, m_diag, keep = _decays(
            adt, dt, trap, seg, o_s, o_tc, m_t, i_b, T, NC, BT, HAS_RESET
        )
        DT = v.dtype.element_ty
        b_cos, b_sin, b_qc, b_kc = _rotated_qk(q, k, q_bias, k_bias, angles, phi_in, b_dt, o_tc,
                                               m_t, i_c, i_b, i_h, T, NC, H, HPG, N, S, s_ab,
                                               s_at, s_ah, s_as, DT, BT, BN2, BR,
                                               DENSE)

        # Pass 1: dM = do xᵀ, over the blocks of p.
        b_dM = tl.zeros([BT, BT], dtype=tl.float32)
        for v0 in range(0, BP, BV):
            b_x = load_tile(tile_ptr(p_v + v0, T, P - v0, s_vt, r0, BT, BV, DENSE))
            b_do = gate(dy + o_p + v0, p_z + v0, H * P, s_zt, T, P - v0, r0, BT, BV, HAS_Z,
                        DENSE)[0]
            b_dM += tl.dot(to_dot(b_do, DT), tl.trans(b_x))
        b_Dw = decay_weights(b_A2, b_w, b_cur, m_low, m_diag)
        b_S = tl.dot(b_qc, tl.trans(b_kc))
        b_Mc = to_dot(b_S * b_Dw, DT)
        b_dA, b_dw, b_dSc = _score_grads(b_S, b_dM, b_Dw, b_w, m_low, m_diag,
                                         dd + (i_b * NC + i_c) * H + i_h, dcur + o_s + o_tc,
                                         m_t, DT)

        # Pass 2: the entering state G_in, block by block: the inter-chunk output (its decay
        # gradient and, with z, the pre-gate output) and dq̄'s exp(A) ⊙ do G_in.
        b_doG = tl.zeros([BT, 2 * BN2], dtype=tl.float32)
        for v0 in range(0, BP, BV):
            b_x = load_tile(tile_ptr(p_v + v0, T, P - v0, s_vt, r0, BT, BV, DENSE))
            b_do, b_gz = gate(dy + o_p + v0, p_z + v0, H * P, s_zt, T, P - v0, r0, BT, BV,
                              HAS_Z, DENSE)
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
        acc_q, b_dphi = _rotated_back_out(
            b_dqr, b_qc, b_cos, b_sin, acc_q, dq + o_out, dqb, o_b, T, N, H * N, r0, BT,
            BN2, BR, HPP, DENSE,
        )

        # Pass 3: the leaving state's gradient dG_out, block by block: dx = Mᵀ do +
        # exp(A_L − A) w ⊙ (k̄ dGᵀ) + D do, dk̄'s exp(A_L − A) w ⊙ (x dG), and <dG_out, G_in>.
        b_xdG = tl.zeros([BT, 2 * BN2], dtype=tl.float32)
        b_xu = tl.zeros([BT], dtype=tl.float32)  # x_jᵀ dG k̄_j
        b_GG = tl.zeros([BV], dtype=tl.float32)  # <dG_out, G_in>, by row of the block
        for v0 in range(0, BP, BV):
            b_x = load_tile(tile_ptr(p_v + v0, T, P - v0, s_vt, r0, BT, BV, DENSE))
            b_do = gate(dy + o_p + v0, p_z + v0, H * P, s_zt, T, P - v0, r0, BT, BV, HAS_Z,
                        DENSE)[0]
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
                           * b_dGc.to(tl.float32), axis=1)
        b_dkr = tl.dot(tl.trans(b_dSc), b_qc) + b_ew[:, None] * b_xdG
        acc_k, b_dphik = _rotated_back_out(
            b_dkr, b_kc, b_cos, b_sin, acc_k, dk + o_out, dkb, o_b, T, N, H * N, r0, BT,
            BN2, BR, HPP, DENSE,
        )
        _angle_grads(b_dphi, b_dphik, dphi, dphi_c, o_tc, m_t, i_c, i_b, i_h, T, NC, H, S, BR,
                     DENSE)
        _decay_grads(b_dA, b_dw, b_xu, tl.sum(b_GG, axis=0), b_AL2, keep, b_eL,
                     b_ew, dadt + o_s + o_tc, dw + o_s + o_tc, m_t, BT, HAS_RESET)
        return acc_q, acc_k

    @triton.jit
    def _head(
        q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, phi_in, g_in, dg_out, dy, seg,
        dq, dk, dv, dz, dadt, dw, dcur, dd, dqb, dkb, dphi, dphi_c, acc_q, acc_k, i_c, i_b, i_h,
        T, NC, H, HPG, P, N, S, s_vb, s_vt, s_vh, s_zb, s_zt, s_zh, s_ob, s_ot, s_ab, s_at, s_ah,
        s_as,
        BT: tl.constexpr, BP: tl.constexpr, BN2: tl.constexpr, BR: tl.constexpr,
        HPP: tl.constexpr,
        HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_RESET: tl.constexpr, BV: tl.constexpr,
        WG: tl.constexpr, DENSE: tl.constexpr,
    ):
        """One chunk of one head: in one pass (BV = BP) or over blocks of p."""
        if BV == BP:
            acc_q, acc_k = _chunk_head(
                q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, phi_in, g_in, dg_out, dy,
                seg, dq, dk, dv, dz, dadt, dw, dcur, dd, dqb, dkb, dphi, dphi_c, acc_q, acc_k,
                i_c, i_b, i_h, T, NC, H, HPG, P, N, S, s_vb, s_vt, s_vh, s_zb, s_zt, s_zh, s_ob,
                s_ot, s_ab,
                s_at, s_ah, s_as, BT, BP, BN2, BR, HPP, HAS_D, HAS_Z, HAS_RESET, WG, DENSE,
            )
        else:
            acc_q, acc_k = _chunk_head_pb(
                q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, phi_in, g_in, dg_out, dy,
                seg, dq, dk, dv, dz, dadt, dw, dcur, dd, dqb, dkb, dphi, dphi_c, acc_q, acc_k,
                i_c, i_b, i_h, T, NC, H, HPG, P, N, S, s_vb, s_vt, s_vh, s_zb, s_zt, s_zh, s_ob,
                s_ot, s_ab,
                s_at, s_ah, s_as, BT, BP, BN2, BR, HPP, HAS_D, HAS_Z, HAS_RESET, BV, DENSE,
            )
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
        WG: tl.constexpr, DENSE: tl.constexpr,
    ):
        """Chunk i_c of the HPP heads of block i_blk of batch i_b: their gradients, dq and dk
        summed over the block."""
        if HPP == 1:
            _head(
                q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, phi_in, g_in, dg_out, dy,
                seg, dq, dk, dv, dz, dadt, dw, dcur, dd, dqb, dkb, dphi, dphi_c, 0.0, 0.0, i_c,
                i_b, i_blk, T, NC, H, HPG, P, N, S, s_vb, s_vt, s_vh, s_zb, s_zt, s_zh, s_ob, s_ot,
                s_ab,
                s_at, s_ah, s_as, BT, BP, BN2, BR, HPP, HAS_D, HAS_Z, HAS_RESET, BV, WG, DENSE,
            )
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
                    HAS_RESET, BV, WG, DENSE,
                )
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
        BV: tl.constexpr, WG: tl.constexpr, DENSE: tl.constexpr,
    ):
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
                s_ah, s_as, BT, BP, BN2, BR, HPP, HAS_D, HAS_Z, HAS_RESET, BV, WG, DENSE,
            )
        else:
            for i_c in range(i_cb * CPP, tl.minimum(NC, i_cb * CPP + CPP)):
                _chunk_block(
                    q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, phi_in, g_in, dg_out,
                    dy, seg, dq, dk, dv, dz, dadt, dw, dcur, dd, dqb, dkb, dphi, dphi_c, i_c,
                    i_b, i_blk, T, NC, H, HPG, P, N, S, s_vb, s_vt, s_vh, s_zb, s_zt, s_zh, s_ob,
                    s_ot, s_ab,
                    s_at, s_ah, s_as, BT, BP, BN2, BR, HPP, HAS_D, HAS_Z, HAS_RESET, BV, WG,
                    DENSE,
                )
