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
   bias partial sums (but for per-head partials of grouped q, k, which the head sum reads
   anyway and sums) and the per-token angle gradient ``dΦ = ā_E dā_O − ā_O dā_E`` (q and k,
   rotated frame, with the very dot-dtype q̄, k̄ the dots used) and its per-chunk sums. Nothing
   of the rotated frame goes to memory. A program may take several heads of a group of grouped
   q, k in turn (the plan's ``hpp``); ``dq, dk`` are written in the dot dtype per head or per
   such block of heads (their fp32 sum), and what is left of a group's sum is the head sum's
   (below). A program may also take ``cpp`` consecutive chunks in turn, so that under
   num_stages > 1 the compiler loads a chunk's tiles while the one before is worked on, and p
   in blocks of the plan's ``bv``. It is :mod:`m3run.kernels.mamba3.triton_bwd_chunk`.
3. ``siso_bwd_angle_kernel`` (grid: chunks × batch·heads, or with one set of angles for every
   head chunks × batch·head blocks, each block's gradients summed in it): ``Φ_t`` is a cumsum of
   ``Δ·π·tanh(θ̃)``, so ``∂L/∂θ̃_u`` and the angle term of ``∂L/∂Δ_u`` take the reverse cumsum
   of ``dΦ`` from ``u`` on: a two-level fp32 sum, the chunk-local reverse cumsum plus the sum
   of kernel 2's chunk totals over the later chunks (each program sums them itself, in blocks,
   so no subtraction and no launch between kernels 2 and 3). It also applies the trapezoid
   chain rule from ``(dw, dcur)`` to ``(ddt, dtrap)`` (a shift by one token, read across the
   chunk boundary).

The partial sums that end it, the head sum (grouped q, k over their heads, and the bias
partials of per-head ones) and the parameters' gradients over their partials, are
:mod:`m3run.kernels.mamba3.triton_sums`.
"""

from __future__ import annotations

import torch

from .launching import LaunchConfig, launch
from .triton_bwd_chunk import gate, rotated_tile, siso_bwd_chunk_kernel
from .triton_common import (
    PI,
    Tiles,
    chunk_phase,
    chunk_scalars,
    load_tile,
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

    @triton.jit(do_not_specialize=["T", "NC"])
    def siso_bwd_dstate_kernel(
        q, adt, dt, trap, q_bias, angles, phi_in, z, dy, dg_t, seg, dg_out, dg0,
        T, NC, H, HPG, P, N, S, s_zb, s_zt, s_zh, s_ab, s_at, s_ah, s_as,
        BT: tl.constexpr, BP: tl.constexpr, BV: tl.constexpr, BN2: tl.constexpr,
        BR: tl.constexpr, HAS_Z: tl.constexpr, HAS_DGT: tl.constexpr, HAS_RESET: tl.constexpr,
        DENSE: tl.constexpr,
    ):
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
        o_m = tl.arange(0, BR)
        o_n = tl.arange(0, 2 * BN2)
        b_qb = tl.load(q_bias + i_h * N + o_n, mask=(o_n < N) | DENSE, other=0.0)
        DT = dg_out.dtype.element_ty

        o_g = i_bh.to(tl.int64) * P * N
        if HAS_DGT:
            b_dG = load_tile(tile_ptr(dg_t + o_g, P, N, N, v0, BV, 2 * BN2, DENSE))
        else:
            b_dG = tl.zeros([BV, 2 * BN2], dtype=tl.float32)

        for i_r in range(NC):
            i_c = NC - 1 - i_r
            o_tc = i_c * BT + o_t
            m_t = (o_tc < T) | DENSE
            r0 = i_c * BT
            b_dt, _, _, b_A2, b_AL2 = chunk_scalars(adt, dt, trap, T, o_tc, m_t, o_t, BT)
            b_eA = tl.exp2(b_A2)
            b_eAL = tl.exp2(b_AL2)
            if HAS_RESET:  # as in the forward: no decay crosses a reset
                m_in, _m_out, keep, _m_same = segments(seg, o_tc)
                b_eA = tl.where(m_in, b_eA, 0.0)
                b_eAL = tl.where(keep, b_eAL, 0.0)

            # dG_out of this chunk, for kernel 2 (dot dtype).
            o_gc = (i_bh * NC + i_c) * BP * 2 * BN2
            store_dense(dg_out + o_gc, v0, b_dG, BV, 2 * BN2)

            b_phi0 = tl.load(phi_in + (i_bh * NC + i_c) * BR + o_m)
            b_cos, b_sin, _ = chunk_phase(angles, s_at, s_as, b_dt, b_phi0, o_tc, m_t, S, BR,
                                          DENSE)
            b_qc = rotated_tile(tile_ptr(q, T, N, G * N, r0, BT, 2 * BN2, DENSE), b_qb, b_cos,
                                b_sin, DT, BT, BN2, BR)
            b_do, _ = gate(dy, z, H * P, s_zt, T, P - v0, r0, BT, BV, HAS_Z, DENSE)
            b_doA = to_dot(to_dot(b_do, DT).to(tl.float32) * b_eA[:, None], DT)
            b_dG = b_dG * b_eAL + tl.dot(tl.trans(b_doA), b_qc)
        store_tile(tile_ptr(dg0 + o_g, P, N, N, v0, BV, 2 * BN2, DENSE), b_dG)

    @triton.jit
    def _angle_head(dt, trap, dphi, dphi_c, dphi_t, dw, dcur, ddt, dtrap, dphi0, b_th, i_c,
                    i_b, i_h, T, NC, H, S, BT: tl.constexpr, BR: tl.constexpr,
                    BNC: tl.constexpr):
        """Chunk i_c of head i_h of batch i_b, whose tanh θ̃ is ``b_th`` (BT × BR): the reverse
        cumsum of dΦ (chunk-local, plus the chunk totals ``dphi_c`` of the later chunks and the
        final angle's gradient); chunk 0 stores the start angle's gradient. Then the trapezoid
        chain rule from kernel 2's ``(dw, dcur)``, with w_u = λ_uΔ_u + (1−λ_{u+1})Δ_{u+1} and
        cur_u = λ_uΔ_u: ``ddt`` (plus the angle term) and ``dtrap`` (λ = sigmoid(trap)) stored.
        Returns the head's ∂L/∂(π·tanh θ̃), the reverse cumsum times Δ (BT × BR)."""
        i_bh = i_b * H + i_h
        o_t = tl.arange(0, BT)
        o_m = tl.arange(0, BR)
        o_j = tl.arange(0, BNC)
        o_tc = i_c * BT + o_t
        m_t = o_tc < T
        m_s = o_m < S
        m_a = m_t[:, None] & m_s[None, :]

        # Σ over the later chunks, in blocks of BNC chunk totals: one pass, no subtraction.
        # (dphi_t None: the final angle has no gradient.)
        if dphi_t is None:
            b_after = tl.zeros([BR], dtype=tl.float32)
        else:
            b_after = tl.load(dphi_t + i_bh * S + o_m, mask=m_s, other=0.0)
        p_c = dphi_c + i_bh * NC * BR
        for j0 in range(i_c + 1, NC, BNC):
            o_jc = j0 + o_j
            b_c = tl.load(p_c + o_jc[:, None] * BR + o_m[None, :], mask=(o_jc < NC)[:, None],
                          other=0.0)
            b_after += tl.sum(b_c, axis=0)

        p_d = dphi + (i_b * T * H + i_h) * S + o_tc[:, None] * (H * S) + o_m[None, :]
        b_dphi = tl.load(p_d, mask=m_a, other=0.0)
        b_rc = b_after[None, :] + tl.cumsum(b_dphi, axis=0, reverse=True)
        if i_c == 0:
            tl.store(dphi0 + i_bh * S + o_m, tl.sum(tl.where(o_t[:, None] == 0, b_rc, 0.0), 0),
                     mask=m_s)
        o_s = i_bh * T
        b_dt = tl.load(dt + o_s + o_tc, mask=m_t, other=0.0)
        b_ddt = PI * tl.sum(tl.where(m_a, b_rc * b_th, 0.0), axis=1)

        b_lam = sigmoid(tl.load(trap + o_s + o_tc, mask=m_t, other=0.0))
        b_dw = tl.load(dw + o_s + o_tc, mask=m_t, other=0.0)
        b_dcur = tl.load(dcur + o_s + o_tc, mask=m_t, other=0.0)
        b_dwp = tl.load(dw + o_s + o_tc - 1, mask=m_t & (o_tc > 0), other=0.0)
        b_ddt += b_lam * (b_dw + b_dcur) + (1.0 - b_lam) * b_dwp
        tl.store(ddt + o_s + o_tc, b_ddt, mask=m_t)
        b_dtrap = b_dt * (b_dw + b_dcur - b_dwp) * b_lam * (1.0 - b_lam)
        tl.store(dtrap + o_s + o_tc, b_dtrap, mask=m_t)
        return b_rc * b_dt[:, None]

    @triton.jit(do_not_specialize=["T", "NC"])
    def siso_bwd_angle_kernel(
        dt, trap, angles, dphi, dth, dphi_c, dphi_t, dw, dcur, ddt, dtrap, dphi0,
        T, NC, H, S, HPB, s_ab, s_at, s_ah, s_as,
        BT: tl.constexpr, BR: tl.constexpr, BNC: tl.constexpr,
    ):
        """Chunk i_c of a block of HPB heads of one batch in turn (:func:`_angle_head`), their
        θ̃ gradients summed in head order into the block's slot of ``dth`` ((b, t, H/HPB, S)).
        Per-head angles take one head a block (dth is then dphi: the gradient in place of dΦ);
        one set of angles for every head (head stride 0) may take several, so no per-head
        gradient is written for a sum to read back."""
        i_c, i_p = tl.program_id(0), tl.program_id(1).to(tl.int64)
        o_tc = i_c * BT + tl.arange(0, BT)
        o_m = tl.arange(0, BR)
        m_a = (o_tc < T)[:, None] & (o_m < S)[None, :]
        HB = H // HPB
        i_b, i_k = i_p // HB, i_p % HB
        p_a = angles + i_b * s_ab + i_k * HPB * s_ah + o_tc[:, None] * s_at + o_m[None, :] * s_as
        b_th = tanh(tl.load(p_a, mask=m_a, other=0.0))
        b_g = tl.zeros([BT, BR], dtype=tl.float32)
        for i_h in range(i_k * HPB, i_k * HPB + HPB):
            b_g += _angle_head(dt, trap, dphi, dphi_c, dphi_t, dw, dcur, ddt, dtrap, dphi0, b_th,
                               i_c, i_b, i_h, T, NC, H, S, BT, BR, BNC)
        p_o = dth + (i_b * T * HB + i_k) * S + o_tc[:, None] * (HB * S) + o_m[None, :]
        tl.store(p_o, b_g * PI * (1.0 - b_th * b_th), mask=m_a)


def siso_bwd(q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, seg, g_in, phi_in,
             dy, dg_t, dphi_t, chunk_size, cfgs: dict[str, LaunchConfig],
             dzv=None):
    """Launch the kernels. Returns the gradients of every input of the forward kernel:
    dq, dk (b, t, g, n) in the dot dtype, dv, dz, dadt, ddt, dtrap, dq_bias, dk_bias, dangles
    (in the angles' shape: (b, t, 1, s), summed over heads, where they are one set for every
    head), dd (h,), dphi0 (b, h, s), dg0 (b, h, p, n). ``dg_t``, ``dphi_t``: the final state's
    and angle's gradients, or None where they have none. With ``dzv`` (b, t, 2, h, p), z and v
    packed in one tensor (z first), dz and dv are written into its halves, and returned as those
    views."""
    b, t, g, n = q.shape
    h, p = v.shape[2], v.shape[3]
    s = angles.shape[3]
    shared = angles.shape[2] == 1 and h > 1
    angles = angles.expand(b, t, h, s)  # the kernels read shared angles with a head stride 0
    hpg = h // g
    tiles = Tiles.of(p, n, chunk_size)
    BT, BP, BN2, BR = tiles.BT, tiles.BP, tiles.BN2, tiles.rot_pairs(s)
    dense = tiles.dense(t, p, n, s)  # every tile whole: the kernels' masks compiled out
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
            t, nc, h, hpg, p, n, s, *z_strides, *a_strides)
    flags = dict(BT=BT, BP=BP, BV=bv, BN2=BN2, BR=BR, HAS_Z=z is not None,
                 HAS_DGT=dg_t is not None, HAS_RESET=seg is not None,
                 DENSE=dense)
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
    if dzv is not None:
        dz, dv = dzv[:, :, 0], dzv[:, :, 1]
    else:
        dv = torch.empty(b, t, h, p, dtype=v.dtype, device=dev)
        dz = torch.empty(b, t, h, p, dtype=z.dtype, device=dev) if z is not None else None
    dadt, dw, dcur = (torch.empty(b, h, t, **f32) for _ in range(3))
    dd = torch.empty(b, nc, h, **f32)
    # The bias gradients' partials: each head's dq, dk summed over a chunk, here, or over a
    # block of rows by the head sum where it reads them per head anyway (column sums of the
    # partials rounded once to the dot dtype, 144 of the chunk kernel's instructions fewer).
    parts_in_sum = hpg > hpp == 1
    dqb = dkb = None
    if not parts_in_sum:
        dqb = torch.empty(b, nc, h, n, **f32)
        dkb = torch.empty(b, nc, h, n, **f32)
    dphi = torch.empty(b, t, h, s, **f32)  # dΦ per head; per-head angles: their gradient
    dphi_c = torch.empty(b * h, nc, BR, **f32)
    args = (
        q, k, v, zz, adt, dt, trap, q_bias, k_bias, angles, d if d is not None else q_bias,
        phi_in, g_in, dg_out, dy, seg_,
        dq, dk, dv, dz if dz is not None else dv, dadt, dw, dcur, dd, dqb, dkb, dphi, dphi_c,
        t, nc, h, hpg, p, n, s, v.stride(0), v.stride(1), v.stride(2), *z_strides,
        dv.stride(0), dv.stride(1), *a_strides,
    )
    cpp = cfgs["bwd_chunk"].cpp
    bv = max(16, min(cfgs["bwd_chunk"].bv or BP, BP))  # p in blocks of bv, as kernel 1
    flags = dict(BT=BT, BP=BP, BN2=BN2, BR=BR, HPP=hpp, CPP=cpp, HAS_D=d is not None,
                 HAS_Z=z is not None, HAS_RESET=seg is not None, BV=bv,
                 WG=bool(cfgs["bwd_chunk"].wg), DENSE=dense)
    grid = (triton.cdiv(nc, cpp), b * h // hpp)
    launch("bwd_chunk", siso_bwd_chunk_kernel, grid, args, flags, cfgs["bwd_chunk"])
    del dg_out
    if hpg > hpp:
        dq, dk, pq, pk = head_sums(dq, dk, g, parts=parts_in_sum)
        if parts_in_sum:
            dqb, dkb = pq, pk

    # 3. The angle gradients and the trapezoid chain rule, chunk by chunk (shared angles: each
    # program takes a chunk of a block of a batch's heads, and sums their angle gradients).
    ddt, dtrap = torch.empty(b, h, t, **f32), torch.empty(b, h, t, **f32)
    dphi0 = torch.empty(b, h, s, **f32)
    hb = h  # per-head angles: a block a head, the gradient in place of dΦ
    if shared:  # the heads in hb blocks (the largest divisor of h up to the plan's), each summed
        hb = max(j for j in range(1, min(cfgs["bwd_angle"].hb, h) + 1) if h % j == 0)
    dangles = torch.empty(b, t, hb, s, **f32) if shared else dphi
    args = (dt, trap, angles, dphi, dangles, dphi_c, dphi_t, dw, dcur, ddt, dtrap, dphi0, t, nc,
            h, s, h // hb, *a_strides)
    flags = dict(BT=BT, BR=BR, BNC=min(64, triton.next_power_of_2(nc)))
    launch("bwd_angle", siso_bwd_angle_kernel, (nc, b * hb), args, flags, cfgs["bwd_angle"])
    if shared and hb > 1:  # the blocks' sums added in a fixed order (no atomics): deterministic
        dangles = dangles.sum(2, keepdim=True)
    dq_bias, dk_bias, dd_h = param_sums(dqb, dkb, dd if d is not None else None)
    return (dq, dk, dv, dz, dadt, ddt, dtrap, dq_bias, dk_bias, dangles, dd_h, dphi0,
            dg0)
