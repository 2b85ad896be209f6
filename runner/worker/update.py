"""The optimizer update behind the non-finite guard: a step whose mean loss or gradient norm is
not finite leaves the weights, the optimizer's moments and its step count as they were.

Where the optimizer has no fused kernel, the host reads the two numbers and then steps or not.
With fused AdamW (the trainer's on CUDA) the update is queued first and skipped inside the kernel
through the optimizer's ``found_inf`` input (the one a gradient scaler sets: the kernel leaves
every tensor untouched and the step count is taken back); on CUDA the host reads the two numbers
while the GPU works through the update. Read before it, they left the GPU idle for the host's
round trip and the update's launch, 0.8–1.7 ms of every 434m step on an H200
(docs/benchmarks.md). The gradients are dropped (``zero_grad(set_to_none=True)``) before the
host waits too: their memory goes back to the allocator in stream order, so the update still
reads them, and the host's walk over the parameters (0.7 ms at the 434m preset under the
profiler) runs while the GPU works through the update.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


class GuardedUpdate:
    """``update(loss, grad_norm)`` → the two as floats, the optimizer stepped unless either is
    non-finite and the gradients dropped either way; or ``read(queue(loss, grad_norm))``, with
    other work queued between the two. Its one host sync is the step's."""

    # Off: the host reads the two numbers before the update whatever the optimizer; for the
    # benchmark's comparison, bench_train.py --variant
    # NAME:@runner.worker.update.GuardedUpdate.IN_KERNEL=0.
    IN_KERNEL = True

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device):
        self.optimizer = optimizer
        self.in_kernel = self.IN_KERNEL and bool(optimizer.defaults.get("fused"))
        self._host = self._ready = None
        if self.in_kernel and device.type == "cuda":
            self._host = torch.empty(2, dtype=torch.float32, pin_memory=True)
            self._ready = torch.cuda.Event()

    def __call__(self, loss: Tensor, grad_norm: Tensor) -> tuple[float, float]:
        return self.read(self.queue(loss, grad_norm))

    def queue(self, loss: Tensor, grad_norm: Tensor) -> tuple[float, float] | None:
        """The update queued (or, on the host's path, done) and the gradients dropped; returns
        what :meth:`read` takes. Between the two the host may queue more work (the trainer
        queues the next step's first forward there)."""
        stats = torch.stack([loss.detach().float(), grad_norm.detach().float()])
        queued = None  # CUDA, in the kernel: read() waits for the numbers
        if not self.in_kernel:
            queued = tuple(stats.tolist())
            if all(map(math.isfinite, queued)):
                self.optimizer.step()
        else:
            # 1.0 when either is non-finite: the kernel then skips the update. 0-dim, as the
            # step counts it is subtracted from.
            self.optimizer.found_inf = (~stats.isfinite().all()).float()
            if self._host is not None:
                self._host.copy_(stats, non_blocking=True)
                self._ready.record()
            self.optimizer.step()
            if self._host is None:  # on the CPU the numbers are there already
                queued = tuple(stats.tolist())
        self.optimizer.zero_grad(set_to_none=True)
        return queued

    def read(self, queued: tuple[float, float] | None) -> tuple[float, float]:
        """The step's loss and gradient norm as floats: the step's one host sync on CUDA."""
        if queued is not None:
            return queued
        self._ready.synchronize()
        loss_f, norm_f = self._host.tolist()
        return loss_f, norm_f
