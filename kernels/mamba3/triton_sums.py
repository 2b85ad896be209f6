"""The two small kernels that end the scan's backward by summing partials, streaming and
deterministic (fixed order, no atomics), with fixed launches (no table entry):

* ``siso_bwd_head_sum_kernel`` (grouped q, k only; grid: row blocks × 2·groups): each group's
  per-head (or per-block of heads) ``dq, dk`` summed in fp32, in head order, and written in the
  dot dtype; with per-head partials, each head's column sums over the block's rows too (the
  bias gradients' partials), which the chunk kernel then leaves out. Left to PyTorch inside a
  compiled block, inductor's reduction over the strided head axis read the partials at under a
  third of the bandwidth this does.
* ``siso_bwd_param_sum_kernel`` (grid: column blocks × 3): the per-row-block partials of the
  bias gradients (the head sum's, or the chunk kernel's per (batch, chunk)) and the chunk
  kernel's of the ``d`` gradient summed over their rows in fp32, in order, one launch for the
  three (as PyTorch reductions they were three kernels, each a launch and a pass of its own).
"""

from __future__ import annotations

import torch

from .launching import LaunchConfig, launch
from .triton_common import tl, triton

if triton is not None:

    @triton.jit
    def siso_bwd_head_sum_kernel(dq, dk, sq, sk, pq, pk, R, G, HPG, N, BR: tl.constexpr,
                                 BN: tl.constexpr, PARTS: tl.constexpr):
        """Rows i_r·BR.. of group i_g's per-head partials ((R, G·HPG, N); program_id(1) is
        2·i_g for dq, 2·i_g + 1 for dk) summed over its HPG heads, in order, in fp32, into (R,
        G, N) of the output's dtype. With PARTS, each head's column sums over these rows too,
        in fp32, into row i_r of (cdiv(R, BR), G·HPG, N) at ``pq``, ``pk``."""
        i_r, i_w = tl.program_id(0), tl.program_id(1)
        i_g, which = i_w // 2, i_w % 2
        o_r = i_r.to(tl.int64) * BR + tl.arange(0, BR)
        o_n = tl.arange(0, BN)
        m = (o_r < R)[:, None] & (o_n < N)[None, :]
        if which == 0:
            src, dst, part = dq, sq, pq
        else:
            src, dst, part = dk, sk, pk
        H = G * HPG
        p = src + o_r[:, None] * (H * N) + i_g * HPG * N + o_n[None, :]
        p_part = part + (i_r.to(tl.int64) * H + i_g * HPG) * N + o_n
        acc = tl.zeros([BR, BN], dtype=tl.float32)
        for j in range(HPG):
            b_x = tl.load(p + j * N, mask=m, other=0.0).to(tl.float32)
            acc += b_x
            if PARTS:
                tl.store(p_part + j * N, tl.sum(b_x, axis=0), mask=o_n < N)
        p_dst = dst + o_r[:, None] * (G * N) + i_g * N + o_n[None, :]
        tl.store(p_dst, acc.to(dst.dtype.element_ty), mask=m)

    @triton.jit
    def siso_bwd_param_sum_kernel(dqb, dkb, dd, sqb, skb, sd, RB, RD, C, H, BR: tl.constexpr,
                                  BC: tl.constexpr):
        """Columns i_c·BC.. of per-row-block partials summed over their rows, in row blocks in
        order, in fp32: the q and k bias gradients, (RB, C = h·n), for program_id(1) = 0 and 1,
        and the d gradient, (RD, H), for 2."""
        i_c, which = tl.program_id(0), tl.program_id(1)
        if which == 0:
            src, dst, cols, R = dqb, sqb, C, RB
        elif which == 1:
            src, dst, cols, R = dkb, skb, C, RB
        else:
            src, dst, cols, R = dd, sd, H, RD
        o_c = i_c * BC + tl.arange(0, BC)
        m_c = o_c < cols
        acc = tl.zeros([BC], dtype=tl.float32)
        for r0 in range(0, R, BR):
            o_r = (r0 + tl.arange(0, BR)).to(tl.int64)
            m = (o_r < R)[:, None] & m_c[None, :]
            acc += tl.sum(tl.load(src + o_r[:, None] * cols + o_c[None, :], mask=m, other=0.0), 0)
        tl.store(dst + o_c, acc, mask=m_c)


# Fixed launches of the two streaming kernels (no table entry), the fastest of a sweep over
# warps, stages and rows at the 434m shape. The head sum streams close to the memory's
# bandwidth with 8 warps over 16 rows.
HEAD_SUM = LaunchConfig(num_warps=8, num_stages=1)
HEAD_SUM_ROWS = 16
# With the bias partials: one warp, so that a head's column sum stays inside it (shuffles, no
# barrier), over 64 rows. At the launch above each head's sum crossed its warps, a barrier each,
# and the loop's loads were no longer unrolled: several times slower.
HEAD_SUM_PARTS = LaunchConfig(num_warps=1, num_stages=1)
HEAD_SUM_PARTS_ROWS = 64
PARAM_SUM = LaunchConfig(num_warps=4, num_stages=2)
PARAM_SUM_COLS = 16  # 64 bytes of a row: many programs, each a few long row blocks


def head_sums(dq, dk, g: int, parts: bool):
    """(b, t, h, n) per-head (or per-block of heads) partials of grouped q, k (h = g·hpg) →
    (b, t, g, n) sums in the partials' dtype, and with ``parts`` (per-head partials) each
    head's column sums over blocks of rows, (row blocks, h, n) fp32 each for q and k (else
    None, None)."""
    b, t, h, n = dq.shape
    rows = b * t
    cfg, block = (HEAD_SUM_PARTS, HEAD_SUM_PARTS_ROWS) if parts else (HEAD_SUM, HEAD_SUM_ROWS)
    blocks = triton.cdiv(rows, block)
    sq = torch.empty(b, t, g, n, dtype=dq.dtype, device=dq.device)
    sk = torch.empty_like(sq)
    pq = pk = None
    if parts:
        pq = torch.empty(blocks, h, n, dtype=torch.float32, device=dq.device)
        pk = torch.empty_like(pq)
    args = (dq, dk, sq, sk, pq if parts else sq, pk if parts else sk, rows, g, h // g, n)
    flags = dict(BR=block, BN=max(16, triton.next_power_of_2(n)), PARTS=parts)
    launch("bwd_head_sum", siso_bwd_head_sum_kernel, (blocks, 2 * g), args, flags, cfg)
    return sq, sk, pq, pk


def param_sums(dqb, dkb, dd):
    """(…, h, n) bias partials and (…, h) d partials, fp32, each summed over its leading
    dimensions → (h, n), (h, n), (h,) fp32 (dd None: no d, its sum None)."""
    h, n = dqb.shape[-2:]
    cols = h * n
    rb = dqb.numel() // cols
    rd = dd.numel() // h if dd is not None else 0
    f32 = dict(dtype=torch.float32, device=dqb.device)
    sqb, skb = torch.empty(h, n, **f32), torch.empty(h, n, **f32)
    sd = torch.empty(h, **f32) if dd is not None else None
    grid = (triton.cdiv(cols, PARAM_SUM_COLS), 3 if dd is not None else 2)
    args = (dqb, dkb, dd if dd is not None else dqb, sqb, skb, sd if sd is not None else sqb,
            rb, rd, cols, h)
    flags = dict(BR=max(16, min(256, triton.next_power_of_2(max(rb, rd)))), BC=PARAM_SUM_COLS)
    launch("bwd_param_sum", siso_bwd_param_sum_kernel, grid, args, flags, PARAM_SUM)
    return sqb, skb, sd
