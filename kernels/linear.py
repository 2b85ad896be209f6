"""The model's linear products (``x · wᵀ`` over row blocks of one weight) as a custom operator
whose backward writes the weight's gradient in the weight's dtype straight from the product.

Under autocast an fp32 master weight is used in bf16: the product's weight gradient came out of
cuBLAS in bf16 and inductor cast it to fp32 for the parameter in a kernel of its own, one for
each of in_proj, out_proj and gate_up (in_proj's two row blocks through a zero-filled fp32 buffer
that the cast wrote the slices into). cuBLAS takes bf16 operands and writes its fp32
accumulator as it is (``torch.mm(..., out_dtype=torch.float32)``), each row block's into its
rows of the one gradient: no cast, no buffer to fill, and a value rounded once instead of
twice. The input's gradient is the sum over the blocks of ``dyᵢ · wᵢ``: one product, then the
rest added in place by cuBLAS (``addmm_``), never a concatenation of the blocks' gradients.

Opaque to torch.compile like the other operators here: the weight's cast (``wc``) is formed
outside, where inductor computes it once and keeps it for the backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


@torch.library.custom_op("m3run::linear_rows", mutates_args=())
def linear_rows_op(x: Tensor, w: Tensor, wc: Tensor, sizes: list[int]) -> list[Tensor]:
    """(…, K) ``x``, (N, K) ``w`` and its cast ``wc`` in x's dtype, N = Σ sizes → one
    (…, sizes[i]) product a row block, in x's dtype."""
    return [F.linear(x, wc_i) for wc_i in wc.split(sizes)]


@linear_rows_op.register_fake
def _(x, w, wc, sizes):
    return [x.new_empty(*x.shape[:-1], n) for n in sizes]


def _mm_into(out: Tensor, a: Tensor, b: Tensor) -> None:
    """``out = a · b`` with out in its own dtype: cuBLAS writes its fp32 accumulator for bf16 or
    fp16 operands; elsewhere (the CPU) the product in the operands' dtype, then cast."""
    if out.dtype == a.dtype:
        torch.mm(a, b, out=out)
    elif a.is_cuda:
        torch.mm(a, b, out_dtype=out.dtype, out=out)
    else:
        out.copy_(torch.mm(a, b))


@torch.library.custom_op("m3run::linear_rows_bwd", mutates_args=())
def linear_rows_bwd_op(
    x: Tensor, w: Tensor, wc: Tensor, dys: list[Tensor], sizes: list[int]
) -> tuple[Tensor, Tensor]:
    """The gradients of :func:`linear_rows_op`: d(x) in x's dtype, dw in w's."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    dw = torch.empty_like(w)
    dx = None
    for dy, wc_i, dw_i in zip(dys, wc.split(sizes), dw.split(sizes), strict=True):
        dy2 = dy.reshape(-1, wc_i.shape[0]).to(x.dtype)
        if dx is None:
            dx = torch.mm(dy2, wc_i)
        else:
            dx.addmm_(dy2, wc_i)
        _mm_into(dw_i, dy2.t(), x2)
    return dx.view(x.shape), dw


@linear_rows_bwd_op.register_fake
def _(x, w, wc, dys, sizes):
    return torch.empty_like(x), torch.empty_like(w)


def _setup_context(ctx, inputs, output):
    x, w, wc, sizes = inputs
    ctx.save_for_backward(x, w, wc)
    ctx.sizes = sizes


def _backward(ctx, dys):
    x, w, wc = ctx.saved_tensors
    dx, dw = linear_rows_bwd_op(x, w, wc, [dy.contiguous() for dy in dys], ctx.sizes)
    return dx, dw, None, None


linear_rows_op.register_autograd(_backward, setup_context=_setup_context)


def linear_rows(x: Tensor, w: Tensor, sizes: list[int], dtype: torch.dtype) -> list[Tensor]:
    """``[x · w[rows]ᵀ for each row block]`` computed in ``dtype`` (the autocast dtype, or x's),
    the blocks ``sizes`` rows each in order (Σ sizes = w's rows), with the backward above: the
    weight's gradient comes back in ``w``'s dtype, written by the products themselves."""
    if sum(sizes) != w.shape[0] or min(sizes) < 1:
        raise ValueError(
            f"sizes must be positive row counts summing to w's {w.shape[0]} rows, got {sizes}"
        )
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"x's last dim {x.shape[-1]} is not w's {w.shape[1]} columns")
    return linear_rows_op(x.to(dtype).contiguous(), w, w.to(dtype), list(sizes))
