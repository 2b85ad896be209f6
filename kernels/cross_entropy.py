"""The softmax half of the chunked linear cross-entropy (model/loss.py) as one Triton kernel.

For a chunk of logits (rows × vocab, the head's matmul output in the compute dtype), one program
per row reads the row twice: the running max and sum of exponentials over blocks of columns,
then the gradient of the mean loss, ``(softmax − onehot)/n_valid``, written in the logits'
dtype. It returns each row's loss ``lse − logit[target]`` in fp32 (0 on ignored rows, whose
gradient is 0). It is faster than the compiled PyTorch form it replaces and runs near the
memory's bandwidth, counting both reads and the write, so only a row kept on chip would be
faster.

Columns from ``n_classes`` on are padding of the tied embedding: no class, a gradient of 0.
Opaque to torch.compile like the other operators here (a custom op).
"""

from __future__ import annotations

import torch
from torch import Tensor

from m3run.kernels import IGNORE_INDEX
from m3run.kernels.mamba3.triton_common import DTYPES, TRITON_IMPORT_ERROR, tl, triton

BLOCK = 2048  # columns per step of a row: 8 per thread at 8 warps (timed against 1024-8192
NUM_WARPS = 8  # columns, 4-16 warps and a grid of fewer programs taking rows in turn)

if triton is not None:

    @triton.jit
    def ce_grad_kernel(
        logits, targets, inv_n, grad, loss, V, NC, IGNORE: tl.constexpr, BLOCK: tl.constexpr
    ):
        """Row program_id(0) of ``logits`` (rows × V, contiguous): its loss into ``loss`` and
        its gradient into ``grad`` (same layout); classes are the first NC columns."""
        i_r = tl.program_id(0).to(tl.int64)
        p_x = logits + i_r * V
        p_g = grad + i_r * V
        o_c = tl.arange(0, BLOCK)
        # Per lane, the running max and sum of exp(x − max): no reduction across the program
        # inside the loop (-1e30, not -inf, so that a lane with no class yet stays finite).
        b_m = tl.full([BLOCK], -1e30, tl.float32)
        b_s = tl.zeros([BLOCK], tl.float32)
        for c0 in range(0, NC, BLOCK):
            b_x = tl.load(p_x + c0 + o_c, mask=c0 + o_c < NC, other=float("-inf")).to(tl.float32)
            b_new = tl.maximum(b_m, b_x)
            b_s = b_s * tl.exp(b_m - b_new) + tl.exp(b_x - b_new)
            b_m = b_new
        m = tl.max(b_m, axis=0)
        lse = m + tl.log(tl.sum(b_s * tl.exp(b_m - m), axis=0))

        tgt = tl.load(targets + i_r)
        ok = tgt != IGNORE
        safe = tl.where(ok, tgt, 0)
        picked = tl.load(p_x + safe).to(tl.float32)
        tl.store(loss + i_r, tl.where(ok, lse - picked, 0.0))
        scale = tl.where(ok, tl.load(inv_n), 0.0)
        for c0 in range(0, V, BLOCK):
            o_v = c0 + o_c
            b_x = tl.load(p_x + o_v, mask=o_v < NC, other=float("-inf")).to(tl.float32)
            b_g = (tl.exp(b_x - lse) - tl.where(o_v == safe, 1.0, 0.0)) * scale  # 0 on padding
            tl.store(p_g + o_v, b_g.to(grad.dtype.element_ty), mask=o_v < V)


@torch.library.custom_op("m3run::ce_grad", mutates_args=())
def ce_grad_op(logits: Tensor, targets: Tensor, inv_n: Tensor, n_classes: int) -> tuple[
    Tensor, Tensor
]:  # fmt: skip
    """(rows, V) logits, (rows,) int64 targets, a 0-d fp32 1/n_valid → the gradient of the
    mean loss w.r.t. the logits (their dtype) and the per-row loss (fp32)."""
    rows, v = logits.shape
    grad = torch.empty_like(logits)
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        ce_grad_kernel[(rows,)](
            logits,
            targets,
            inv_n,
            grad,
            loss,
            v,
            n_classes,
            IGNORE=IGNORE_INDEX,
            BLOCK=BLOCK,
            num_warps=NUM_WARPS,
        )
    return grad, loss


@ce_grad_op.register_fake
def _(logits, targets, inv_n, n_classes):
    return torch.empty_like(logits), logits.new_empty(logits.shape[0], dtype=torch.float32)


def ce_grad(logits: Tensor, targets: Tensor, inv_n: Tensor, n_classes: int) -> tuple[
    Tensor, Tensor
]:  # fmt: skip
    """:func:`ce_grad_op` with its inputs checked: ``logits`` (rows, V) on a CUDA device (or
    in the Triton interpreter) in bf16, fp16 or fp32, ``targets`` (rows,) in 0..n_classes−1 or
    -100; callers choose it through the model's backend (model/loss.py)."""
    if TRITON_IMPORT_ERROR is not None:
        raise RuntimeError(TRITON_IMPORT_ERROR)
    if logits.dtype not in DTYPES:
        raise ValueError(
            f"the cross-entropy kernel takes logits in {DTYPES} (fp32 inside), got "
            f'{logits.dtype}; use backend="pytorch"'
        )
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(
            f"logits must be (rows, V) and targets (rows,), got {tuple(logits.shape)} and "
            f"{tuple(targets.shape)}"
        )
    if not 1 <= n_classes <= logits.shape[1]:
        raise ValueError(f"n_classes must be in 1..{logits.shape[1]}, got {n_classes}")
    return ce_grad_op(
        logits.contiguous(), targets.contiguous(), inv_n.to(torch.float32).reshape(()), n_classes
    )
