"""Triton backward of the Mamba-3 SISO scan: four kernels (five with the gate split), no
atomics, so two calls on the same inputs give bitwise-equal gradients.

1. ``siso_bwd_prep_kernel`` (grid: chunks × batch·groups, a loop over the group's heads):
   q̄ = R(Φ)(q + q_bias) and k̄ likewise, per head in the dot dtype, from the angle entering each
   chunk that the forward saved. The rotation and its trig are done here once, not in the
   main kernel.
2. ``siso_bwd_main_kernel`` (grid: batch·heads, reverse over chunks): carries the gradient ``dG`` of
   the augmented state (p × n, fp32) and does every dot of a chunk on q̄, k̄, x, the saved
   entering state ``G`` and dy: ``dv``, ``dz`` (recomputing the pre-gate output), ``dq̄``, ``dk̄``
   (fp32, rotated frame), the trapezoid-weight gradients ``dw``, ``dcur``, the ``d`` partial sums,
   the start-state gradient, and the ``adt`` gradient, chunk-local: ``adt`` enters only through the
   chunk's cumulative decay ``A`` (the carried state sees it through ``exp(A_L)``), so its
   gradient is a reverse cumsum over one chunk of ``∂L/∂A``, never a sequence-long sum.
3. ``siso_bwd_post_kernel`` (grid: chunks × batch·groups, a loop over the group's heads): rotates
   ``dq̄, dk̄`` back (``da = Rᵀ dā``), sums them over the heads of a group in registers (g = 1:
   all heads; or in blocks of heads, summed after), the per-chunk bias partial sums, and the
   per-token angle gradient ``dΦ = ā_E dā_O − ā_O dā_E`` (q and k, rotated frame, with the
   dot-dtype q̄, k̄ of kernel 1) with its per-chunk sums.
4. ``siso_bwd_angle_kernel`` (grid: chunks × batch·heads): ``Φ_t`` is a cumsum of
   ``Δ·π·tanh(θ̃)``, so ``∂L/∂θ̃_u`` and the angle term of ``∂L/∂Δ_u`` take the reverse cumsum
   of ``dΦ`` from ``u`` on: a two-level fp32 sum, the chunk-local reverse cumsum plus the sum
   over later chunks (PyTorch sums the (b·h, nc, s) chunk totals between kernels 3 and 4).

When the launch plan sets ``split_gate``, ``siso_bwd_gate_kernel`` (grid: chunks × batch·heads)
runs between kernels 1 and 2 and does the main kernel's work that needs no ``dG`` — do, dz,
dcur, the inter-chunk decay term, the ``d`` partials — so the sequential kernel holds fewer
tiles; the numbers are the same.

What stays in PyTorch, each O(b·h·t) or smaller: the sum over chunks of the chunk totals, the
trapezoid chain rule from ``(dw, dcur)`` to ``(ddt, dtrap)`` (it shifts by one token), and the sums
of the bias and ``d`` partials over batch and chunks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .triton_common import (
    PI,
    LaunchConfig,
    Tiles,
    chunk_phase,
    chunk_scalars,
    decay_weights,
    launch,
    load_tile,
    rotate,
    sigmoid,
    store_tile,
    tanh,
    tile_ptr,
    tl,
    to_dot,
    triton,
)

if triton is not None:

    @triton.jit(do_not_specialize=["T", "NC"])
    def siso_bwd_prep_kernel(
        q, k, dt, q_bias, k_bias, angles, phi_in, qr, kr,
        T, NC, H, HPG, N, S, s_ab, s_at, s_ah, s_as,
        BT: tl.constexpr, BN2: tl.constexpr,
    ):  # fmt: skip
        """q̄, k̄ of chunk i_c for every head of one (batch, group): (b, t, h, n), dot dtype."""
        i_c, i_bg = tl.program_id(0), tl.program_id(1)
        G = H // HPG
        i_b, i_g = i_bg // G, i_bg % G
        o_t = tl.arange(0, BT)
        o_m = tl.arange(0, BN2)
        o_n = tl.arange(0, 2 * BN2)
        o_tc = i_c * BT + o_t
        m_t = o_tc < T
        r0 = i_c * BT
        o_qk = (i_b.to(tl.int64) * T * G + i_g) * N
        b_q = load_tile(tile_ptr(q + o_qk, T, N, G * N, r0, BT, 2 * BN2)).to(tl.float32)
        b_k = load_tile(tile_ptr(k + o_qk, T, N, G * N, r0, BT, 2 * BN2)).to(tl.float32)
        DT = qr.dtype.element_ty
        for j in range(HPG):
            i_h = i_g * HPG + j
            i_bh = (i_b * H + i_h).to(tl.int64)
            b_dt = tl.load(dt + i_bh * T + o_tc, mask=m_t, other=0.0)
            b_phi0 = tl.load(phi_in + (i_bh * NC + i_c) * BN2 + o_m)
            p_a = angles + i_b.to(tl.int64) * s_ab + i_h * s_ah
            b_cos, b_sin, _ = chunk_phase(p_a, s_at, s_as, b_dt, b_phi0, o_tc, m_t, S, BN2)
            o_r = (i_b.to(tl.int64) * T * H + i_h) * N
            b_qb = tl.load(q_bias + i_h * N + o_n, mask=o_n < N, other=0.0)
            b_qr = rotate(b_q + b_qb[None, :], b_cos, b_sin, BT, BN2)
            store_tile(tile_ptr(qr + o_r, T, N, H * N, r0, BT, 2 * BN2), to_dot(b_qr, DT))
            b_kb = tl.load(k_bias + i_h * N + o_n, mask=o_n < N, other=0.0)
            b_kr = rotate(b_k + b_kb[None, :], b_cos, b_sin, BT, BN2)
            store_tile(tile_ptr(kr + o_r, T, N, H * N, r0, BT, 2 * BN2), to_dot(b_kr, DT))

    @triton.jit(do_not_specialize=["T", "NC"])
    def siso_bwd_main_kernel(
        qr, kr, v, z, adt, dt, trap, d, g_in, dy, dg_t, da_in,
        dqr, dkr, dv, dz, dadt, dw, dcur, dd, dg0,
        T, NC, H, P, N, s_vb, s_vt, s_vh, s_zb, s_zt, s_zh,
        BT: tl.constexpr, BP: tl.constexpr, BN2: tl.constexpr,
        HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DGT: tl.constexpr, GATED: tl.constexpr,
    ):  # fmt: skip
        """One (batch, head), chunks in reverse, carrying dG. See the module docstring. GATED:
        ``siso_bwd_gate_kernel`` ran first, so ``dy`` holds do (dot dtype), ``da_in`` the
        inter-chunk decay gradient, and dz, dcur and the d partials are done."""
        i_bh = tl.program_id(0)
        i_b, i_h = i_bh // H, i_bh % H
        # (b, t, h, ·) contiguous: qr, kr, dqr, dkr (n); dy, dv, dz (p). (b, h, t): the scalars.
        o_n_base = (i_b.to(tl.int64) * T * H + i_h) * N
        o_p_base = (i_b.to(tl.int64) * T * H + i_h) * P
        qr += o_n_base
        kr += o_n_base
        dqr += o_n_base
        dkr += o_n_base
        dy += o_p_base
        dv += o_p_base
        dz += o_p_base
        v += i_b.to(tl.int64) * s_vb + i_h * s_vh
        z += i_b.to(tl.int64) * s_zb + i_h * s_zh
        o_s = i_bh.to(tl.int64) * T
        adt += o_s
        dt += o_s
        trap += o_s
        da_in += o_s
        dadt += o_s
        dw += o_s
        dcur += o_s

        o_t = tl.arange(0, BT)
        m_strict = o_t[:, None] > o_t[None, :]
        m_diag = o_t[:, None] == o_t[None, :]
        if HAS_D:
            b_D = tl.load(d + i_h).to(tl.float32)
        b_dD = 0.0

        o_g = i_bh.to(tl.int64) * P * N
        if HAS_DGT:
            b_dG = load_tile(tile_ptr(dg_t + o_g, P, N, N, 0, BP, 2 * BN2))
        else:
            b_dG = tl.zeros([BP, 2 * BN2], dtype=tl.float32)

        for i_r in range(NC):
            i_c = NC - 1 - i_r
            o_tc = i_c * BT + o_t
            m_t = o_tc < T
            r0 = i_c * BT
            _, b_cur, b_w, b_A2, b_AL2 = chunk_scalars(adt, dt, trap, T, o_tc, m_t, o_t, BT)
            b_eA = tl.exp2(b_A2)
            b_eAL = tl.exp2(b_AL2)
            b_eL = tl.exp2(b_AL2 - b_A2)
            b_ew = b_eL * b_w

            # Tiles are held as briefly as the dots allow: loaded ones feed dots (and few
            # elementwise terms); fp32 products become dot-dtype operands at once.
            b_qc = load_tile(tile_ptr(qr, T, N, H * N, r0, BT, 2 * BN2))
            b_kc = load_tile(tile_ptr(kr, T, N, H * N, r0, BT, 2 * BN2))
            b_x = load_tile(tile_ptr(v, T, P, s_vt, r0, BT, BP))
            DT = b_x.dtype
            # do = dy ⊙ silu(z), the gradient of the pre-gate output, held in the dot dtype.
            if GATED:
                b_doc = load_tile(tile_ptr(dy, T, P, H * P, r0, BT, BP))
            else:
                b_do = load_tile(tile_ptr(dy, T, P, H * P, r0, BT, BP)).to(tl.float32)
                if HAS_Z:
                    b_z = load_tile(tile_ptr(z, T, P, s_zt, r0, BT, BP)).to(tl.float32)
                    b_do = b_do * b_z * sigmoid(b_z)
                b_doc = to_dot(b_do, DT)

            # Scores S = q̄k̄ᵀ, M = S ⊙ decay ⊙ W, dM = do xᵀ, dS = dM ⊙ decay ⊙ W. S ⊙ dS
            # (= M ⊙ dM) gives the decay gradient (row sums minus column sums below the
            # diagonal) and, over w, the weight gradient; the diagonals give dcur and d.
            b_Dw = decay_weights(b_A2, b_w, b_cur, m_strict, m_diag)
            b_S = tl.dot(b_qc, tl.trans(b_kc))
            b_Mc = to_dot(b_S * b_Dw, DT)
            b_dS = tl.dot(b_doc, tl.trans(b_x))
            if not GATED:
                b_dox = tl.sum(tl.where(m_diag, b_dS, 0.0), axis=1)  # do_j·x_j
                b_dD += tl.sum(b_dox, axis=0)
            b_dS = b_dS * b_Dw
            b_MdM = tl.where(m_strict, b_S * b_dS, 0.0)
            b_dA = tl.sum(b_MdM, axis=1)
            b_MdM = tl.sum(b_MdM, axis=0)
            b_dA -= b_MdM
            b_dw = tl.where(b_w > 0, b_MdM / tl.where(b_w > 0, b_w, 1.0), 0.0)
            if not GATED:
                b_qk = tl.sum(tl.where(m_diag, b_S, 0.0), axis=1)  # q̄_j·k̄_j = q_j·k_j
                tl.store(dcur + o_tc, b_qk * b_dox, mask=m_t)
            b_dSc = to_dot(b_dS, DT)

            # The entering state G_in: the inter-chunk output exp(A_i)·G_in q̄_i (its decay
            # gradient), the exp(A_L)·G_in part of the leaving state (its decay gradient) and
            # dq̄ = dS k̄ + exp(A) ⊙ do G_in.
            p_gi = g_in + (i_bh.to(tl.int64) * NC + i_c) * BP * 2 * BN2
            b_Gc = load_tile(tile_ptr(p_gi, BP, 2 * BN2, 2 * BN2, 0, BP, 2 * BN2))
            if GATED:
                b_dA += tl.load(da_in + o_tc, mask=m_t, other=0.0)
            else:
                b_qG = tl.dot(b_qc, tl.trans(b_Gc))
                b_dA += b_eA * tl.sum(b_doc.to(tl.float32) * b_qG, axis=1)
            b_dAL = b_eAL * tl.sum(tl.sum(b_dG * b_Gc.to(tl.float32), axis=1), axis=0)
            b_dq = tl.dot(b_dSc, b_kc) + b_eA[:, None] * tl.dot(b_doc, b_Gc)
            store_tile(tile_ptr(dqr, T, N, H * N, r0, BT, 2 * BN2), b_dq)
            if HAS_Z and not GATED:  # the pre-gate output, for dz
                b_o = tl.dot(b_Mc, b_x) + b_eA[:, None] * b_qG
                if HAS_D:
                    b_xr = load_tile(tile_ptr(v, T, P, s_vt, r0, BT, BP))
                    b_o += b_D * b_xr.to(tl.float32)
                b_z = load_tile(tile_ptr(z, T, P, s_zt, r0, BT, BP)).to(tl.float32)
                b_sg = sigmoid(b_z)
                b_dz = load_tile(tile_ptr(dy, T, P, H * P, r0, BT, BP)).to(tl.float32)
                b_dz = b_dz * b_sg * (1.0 + b_z * (1.0 - b_sg)) * b_o
                store_tile(tile_ptr(dz, T, P, H * P, r0, BT, BP), b_dz)

            # dx = Mᵀ do + exp(A_L − A) w ⊙ (k̄ dGᵀ) + D do.
            b_dGc = to_dot(b_dG, DT)
            b_u = tl.dot(b_kc, tl.trans(b_dGc))
            b_xu = tl.sum(b_x.to(tl.float32) * b_u, axis=1)  # x_jᵀ dG k̄_j
            b_dx = tl.dot(tl.trans(b_Mc), b_doc) + b_ew[:, None] * b_u
            if HAS_D:
                b_dx += b_D * b_doc.to(tl.float32)
            store_tile(tile_ptr(dv, T, P, H * P, r0, BT, BP), b_dx)
            # dk̄ = dSᵀ q̄ + exp(A_L − A) w ⊙ (x dG).
            b_dk = tl.dot(tl.trans(b_dSc), b_qc) + b_ew[:, None] * tl.dot(b_x, b_dGc)
            store_tile(tile_ptr(dkr, T, N, H * N, r0, BT, 2 * BN2), b_dk)

            # The leaving state's Σ_j exp(A_L − A_j) w_j x_j k̄_jᵀ: ∂/∂A_L, −∂/∂A_j and ∂/∂w_j.
            b_sw = b_ew * b_xu
            b_dAL += tl.sum(b_sw, axis=0)
            b_dA = b_dA - b_sw + tl.where(o_t == BT - 1, b_dAL, 0.0)
            tl.store(dadt + o_tc, tl.cumsum(b_dA, axis=0, reverse=True), mask=m_t)
            tl.store(dw + o_tc, b_dw + b_eL * b_xu, mask=m_t)

            # The state entering this chunk is the one leaving the previous chunk.
            b_doA = to_dot(b_doc.to(tl.float32) * b_eA[:, None], DT)
            b_dG = b_dG * b_eAL + tl.dot(tl.trans(b_doA), b_qc)
        store_tile(tile_ptr(dg0 + o_g, P, N, N, 0, BP, 2 * BN2), b_dG)
        if not GATED:
            tl.store(dd + i_bh, b_dD)

    @triton.jit(do_not_specialize=["T", "NC"])
    def siso_bwd_gate_kernel(
        qr, kr, v, z, adt, dt, trap, d, g_in, dy,
        do_out, dz, dcur, da_in, dd,
        T, NC, H, P, N, s_vb, s_vt, s_vh, s_zb, s_zt, s_zh,
        BT: tl.constexpr, BP: tl.constexpr, BN2: tl.constexpr,
        HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
    ):  # fmt: skip
        """Chunk i_c of one (batch, head), no state across chunks: what of the main kernel needs
        no dG, taken out of its sequential loop when the plan says so. do = dy ⊙ silu(z) (dot
        dtype, for the main kernel), dz (recomputing the pre-gate output), dcur, the
        inter-chunk decay gradient exp(A_i)·do_i·(G_in q̄_i) and the d partial sum."""
        i_c, i_bh = tl.program_id(0), tl.program_id(1)
        i_b, i_h = i_bh // H, i_bh % H
        o_n_base = (i_b.to(tl.int64) * T * H + i_h) * N
        o_p_base = (i_b.to(tl.int64) * T * H + i_h) * P
        qr += o_n_base
        kr += o_n_base
        dy += o_p_base
        do_out += o_p_base
        dz += o_p_base
        v += i_b.to(tl.int64) * s_vb + i_h * s_vh
        z += i_b.to(tl.int64) * s_zb + i_h * s_zh
        o_s = i_bh.to(tl.int64) * T
        o_t = tl.arange(0, BT)
        o_tc = i_c * BT + o_t
        m_t = o_tc < T
        r0 = i_c * BT
        m_strict = o_t[:, None] > o_t[None, :]
        m_diag = o_t[:, None] == o_t[None, :]
        _, b_cur, b_w, b_A2, _ = chunk_scalars(adt + o_s, dt + o_s, trap + o_s, T, o_tc, m_t,
                                               o_t, BT)  # fmt: skip
        b_eA = tl.exp2(b_A2)
        b_qc = load_tile(tile_ptr(qr, T, N, H * N, r0, BT, 2 * BN2))
        b_kc = load_tile(tile_ptr(kr, T, N, H * N, r0, BT, 2 * BN2))
        b_x = load_tile(tile_ptr(v, T, P, s_vt, r0, BT, BP))
        DT = b_x.dtype
        b_dy = load_tile(tile_ptr(dy, T, P, H * P, r0, BT, BP)).to(tl.float32)
        if HAS_Z:
            b_z = load_tile(tile_ptr(z, T, P, s_zt, r0, BT, BP)).to(tl.float32)
            b_sg = sigmoid(b_z)
            b_doc = to_dot(b_dy * b_z * b_sg, DT)
        else:
            b_doc = to_dot(b_dy, DT)
        store_tile(tile_ptr(do_out, T, P, H * P, r0, BT, BP), b_doc)
        b_dox = tl.sum(b_doc.to(tl.float32) * b_x.to(tl.float32), axis=1)  # do_j·x_j
        tl.store(dd + (i_b * NC + i_c) * H + i_h, tl.sum(b_dox, axis=0))

        b_S = tl.dot(b_qc, tl.trans(b_kc))
        b_qk = tl.sum(tl.where(m_diag, b_S, 0.0), axis=1)  # q̄_j·k̄_j
        tl.store(dcur + o_s + o_tc, b_qk * b_dox, mask=m_t)
        p_gi = g_in + (i_bh.to(tl.int64) * NC + i_c) * BP * 2 * BN2
        b_Gc = load_tile(tile_ptr(p_gi, BP, 2 * BN2, 2 * BN2, 0, BP, 2 * BN2))
        b_qG = tl.dot(b_qc, tl.trans(b_Gc))
        b_dA = b_eA * tl.sum(b_doc.to(tl.float32) * b_qG, axis=1)
        tl.store(da_in + o_s + o_tc, b_dA, mask=m_t)
        if HAS_Z:
            b_Dw = decay_weights(b_A2, b_w, b_cur, m_strict, m_diag)
            b_o = tl.dot(to_dot(b_S * b_Dw, DT), b_x) + b_eA[:, None] * b_qG
            if HAS_D:
                b_o += tl.load(d + i_h).to(tl.float32) * b_x.to(tl.float32)
            b_dz = b_dy * b_sg * (1.0 + b_z * (1.0 - b_sg)) * b_o
            store_tile(tile_ptr(dz, T, P, H * P, r0, BT, BP), b_dz)

    @triton.jit(do_not_specialize=["T", "NC"])
    def siso_bwd_post_kernel(
        dt, angles, phi_in, dqr, dkr, qr, kr,
        dq, dk, dqb, dkb, dphi, dphi_c,
        T, NC, H, HPG, HB, N, S, s_ab, s_at, s_ah, s_as,
        BT: tl.constexpr, BN2: tl.constexpr,
    ):  # fmt: skip
        """Chunk i_c of one (batch, group): dq̄, dk̄ of each head back to dq, dk summed over the
        group's heads, bias partial sums per head, dΦ per token and its chunk sums. dΦ is taken
        in the rotated frame, ā_E dā_O − ā_O dā_E, with the very q̄, k̄ (prep's, dot dtype) the
        main kernel's dots used: then the q and k sides of each score's angle gradient cancel
        as they do exactly (the scores depend on angle differences only), where the unrotated
        fp32 a would leave a bf16-sized residue per term for the sequence-long cumsum to
        gather (measured, in a bf16 emulation at t = 2048: the dt gradient's error 1.1e-2 →
        5.1e-3, the angles' 4.6e-2 → 2.1e-2). With HB < HPG
        a program takes a block of HB heads and writes the block's partial sum of dq, dk (in
        (b, t, g·blocks, n)); the caller sums the blocks."""
        i_c, i_bgk = tl.program_id(0), tl.program_id(1)
        G = H // HPG
        NB = tl.cdiv(HPG, HB)
        i_bg, i_k = i_bgk // NB, i_bgk % NB
        i_b, i_g = i_bg // G, i_bg % G
        o_t = tl.arange(0, BT)
        o_m = tl.arange(0, BN2)
        o_tc = i_c * BT + o_t
        m_t = o_tc < T
        r0 = i_c * BT
        m_a = m_t[:, None] & (o_m < S)[None, :]
        b_dqE = tl.zeros([BT, BN2], dtype=tl.float32)
        b_dqO = tl.zeros([BT, BN2], dtype=tl.float32)
        b_dkE = tl.zeros([BT, BN2], dtype=tl.float32)
        b_dkO = tl.zeros([BT, BN2], dtype=tl.float32)
        for j in range(i_k * HB, tl.minimum(HPG, (i_k + 1) * HB)):
            i_h = i_g * HPG + j
            i_bh = (i_b * H + i_h).to(tl.int64)
            b_dt = tl.load(dt + i_bh * T + o_tc, mask=m_t, other=0.0)
            b_phi0 = tl.load(phi_in + (i_bh * NC + i_c) * BN2 + o_m)
            p_a = angles + i_b.to(tl.int64) * s_ab + i_h * s_ah
            b_cos, b_sin, _ = chunk_phase(p_a, s_at, s_as, b_dt, b_phi0, o_tc, m_t, S, BN2)
            o_r = (i_b.to(tl.int64) * T * H + i_h) * N
            o_b = ((i_b * NC + i_c) * H + i_h).to(tl.int64) * N

            # q: da = Rᵀ dā; dΦ gets ā_E dā_O − ā_O dā_E.
            b_g = load_tile(tile_ptr(dqr + o_r, T, N, H * N, r0, BT, 2 * BN2))
            b_gE, b_gO = tl.split(tl.reshape(b_g, (BT, BN2, 2)))
            b_daE = b_gE * b_cos + b_gO * b_sin
            b_daO = b_gO * b_cos - b_gE * b_sin
            b_r = load_tile(tile_ptr(qr + o_r, T, N, H * N, r0, BT, 2 * BN2)).to(tl.float32)
            b_rE, b_rO = tl.split(tl.reshape(b_r, (BT, BN2, 2)))
            b_dphi = b_rE * b_gO - b_rO * b_gE
            b_dqE += b_daE
            b_dqO += b_daO
            tl.store(dqb + o_b + 2 * o_m, tl.sum(b_daE, axis=0), mask=2 * o_m < N)
            tl.store(dqb + o_b + 2 * o_m + 1, tl.sum(b_daO, axis=0), mask=2 * o_m + 1 < N)

            b_g = load_tile(tile_ptr(dkr + o_r, T, N, H * N, r0, BT, 2 * BN2))
            b_gE, b_gO = tl.split(tl.reshape(b_g, (BT, BN2, 2)))
            b_daE = b_gE * b_cos + b_gO * b_sin
            b_daO = b_gO * b_cos - b_gE * b_sin
            b_r = load_tile(tile_ptr(kr + o_r, T, N, H * N, r0, BT, 2 * BN2)).to(tl.float32)
            b_rE, b_rO = tl.split(tl.reshape(b_r, (BT, BN2, 2)))
            b_dphi += b_rE * b_gO - b_rO * b_gE
            b_dkE += b_daE
            b_dkO += b_daO
            tl.store(dkb + o_b + 2 * o_m, tl.sum(b_daE, axis=0), mask=2 * o_m < N)
            tl.store(dkb + o_b + 2 * o_m + 1, tl.sum(b_daO, axis=0), mask=2 * o_m + 1 < N)

            b_dphi = tl.where(m_a, b_dphi, 0.0)
            p_d = dphi + (i_b.to(tl.int64) * T * H + i_h) * S
            tl.store(p_d + o_tc[:, None] * (H * S) + o_m[None, :], b_dphi, mask=m_a)
            tl.store(dphi_c + (i_bh * NC + i_c) * BN2 + o_m, tl.sum(b_dphi, axis=0))

        o_out = (i_b.to(tl.int64) * T * G * NB + i_g * NB + i_k) * N
        b_dq = tl.reshape(tl.join(b_dqE, b_dqO), (BT, 2 * BN2))
        store_tile(tile_ptr(dq + o_out, T, N, G * NB * N, r0, BT, 2 * BN2), b_dq)
        b_dk = tl.reshape(tl.join(b_dkE, b_dkO), (BT, 2 * BN2))
        store_tile(tile_ptr(dk + o_out, T, N, G * NB * N, r0, BT, 2 * BN2), b_dk)

    @triton.jit(do_not_specialize=["T", "NC"])
    def siso_bwd_angle_kernel(
        dt, angles, dphi, dphi_after, ddt,
        T, NC, H, S, s_ab, s_at, s_ah, s_as,
        BT: tl.constexpr, BN2: tl.constexpr,
    ):  # fmt: skip
        """Chunk i_c of one (batch, head): the reverse cumsum of dΦ (chunk-local, plus the sum
        over later chunks in ``dphi_after``) to the angle gradient, in place in ``dphi``, and to
        the angle term of the Δ gradient."""
        i_c, i_bh = tl.program_id(0), tl.program_id(1)
        i_b, i_h = i_bh // H, i_bh % H
        o_t = tl.arange(0, BT)
        o_m = tl.arange(0, BN2)
        o_tc = i_c * BT + o_t
        m_t = o_tc < T
        m_a = m_t[:, None] & (o_m < S)[None, :]
        p_d = dphi + (i_b.to(tl.int64) * T * H + i_h) * S + o_tc[:, None] * (H * S) + o_m[None, :]
        b_dphi = tl.load(p_d, mask=m_a, other=0.0)
        b_after = tl.load(dphi_after + (i_bh.to(tl.int64) * NC + i_c) * BN2 + o_m)
        b_rc = b_after[None, :] + tl.cumsum(b_dphi, axis=0, reverse=True)
        b_dt = tl.load(dt + i_bh.to(tl.int64) * T + o_tc, mask=m_t, other=0.0)
        p_a = angles + i_b.to(tl.int64) * s_ab + i_h * s_ah
        b_th = tanh(tl.load(p_a + o_tc[:, None] * s_at + o_m[None, :] * s_as, mask=m_a, other=0.0))
        tl.store(p_d, b_rc * b_dt[:, None] * PI * (1.0 - b_th * b_th), mask=m_a)
        b_ddt = PI * tl.sum(tl.where(m_a, b_rc * b_th, 0.0), axis=1)
        tl.store(ddt + i_bh.to(tl.int64) * T + o_tc, b_ddt, mask=m_t)


def siso_bwd(q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, g_in, phi_in,
             dy, dg_t, dphi_t, chunk_size, cfgs: dict[str, LaunchConfig],
             split_gate: bool = False):  # fmt: skip
    """Launch the four kernels. Returns the gradients of every input of the forward kernel:
    dq, dk (b, t, g, n) fp32, dv, dz, dadt, ddt, dtrap, dq_bias, dk_bias, dangles, dd (h,),
    dphi0 (b, h, s), dg0 (b, h, p, n)."""
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

    qr = torch.empty(b, t, h, n, dtype=v.dtype, device=dev)
    kr = torch.empty(b, t, h, n, dtype=v.dtype, device=dev)
    launch("bwd_prep", siso_bwd_prep_kernel, (nc, b * g),
           (q, k, dt, q_bias, k_bias, angles, phi_in, qr, kr, t, nc, h, hpg, n, s, *a_strides),
           dict(BT=BT, BN2=BN2), cfgs["bwd_prep"])  # fmt: skip

    dqr = torch.empty(b, t, h, n, **f32)
    dkr = torch.empty(b, t, h, n, **f32)
    dv = torch.empty(b, t, h, p, dtype=v.dtype, device=dev)
    dz = torch.empty(b, t, h, p, dtype=z.dtype, device=dev) if z is not None else None
    dadt, dw, dcur = (torch.empty(b, h, t, **f32) for _ in range(3))
    dg0 = torch.empty(b, h, p, n, **f32)
    zz = z if z is not None else v
    dz_ = dz if dz is not None else dv
    d_ = d if d is not None else q_bias
    dims = (t, nc, h, p, n, v.stride(0), v.stride(1), v.stride(2),
            zz.stride(0), zz.stride(1), zz.stride(2))  # fmt: skip
    if split_gate:
        do = torch.empty(b, t, h, p, dtype=v.dtype, device=dev)
        da_in = torch.empty(b, h, t, **f32)
        dd = torch.empty(b, nc, h, **f32)
        args = (qr, kr, v, zz, adt, dt, trap, d_, g_in, dy, do, dz_, dcur, da_in, dd, *dims)
        flags = dict(BT=BT, BP=BP, BN2=BN2, HAS_D=d is not None, HAS_Z=z is not None)
        launch("bwd_gate", siso_bwd_gate_kernel, (nc, b * h), args, flags, cfgs["bwd_gate"])
        dy = do
    else:
        da_in = dadt  # never read
        dd = torch.empty(b, h, **f32)
    args = (
        qr, kr, v, zz, adt, dt, trap, d_, g_in, dy, dg_t if dg_t is not None else dg0, da_in,
        dqr, dkr, dv, dz_, dadt, dw, dcur, dd, dg0, *dims,
    )  # fmt: skip
    flags = dict(BT=BT, BP=BP, BN2=BN2, HAS_D=d is not None, HAS_Z=z is not None,
                 HAS_DGT=dg_t is not None, GATED=split_gate)  # fmt: skip
    launch("bwd_main", siso_bwd_main_kernel, (b * h,), args, flags, cfgs["bwd_main"])

    # Heads per post program: all of a group's (bv = 0), or blocks of bv summed below.
    hb = min(cfgs["bwd_post"].bv or hpg, hpg)
    nb = triton.cdiv(hpg, hb)
    dq = torch.empty(b, t, g * nb, n, **f32)
    dk = torch.empty(b, t, g * nb, n, **f32)
    dqb = torch.empty(b, nc, h, n, **f32)
    dkb = torch.empty(b, nc, h, n, **f32)
    dangles = torch.empty(b, t, h, s, **f32)
    dphi_c = torch.empty(b * h, nc, BN2, **f32)
    args = (dt, angles, phi_in, dqr, dkr, qr, kr, dq, dk, dqb, dkb, dangles, dphi_c,
            t, nc, h, hpg, hb, n, s, *a_strides)  # fmt: skip
    launch("bwd_post", siso_bwd_post_kernel, (nc, b * g * nb), args, dict(BT=BT, BN2=BN2),
           cfgs["bwd_post"])  # fmt: skip
    del dqr, dkr
    if nb > 1:
        dq, dk = (x.view(b, t, g, nb, n).sum(3) for x in (dq, dk))

    # The sum of dΦ over the later chunks (and the final angle's gradient), chunk by chunk.
    dphi_t = F.pad(dphi_t.reshape(b * h, 1, s), (0, BN2 - s))
    suffix = dphi_c.flip(1).cumsum(1).flip(1)
    dphi_after = (suffix - dphi_c + dphi_t).contiguous()
    dphi0 = (suffix[:, 0, :s] + dphi_t[:, 0, :s]).reshape(b, h, s)
    ddt = torch.empty(b, h, t, **f32)
    args = (dt, angles, dangles, dphi_after, ddt, t, nc, h, s, *a_strides)
    launch("bwd_angle", siso_bwd_angle_kernel, (nc, b * h), args, dict(BT=BT, BN2=BN2),
           cfgs["bwd_angle"])  # fmt: skip

    # Trapezoid chain rule: w_u = λ_uΔ_u + (1−λ_{u+1})Δ_{u+1}, cur_u = λ_uΔ_u.
    lam = torch.sigmoid(trap)
    dw_prev = F.pad(dw[..., :-1], (1, 0))
    ddt = ddt + lam * (dw + dcur) + (1.0 - lam) * dw_prev
    dtrap = dt * (dw + dcur - dw_prev) * lam * (1.0 - lam)
    dd_h = dd.sum(tuple(range(dd.dim() - 1))) if d is not None else None
    return (dq, dk, dv, dz, dadt, ddt, dtrap, dqb.sum((0, 1)), dkb.sum((0, 1)), dangles, dd_h,
            dphi0, dg0)  # fmt: skip
