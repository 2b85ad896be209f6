"""A residual add and the RMSNorm after it, ``s = x + delta``, ``n = rms_norm(s) ⊙ w``, with a
backward of our own.

The forward stays plain PyTorch, so that inductor fuses it with the adds around it as before.
The backward is why this exists. Inductor's own, for the MLP's norm of a block, wrote the fp32
gradient of ``s`` in one kernel, cast it to ``delta``'s dtype (the mixer's output, whose
products take it in bf16) in a second that read it back (192 MiB of traffic a layer at
micro-batch 16 × 2048, where writing the copy in the first costs 64), and left the weight
gradient's partial sums in a workspace that an eager ``sum`` finished (a memset and a
reduction). Here one kernel reads ``s``, the two incoming gradients and the weight once and
writes the gradient of ``s`` in fp32 and in ``delta``'s dtype and a row of weight-gradient
partials a program; a second kernel sums those rows in a fixed order, so two backward calls
give the same bits.

``ds = g_s + r ⊙ (g_n ⊙ w − n̂ · mean(g_n ⊙ w ⊙ n̂))`` with ``r = rsqrt(mean(s²) + eps)``,
``n̂ = s · r``; ``dw = Σ_rows g_n ⊙ n̂``. The kernel recomputes ``r`` from ``s`` (the row is read
anyway), so the forward saves only ``s``, which the plain form saved too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from m3run.kernels.mamba3.triton_common import TRITON_IMPORT_ERROR, tl, triton

# The fastest of the launch configurations (rows a tile × warps × programs) that
# bench/kernels/bench_add_rms_norm.py sweeps at the 434m shape, (16, 2048, 1024); its time is on
# docs/benchmarks.md.
ROWS = 2  # rows of a program's tile: 2 × 1,024 fp32 at d_model 1024
NUM_WARPS = 4
PROGRAMS = 512  # about: each sums its rows' weight gradient into one row of partials
SUM_BLOCK_P, SUM_BLOCK_D = 64, 128  # the partials' second stage: a tile of rows × columns

if triton is not None:

    @triton.jit
    def add_rms_norm_bwd_kernel(
        s,
        gn,
        w,
        gs,
        ds,
        ds_low,
        dw_part,
        n_rows,
        eps,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        ROWS: tl.constexpr,
        SPAN: tl.constexpr,
    ):
        """Rows ``program_id·SPAN ..`` in tiles of ROWS: the gradient of s into
        ``ds`` (fp32) and ``ds_low`` (its dtype), this program's Σ g_n ⊙ n̂ into its row of
        ``dw_part``."""
        pid = tl.program_id(0)
        o_d = tl.arange(0, BLOCK_D)
        m_d = o_d < D
        b_w = tl.load(w + o_d, mask=m_d, other=0.0).to(tl.float32)
        acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
        first = pid * SPAN
        end = tl.minimum(first + SPAN, n_rows)
        for i in range(0, SPAN, ROWS):
            o_r = first + i + tl.arange(0, ROWS)
            m = (o_r < end)[:, None] & m_d[None, :]
            off = o_r.to(tl.int64)[:, None] * D + o_d[None, :]
            b_s = tl.load(s + off, mask=m, other=0.0).to(tl.float32)
            b_gn = tl.load(gn + off, mask=m, other=0.0).to(tl.float32)
            b_gs = tl.load(gs + off, mask=m, other=0.0).to(tl.float32)
            b_r = tl.rsqrt(tl.sum(b_s * b_s, axis=1) / D + eps)
            b_n = b_s * b_r[:, None]
            b_dn = b_gn * b_w[None, :]
            b_c = tl.sum(b_dn * b_n, axis=1) / D
            b_ds = b_gs + b_r[:, None] * (b_dn - b_n * b_c[:, None])
            tl.store(ds + off, b_ds, mask=m)
            tl.store(ds_low + off, b_ds.to(ds_low.dtype.element_ty), mask=m)
            acc += b_gn * b_n
        tl.store(dw_part + pid * D + o_d, tl.sum(acc, axis=0), mask=m_d)

    @triton.jit
    def sum_partials_kernel(
        part, out, D, P: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr
    ):
        """Columns ``program_id·BLOCK_D ..`` of ``out = Σ_p part[p]``, the rows taken in order."""
        o_d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
        m_d = o_d < D
        acc = tl.zeros([BLOCK_P, BLOCK_D], dtype=tl.float32)
        for p0 in range(0, P, BLOCK_P):
            o_p = p0 + tl.arange(0, BLOCK_P)
            m = (o_p < P)[:, None] & m_d[None, :]
            acc += tl.load(part + o_p[:, None] * D + o_d[None, :], mask=m, other=0.0)
        tl.store(out + o_d, tl.sum(acc, axis=0).to(out.dtype.element_ty), mask=m_d)


@torch.library.custom_op("m3run::add_rms_norm_bwd", mutates_args=())
def add_rms_norm_bwd_op(
    s: Tensor, w: Tensor, g_s: Tensor, g_n: Tensor, eps: float, low_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    """(…, D) fp32 ``s``, (D,) ``w``, the gradients of ``s`` (fp32) and of ``n`` → the gradient
    of ``s`` in fp32 and in ``low_dtype``, and ``w``'s in its dtype."""
    D = s.shape[-1]
    rows = s.numel() // D
    ds = torch.empty_like(s)
    ds_low = torch.empty_like(s, dtype=low_dtype)
    span = triton.cdiv(triton.cdiv(rows, PROGRAMS), ROWS) * ROWS  # rows a program
    programs = max(1, triton.cdiv(rows, span))
    part = s.new_empty(programs, D)
    block_d = triton.next_power_of_2(D)
    add_rms_norm_bwd_kernel[(programs,)](
        s,
        g_n,
        w,
        g_s,
        ds,
        ds_low,
        part,
        rows,
        eps,
        D=D,
        BLOCK_D=block_d,
        ROWS=ROWS,
        SPAN=span,
        num_warps=NUM_WARPS,
    )
    dw = torch.empty_like(w)
    sum_partials_kernel[(triton.cdiv(D, SUM_BLOCK_D),)](
        part, dw, D, P=programs, BLOCK_P=SUM_BLOCK_P, BLOCK_D=SUM_BLOCK_D
    )
    return ds, ds_low, dw


@add_rms_norm_bwd_op.register_fake
def _(s, w, g_s, g_n, eps, low_dtype):
    return torch.empty_like(s), torch.empty_like(s, dtype=low_dtype), torch.empty_like(w)


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(x: Tensor, delta: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        s = x + delta
        n = F.rms_norm(s, (s.shape[-1],), w.to(s.dtype), eps)
        return s, n.to(delta.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, delta, w, eps = inputs
        ctx.save_for_backward(output[0], w)
        ctx.eps, ctx.low_dtype = eps, delta.dtype

    @staticmethod
    def backward(ctx, g_s: Tensor, g_n: Tensor):
        s, w = ctx.saved_tensors
        ds, ds_low, dw = add_rms_norm_bwd_op(
            s, w, g_s.contiguous(), g_n.contiguous(), ctx.eps, ctx.low_dtype
        )
        return ds, ds_low, dw, None


def add_rms_norm(x: Tensor, delta: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(s, n)`` with ``s = x + delta`` in x's dtype and ``n = rms_norm(s) ⊙ w`` in delta's,
    the backward through the kernels above: ``x`` an fp32 residual stream (…, D) on a CUDA
    device, ``delta`` a branch's output in bf16, fp16 or fp32, ``w`` (D,). Callers choose it
    through the model's backend (model.layers.RMSNorm.add); on a machine without Triton it
    raises."""
    if TRITON_IMPORT_ERROR is not None:
        raise RuntimeError(TRITON_IMPORT_ERROR)
    if x.dtype != torch.float32 or x.shape != delta.shape or w.shape != x.shape[-1:]:
        raise ValueError(
            "add_rms_norm takes an fp32 stream x, a delta of its shape and a weight of its last "
            f"dim; got x {x.dtype} {tuple(x.shape)}, delta {tuple(delta.shape)}, w "
            f"{tuple(w.shape)}"
        )
    return _AddRMSNorm.apply(x.contiguous(), delta.contiguous(), w, eps)
