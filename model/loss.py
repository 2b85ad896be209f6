"""Cross-entropy of a linear head without materialising (tokens × vocab) fp32 logits.

The logits of a 16×2048-token micro-batch over a 50k vocabulary are 6.6 GB in fp32; autograd
would keep them alive until backward. :class:`LinearCrossEntropy` instead walks the tokens in
chunks, computes each chunk's logits, its loss *and* its gradients in the forward pass, and keeps
only the gradients w.r.t. the hidden states and the head weight (the same idea as the fused
linear cross-entropy of Liger-Kernel, written here in plain PyTorch). Peak extra memory is one
chunk of logits. Under the Triton backend each chunk's softmax, loss and gradient are one
kernel (kernels/cross_entropy.py) instead of the compiled PyTorch form's fused kernels.
"""

from __future__ import annotations

import torch
from torch import Tensor

from m3run.kernels import IGNORE_INDEX
from m3run.kernels.mamba3 import uses_triton_kernels

from .layers import autocast_dtype


class LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        chunk_tokens: int,
        n_classes: int,
        use_kernel: bool,
    ):
        # hidden (n, d) in the compute dtype, weight (v, d) master (fp32), targets (n,) int64;
        # rows n_classes.. of weight are padding: their logits are -inf, so their gradient is 0.
        n = hidden.shape[0]
        valid = targets != IGNORE_INDEX
        n_valid = valid.sum()
        # fp32 softmax and accumulation; float64 stays float64 so tests can be exact.
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        denom = n_valid.clamp(min=1).to(acc)
        w = weight.to(hidden.dtype)
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_grad else None
        grad_weight = torch.zeros_like(weight, dtype=acc) if need_grad else None
        loss_sum = torch.zeros((), dtype=acc, device=hidden.device)
        if use_kernel:  # chosen by linear_cross_entropy (or a CPU test, in the interpreter)
            from m3run.kernels.cross_entropy import ce_grad

            inv_n = 1.0 / denom
        else:
            cols = torch.arange(weight.shape[0], device=hidden.device)
        for start in range(0, n, chunk_tokens):
            h = hidden[start : start + chunk_tokens]
            tgt = targets[start : start + chunk_tokens]
            if use_kernel:
                g_c, row_loss = ce_grad(h @ w.t(), tgt, inv_n, n_classes)
            else:
                g_c, row_loss = _softmax_grad(
                    h @ w.t(), tgt, cols, n_classes, denom, acc, need_grad
                )
            loss_sum += row_loss.sum()
            if need_grad:
                grad_hidden[start : start + chunk_tokens] = g_c @ w
                grad_weight += (g_c.t() @ h).to(acc)
        ctx.weight_dtype = weight.dtype
        if need_grad:
            ctx.save_for_backward(grad_hidden, grad_weight)
        return loss_sum / denom

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        gh = grad_hidden * grad_out.to(grad_hidden.dtype) if ctx.needs_input_grad[0] else None
        gw = (grad_weight * grad_out).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        return gh, gw, None, None, None, None


def _softmax_grad(
    logits: Tensor,
    tgt: Tensor,
    cols: Tensor,
    n_classes: int,
    denom: Tensor,
    acc: torch.dtype,
    need_grad: bool,
) -> tuple[Tensor | None, Tensor]:
    """The PyTorch form of one chunk's step from its logits (c, v), in the compute dtype: the
    gradient of the mean loss in that dtype (None without ``need_grad``) and each row's loss
    (in ``acc``; 0 on ignored rows).

    Every step is elementwise or a row reduction (no in-place write, no scatter), so that under
    torch.compile they fuse into kernels that read the compute-dtype logits and write the
    compute-dtype gradient, and no fp32 (chunk × vocab) tensor reaches memory: a scatter of the
    −1 and a masked fill made inductor write an fp32 gradient and read it back to scale it."""
    ok = tgt != IGNORE_INDEX
    safe_tgt = torch.where(ok, tgt, 0)
    dtype = logits.dtype
    logits = logits.to(acc)  # (c, v): the only fp32 logits ever alive
    if n_classes < logits.shape[1]:
        logits = torch.where(cols < n_classes, logits, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, safe_tgt[:, None]).squeeze(1)
    row_loss = torch.where(ok, lse - picked, 0.0)
    if not need_grad:
        return None, row_loss
    # d(mean CE)/d logits = (softmax - onehot) / n_valid on valid rows, 0 elsewhere.
    onehot = (cols == safe_tgt[:, None]).to(acc)
    g = (torch.exp(logits - lse[:, None]) - onehot) * (ok.to(acc) / denom)[:, None]
    return g.to(dtype), row_loss


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    chunk_tokens: int = 4096,
    n_classes: int | None = None,
    backend: str = "pytorch",
) -> Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``targets`` (ignore_index -100).

    ``hidden`` (..., d), ``weight`` (rows, d), ``targets`` (...). The matmuls run in hidden's
    dtype (bf16 under autocast), the softmax in fp32. With ``n_classes`` < rows, the rows from
    ``n_classes`` on are padding and no class: pass the padded embedding of a tied head, whose
    row count (a multiple of 64) keeps the logits' rows aligned. cuBLAS runs a 50,257-wide
    GPT-2 head on its unaligned fallback kernels, several times slower. ``backend`` is the
    model's kernel choice (model.scan_backend): where it resolves to Triton, each chunk's
    softmax and gradient run in one kernel (kernels/cross_entropy.py).
    """
    n_classes = weight.shape[0] if n_classes is None else n_classes
    if not 1 <= n_classes <= weight.shape[0]:
        raise ValueError(
            f"n_classes must be in 1..{weight.shape[0]} (weight rows), got {n_classes}"
        )
    d = hidden.shape[-1]
    hidden = hidden.to(autocast_dtype(hidden))
    with torch.autocast(hidden.device.type, enabled=False):
        use_kernel = uses_triton_kernels(backend, hidden)
        out = LinearCrossEntropy.apply(
            hidden.reshape(-1, d), weight, targets.reshape(-1), chunk_tokens, n_classes, use_kernel
        )
    return out.to(weight.dtype)
