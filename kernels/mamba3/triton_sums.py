"""The two small kernels that end the scan's backward by summing partials, streaming and
deterministic (fixed order, no atomics), each with a fixed launch (no table entry):

* ``siso_bwd_head_sum_kernel`` (grouped q, k only; grid: row blocks × 2): each group's per-head
  (or per-block of heads) ``dq, dk`` summed in fp32, in head order, and written in the dot
  dtype. Left to PyTorch inside a compiled block, inductor's reduction over the strided head
  axis read the partials at under a third of the bandwidth this does.
* ``siso_bwd_param_sum_kernel`` (grid: column blocks × 3): the chunk kernel's per-(batch, chunk)
  partials of the bias and ``d`` gradients summed over batch and chunks in fp32, in order, one
  launch for the three (as PyTorch reductions they were three kernels and 31 µs a call at the
  benchmark's shape).
"""

from __future__ import annotations

import torch

from .triton_common import LaunchConfig, launch, tl, triton

if triton is not None:

    @triton.jit
    def siso_bwd_head_sum_kernel(dq, dk, sq, sk, R, HPG, N, BR: tl.constexpr, BN: tl.constexpr):
        """Rows i_r·BR.. of (R, HPG, N) per-head partials (dq for program_id(1) = 0, else dk)
        summed over HPG heads, in order, in fp32, into (R, N) of the output's dtype."""
        i_r, which = tl.program_id(0), tl.program_id(1)
        o_r = i_r.to(tl.int64) * BR + tl.arange(0, BR)
        o_n = tl.arange(0, BN)
        m = (o_r < R)[:, None] & (o_n < N)[None, :]
        if which == 0:
            src, dst = dq, sq
        else:
            src, dst = dk, sk
        p = src + o_r[:, None] * (HPG * N) + o_n[None, :]
        acc = tl.zeros([BR, BN], dtype=tl.float32)
        for j in range(HPG):
            acc += tl.load(p + j * N, mask=m, other=0.0).to(tl.float32)
        tl.store(dst + o_r[:, None] * N + o_n[None, :], acc.to(dst.dtype.element_ty), mask=m)

    @triton.jit
    def siso_bwd_param_sum_kernel(dqb, dkb, dd, sqb, skb, sd, R, C, H, BR: tl.constexpr,
                                  BC: tl.constexpr):  # fmt: skip
        """Columns i_c·BC.. of the chunk kernel's per-(batch, chunk) partials summed over their
        R rows, in row blocks in order, in fp32: the q and k bias gradients, (R, C = h·n), for
        program_id(1) = 0 and 1, and the d gradient, (R, H), for 2."""
        i_c, which = tl.program_id(0), tl.program_id(1)
        if which == 0:
            src, dst, cols = dqb, sqb, C
        elif which == 1:
            src, dst, cols = dkb, skb, C
        else:
            src, dst, cols = dd, sd, H
        o_c = i_c * BC + tl.arange(0, BC)
        m_c = o_c < cols
        acc = tl.zeros([BC], dtype=tl.float32)
        for r0 in range(0, R, BR):
            o_r = (r0 + tl.arange(0, BR)).to(tl.int64)
            m = (o_r < R)[:, None] & m_c[None, :]
            acc += tl.sum(tl.load(src + o_r[:, None] * cols + o_c[None, :], mask=m, other=0.0), 0)
        tl.store(dst + o_c, acc, mask=m_c)


# Fixed launches of the two streaming kernels (no table entry).
# Head sum: 76 µs at b16 t2048 h32 n64 on an H200 against 99 µs with 4 warps and 32 rows
# (3.6 against 2.8 TB/s; every warps × stages × rows of 4/8 × 1–4 × 16/32/64 timed).
HEAD_SUM = LaunchConfig(num_warps=8, num_stages=1)
HEAD_SUM_ROWS = 16
PARAM_SUM = LaunchConfig(num_warps=4, num_stages=2)
PARAM_SUM_COLS = 16  # 64 bytes of a row: many programs, each a few long row blocks


def head_sums(dq, dk, g: int):
    """(b, t, h, n) per-head partials of grouped q, k (h = g·hpg) → (b, t, g, n) sums in the
    partials' dtype."""
    b, t, h, n = dq.shape
    rows = b * t * g
    sq = torch.empty(b, t, g, n, dtype=dq.dtype, device=dq.device)
    sk = torch.empty_like(sq)
    grid = (triton.cdiv(rows, HEAD_SUM_ROWS), 2)
    args = (dq, dk, sq, sk, rows, h // g, n)
    flags = dict(BR=HEAD_SUM_ROWS, BN=max(16, triton.next_power_of_2(n)))
    launch("bwd_head_sum", siso_bwd_head_sum_kernel, grid, args, flags, HEAD_SUM)
    return sq, sk


def param_sums(dqb, dkb, dd):
    """(b, nc, h, n) bias and (b, nc, h) d partials → (h, n), (h, n), (h,) fp32 sums (dd None:
    no d, its sum None)."""
    b, nc, h, n = dqb.shape
    rows, cols = b * nc, h * n
    f32 = dict(dtype=torch.float32, device=dqb.device)
    sqb, skb = torch.empty(h, n, **f32), torch.empty(h, n, **f32)
    sd = torch.empty(h, **f32) if dd is not None else None
    grid = (triton.cdiv(cols, PARAM_SUM_COLS), 3 if dd is not None else 2)
    args = (dqb, dkb, dd if dd is not None else dqb, sqb, skb, sd if sd is not None else sqb,
            rows, cols, h)  # fmt: skip
    flags = dict(BR=max(16, min(256, triton.next_power_of_2(rows))), BC=PARAM_SUM_COLS)
    launch("bwd_param_sum", siso_bwd_param_sum_kernel, grid, args, flags, PARAM_SUM)
    return sqb, skb, sd
