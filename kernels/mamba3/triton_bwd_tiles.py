"""The tile helpers of the backward's chunk kernel (:mod:`kernels.mamba3.triton_bwd_chunk`),
some shared with its state kernel: where a chunk of a head lies, its per-token scalars and
decays, q̄, k̄ rotated as the forward rotates them (whole, or as the halves of n the angles turn
and leave), the gated ``do`` with the gate's slope, the score gradients, the q̄, k̄ gradients
rotated back with their angle gradients, and the decay gradients' last terms.
"""

from __future__ import annotations

from .triton_common import (
    chunk_phase,
    chunk_scalars,
    fast_div,
    halves,
    interpreting,
    load_dense,
    load_tile,
    rotate,
    rotate_pairs,
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
            operand, an elementwise term) from its loads in each of them, for every warp.
            Pinning the rotated q̄, k̄ took the chunk kernel from 1,449 to 1,336 µs on an H200."""
            return tl.inline_asm_elementwise(
                "mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=False, pack=1
            )

    @triton.jit
    def rotated_tile(p_x, b_bias, b_cos, b_sin, DT: tl.constexpr, BT: tl.constexpr,
                     BN2: tl.constexpr, BR: tl.constexpr):  # fmt: skip
        """R(Φ)(x + bias) of a loaded (BT × 2·BN2) tile, its first BR pairs turned, as a dot
        operand of dtype DT: the same operations, in the same order, as the forward's rotation,
        so the same values; pinned, so every use of the tile (the score and state dots, the
        angle gradient) sees one value."""
        b_x = load_tile(p_x).to(tl.float32) + b_bias[None, :]
        return to_dot(pin(rotate(b_x, b_cos, b_sin, BT, BN2, BR)), DT)

    @triton.jit
    def rotate_back(b_g, b_r, b_cos, b_sin, BT: tl.constexpr, BN2: tl.constexpr,
                    BR: tl.constexpr):  # fmt: skip
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
              HAS_Z: tl.constexpr, DENSE: tl.constexpr):  # fmt: skip
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
    def decays(adt, dt, trap, seg, o_s, o_tc, m_t, i_b, T, NC, BT: tl.constexpr,
               HAS_RESET: tl.constexpr):  # fmt: skip
        """One chunk's per-token scalars (``o_s`` offsets the (batch, head) row; ``o_tc``, ``m_t``
        the chunk's positions and their mask, :func:`offsets`'): Δ, λΔ, w, the
        cumulative decay A and its last value A_L (log2), exp(A), exp(A_L − A), exp(A_L − A)·w,
        the masks of the pairs below the diagonal (in one segment) and on it, and whether the
        entering state survives the chunk (no reset in it). As in the forward, no decay crosses
        a reset. (exp(A_L) is :func:`decay_grads`': formed here, it cost the chunk kernel 120 B
        of spills.)"""
        o_t = tl.arange(0, BT)
        b_dt, b_cur, b_w, b_A2, b_AL2 = chunk_scalars(adt + o_s, dt + o_s, trap + o_s, T,
                                                      o_tc, m_t, o_t, BT)  # fmt: skip
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
                o_t[:, None] == o_t[None, :], keep)  # fmt: skip

    @triton.jit
    def rotated_qk(q, k, q_bias, k_bias, angles, phi_in, b_dt, o_tc, m_t, i_c, i_b, i_h, T,
                   NC, H, HPG, N, S, s_ab, s_at, s_ah, s_as, DT: tl.constexpr, BT: tl.constexpr,
                   BN2: tl.constexpr, BR: tl.constexpr, DENSE: tl.constexpr):  # fmt: skip
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
    def score_grads(b_S, b_dM, b_Dw, b_w, m_low, m_diag, p_dd, p_dcur, m_t, DT: tl.constexpr):
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
        b_dw = tl.where(b_w > 0, fast_div(b_MdM, tl.where(b_w > 0, b_w, 1.0)), 0.0)
        return b_dA, b_dw, to_dot(b_dS, DT)

    @triton.jit
    def rotated_back_out(b_dr, b_r, b_cos, b_sin, acc, out, bias, o_b, T, N, row_stride, r0,
                         BT: tl.constexpr, BN2: tl.constexpr, BR: tl.constexpr,
                         HPP: tl.constexpr, DENSE: tl.constexpr):  # fmt: skip
        """The gradient ``b_dr`` (fp32) of the rotated tile ā = ``b_r`` rotated back: stored
        (HPP = 1) as the tile at row r0 of ``out`` (T × N, rows ``row_stride`` apart; its
        pointers formed here, at the store, not held before) or added to ``acc``, and its column
        sums (the bias partial) stored at ``bias + o_b``, unless ``bias`` is None (the head sum
        forms them). Returns ``acc`` and the angle gradient of the BR rotated pairs."""
        b_da, b_dphi = rotate_back(b_dr, b_r, b_cos, b_sin, BT, BN2, BR)
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
    def offsets(i_c, i_b, i_h, T, NC, H, P, N, BT: tl.constexpr, BP: tl.constexpr,
                BN2: tl.constexpr, DENSE: tl.constexpr):  # fmt: skip
        """Where chunk i_c of head i_h of batch i_b lies: its token positions and their mask, its
        first row, and the offsets of its (batch, head) row of the per-token scalars, of dy
        ((b, t, h, p) contiguous; dv and dz, which may be the halves of one tensor, take their
        strides s_ob, s_ot), of dq, dk with HPP = 1 ((b, t, h, n)), of its bias partials and of
        its states."""
        i_bh = i_b * H + i_h
        o_tc = i_c * BT + tl.arange(0, BT)
        return (o_tc, (o_tc < T) | DENSE, i_c * BT, i_bh * T, (i_b * T * H + i_h) * P,
                (i_b * T * H + i_h) * N, ((i_b * NC + i_c) * H + i_h) * N,
                (i_bh * NC + i_c) * BP * 2 * BN2)  # fmt: skip

    @triton.jit
    def angle_grads(b_dphiq, b_dphik, dphi, dphi_c, o_tc, m_t, i_c, i_b, i_h, T, NC, H, S,
                    BR: tl.constexpr, DENSE: tl.constexpr):  # fmt: skip
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
    def decay_grads(b_dA, b_dw, b_xu, b_GG, b_AL2, keep, b_eL, b_ew, p_dadt, p_dw, m_t,
                    BT: tl.constexpr, HAS_RESET: tl.constexpr):  # fmt: skip
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
    def state_dot(a, b, BP: tl.constexpr, BN2: tl.constexpr):
        """<a, b> of two chunk states (BP × 2·BN2, row-major), summed in fp32: as the diagonal of
        one product of the states viewed as 16 rows, on the tensor cores (16 × 16 × (BP·2·BN2 /
        16)), rather than as products of elements converted to fp32 one by one (the chunk
        kernel's ∂/∂A_L term: 104 fewer of its instructions on sm_90, spills 180 → 100 B)."""
        R: tl.constexpr = 16
        C: tl.constexpr = BP * 2 * BN2 // R
        b_ab = tl.dot(load_dense(a, 0, R, C), tl.trans(load_dense(b, 0, R, C)))
        o_r = tl.arange(0, R)
        return tl.sum(tl.sum(tl.where(o_r[:, None] == o_r[None, :], b_ab, 0.0), axis=1), axis=0)

    @triton.jit
    def half_tiles(x, bias, b_cos, b_sin, T, N, row_stride, r0, DT: tl.constexpr,
                   BT: tl.constexpr, BR: tl.constexpr, DENSE: tl.constexpr):  # fmt: skip
        """q̄ or k̄ of one chunk as its two halves of 2·BR columns (dot dtype DT), each loaded
        as a tile of its own: the first rotated (its pairs adjacent, so split and joined in
        registers), the second as it is; both pinned. ``x`` and ``bias`` point at the first
        column of the rows and of the head's bias."""
        W: tl.constexpr = 2 * BR
        o_c = tl.arange(0, W)
        b_1 = load_tile(tile_ptr(x, T, N, row_stride, r0, BT, W, DENSE)).to(tl.float32)
        b_1 += tl.load(bias + o_c, mask=(o_c < N) | DENSE, other=0.0)[None, :]
        b_2 = load_tile(tile_ptr(x + W, T, N - W, row_stride, r0, BT, W, DENSE)).to(tl.float32)
        b_2 += tl.load(bias + W + o_c, mask=(o_c + W < N) | DENSE, other=0.0)[None, :]
        return to_dot(pin(rotate_pairs(b_1, b_cos, b_sin, BT, BR)), DT), to_dot(pin(b_2), DT)

    @triton.jit
    def state_half(base, c0, BP: tl.constexpr, BN2: tl.constexpr, BR: tl.constexpr):
        """Columns c0 .. c0 + 2·BR of a chunk's (BP × 2·BN2) state."""
        o_c = c0 + tl.arange(0, 2 * BR)
        return tl.load(base + tl.arange(0, BP)[:, None] * (2 * BN2) + o_c[None, :])

    @triton.jit
    def halves_out(b_d1, b_d2, b_r1, b_cos, b_sin, out, bias, o_b, T, N, row_stride, r0,
                   BT: tl.constexpr, BR: tl.constexpr, DENSE: tl.constexpr):  # fmt: skip
        """The gradient of a rotated tile, as its halves (fp32; ``b_r1`` the rotated first half
        in the dot dtype): the first rotated back; both stored at row r0 of ``out`` and their
        column sums (the bias partial) at ``bias + o_b`` unless ``bias`` is None. Returns the
        angle gradient of the BR rotated pairs."""
        W: tl.constexpr = 2 * BR
        b_d1, b_dphi = rotate_back(b_d1, b_r1, b_cos, b_sin, BT, BR, BR)
        store_tile(tile_ptr(out, T, N, row_stride, r0, BT, W, DENSE), b_d1)
        store_tile(tile_ptr(out + W, T, N - W, row_stride, r0, BT, W, DENSE), b_d2)
        if bias is not None:
            o_c = tl.arange(0, W)
            tl.store(bias + o_b + o_c, tl.sum(b_d1, axis=0), mask=(o_c < N) | DENSE)
            tl.store(bias + o_b + W + o_c, tl.sum(b_d2, axis=0), mask=(o_c + W < N) | DENSE)
        return b_dphi
