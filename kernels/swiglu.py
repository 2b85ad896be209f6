"""The SwiGLU MLP's elementwise half and its down projection as one custom operator, with a
Triton kernel each way.

``swiglu_down(gu, w) = silu(g) ⊙ u · wᵀ`` for ``gu = [g, u]`` (the gate/up projection's output,
gate first). The point is what the backward keeps and how it reads: the down projection's weight
gradient needs the hidden ``h = silu(g) ⊙ u``, (b, t, d_hidden), which inductor's partition of
the plain module saved, one per layer for the whole step's backward. Here only ``gu`` is
saved, and one backward kernel reads ``g, u, dh`` once to write ``dg, du`` (into one buffer
laid out like ``gu``) and the recomputed ``h``. Inductor's fused silu backward wrote the
gradient as a concatenation, more slowly and with six streams to this kernel's five
(docs/benchmarks.md has both timed).

Opaque to torch.compile like the scan's operators (kernels/mamba3/triton_siso.py): inductor
calls the kernels and cuBLAS as they are. Dots run in ``gu``'s dtype with fp32 accumulation, as
the plain module's under autocast; the weight gradient comes back in ``w``'s dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from m3run.kernels.mamba3.triton_common import DTYPES, TRITON_IMPORT_ERROR, tl, triton

BLOCK = 1024  # columns of d_hidden per program: one row's slice, 8 bf16 per thread at 4 warps
NUM_WARPS = 4

if triton is not None:

    @triton.jit
    def swiglu_fwd_kernel(gu, h, H, BLOCK: tl.constexpr):
        """Row program_id(0), columns program_id(1)·BLOCK..: h = silu(g) ⊙ u, fp32 inside."""
        i_r, i_c = tl.program_id(0).to(tl.int64), tl.program_id(1)
        o_c = i_c * BLOCK + tl.arange(0, BLOCK)
        m_c = o_c < H
        p_g = gu + i_r * 2 * H + o_c
        b_g = tl.load(p_g, mask=m_c, other=0.0).to(tl.float32)
        b_u = tl.load(p_g + H, mask=m_c, other=0.0).to(tl.float32)
        b_h = b_g * tl.sigmoid(b_g) * b_u
        tl.store(h + i_r * H + o_c, b_h.to(h.dtype.element_ty), mask=m_c)

    @triton.jit
    def swiglu_bwd_kernel(gu, dh, dgu, h, H, BLOCK: tl.constexpr):
        """The same tile: dg = dh ⊙ u ⊙ silu'(g), du = dh ⊙ silu(g) into ``dgu`` (laid out like
        ``gu``), and h recomputed for the weight gradient."""
        i_r, i_c = tl.program_id(0).to(tl.int64), tl.program_id(1)
        o_c = i_c * BLOCK + tl.arange(0, BLOCK)
        m_c = o_c < H
        o_gu = i_r * 2 * H + o_c
        o_h = i_r * H + o_c
        b_g = tl.load(gu + o_gu, mask=m_c, other=0.0).to(tl.float32)
        b_u = tl.load(gu + o_gu + H, mask=m_c, other=0.0).to(tl.float32)
        b_dh = tl.load(dh + o_h, mask=m_c, other=0.0).to(tl.float32)
        b_s = tl.sigmoid(b_g)
        b_silu = b_g * b_s
        b_dg = b_dh * b_u * b_s * (1.0 + b_g * (1.0 - b_s))
        tl.store(dgu + o_gu, b_dg.to(dgu.dtype.element_ty), mask=m_c)
        tl.store(dgu + o_gu + H, (b_dh * b_silu).to(dgu.dtype.element_ty), mask=m_c)
        tl.store(h + o_h, (b_silu * b_u).to(h.dtype.element_ty), mask=m_c)


def _grid(rows: int, hidden: int) -> tuple[int, int]:
    return (rows, triton.cdiv(hidden, BLOCK))


# ``w`` is the master weight, whose gradient the operators return in its dtype; ``wc`` is it in
# gu's dtype (``w`` itself when they agree), the products' operand. Cast once, outside, where
# inductor forms it, it is saved for the backward rather than cast again there; and the weight
# gradient comes out of its product in w's dtype (fp32 accumulation written as it is), not
# rounded to gu's and cast back: two small kernels fewer in each layer's backward.


@torch.library.custom_op("m3run::swiglu_down", mutates_args=())
def swiglu_down_op(gu: Tensor, w: Tensor, wc: Tensor) -> Tensor:
    """(…, 2·d_hidden) gate/up, (d_model, d_hidden) down weight → (…, d_model) in gu's dtype."""
    hidden = w.shape[1]
    rows = gu.numel() // (2 * hidden)
    h = gu.new_empty(*gu.shape[:-1], hidden)
    swiglu_fwd_kernel[_grid(rows, hidden)](gu, h, hidden, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return torch.nn.functional.linear(h, wc)


@swiglu_down_op.register_fake
def _(gu, w, wc):
    return gu.new_empty(*gu.shape[:-1], w.shape[0])


@torch.library.custom_op("m3run::swiglu_down_bwd", mutates_args=())
def swiglu_down_bwd_op(gu: Tensor, w: Tensor, wc: Tensor, dy: Tensor) -> tuple[Tensor, Tensor]:
    """The gradients of :func:`swiglu_down_op`: d(gu) in gu's dtype, dw in w's."""
    hidden, d_model = w.shape[1], w.shape[0]
    rows = gu.numel() // (2 * hidden)
    dy = dy.reshape(rows, d_model).to(gu.dtype)
    dh = torch.mm(dy, wc)  # (rows, d_hidden)
    dgu, h = torch.empty_like(gu), gu.new_empty(rows, hidden)
    swiglu_bwd_kernel[_grid(rows, hidden)](gu, dh, dgu, h, hidden, BLOCK=BLOCK, num_warps=NUM_WARPS)
    if h.is_cuda and w.dtype != h.dtype:  # cuBLAS writes its fp32 accumulator in w's dtype
        return dgu, torch.mm(dy.t(), h, out_dtype=w.dtype)
    return dgu, torch.mm(dy.t(), h).to(w.dtype)


@swiglu_down_bwd_op.register_fake
def _(gu, w, wc, dy):
    return torch.empty_like(gu), torch.empty_like(w)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy):
    gu, w, wc = ctx.saved_tensors
    return (*swiglu_down_bwd_op(gu.contiguous(), w, wc, dy.contiguous()), None)


swiglu_down_op.register_autograd(_backward, setup_context=_setup_context)


def swiglu_down(gu: Tensor, w: Tensor) -> Tensor:
    """``down(silu(g) ⊙ u)`` through the Triton kernels: ``gu`` (…, 2·d_hidden) on a CUDA device
    in bf16, fp16 or fp32, ``w`` (d_model, d_hidden). Callers choose it through the model's
    backend (model.layers.SwiGLU); on a machine without Triton it raises."""
    if TRITON_IMPORT_ERROR is not None:
        raise RuntimeError(TRITON_IMPORT_ERROR)
    if gu.dtype not in DTYPES:
        raise ValueError(
            f"the SwiGLU kernels take gu in {DTYPES} (fp32 inside), got {gu.dtype}; use "
            'backend="pytorch"'
        )
    if gu.shape[-1] != 2 * w.shape[1]:
        raise ValueError(
            f"gu's last dim must be 2·d_hidden = {2 * w.shape[1]} (w is {tuple(w.shape)}), "
            f"got {gu.shape[-1]}"
        )
    return swiglu_down_op(gu.contiguous(), w, w.to(gu.dtype))
