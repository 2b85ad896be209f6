"""The optimizer update behind the non-finite guard: a step whose mean loss or gradient norm is
not finite leaves the weights, the optimizer's moments and its step count as they were. The
gradient clip is part of the update: given the gradients' total norm and the clip's bound, the
host path clips them in place before the step (``clip_grads_with_norm_``), the fused path passes
the clip's divisor to the kernel as its ``grad_scale`` (no pass over the gradients of its own,
which the kernel reads anyway).

Where the optimizer has no fused kernel, the host reads the two numbers and then steps or not. With
fused AdamW (the trainer's on CUDA) the update is queued first and skipped inside the kernel through
the optimizer's ``found_inf`` input (the one a gradient scaler sets: the kernel leaves every tensor
untouched and the step count is taken back); on CUDA the host reads the two numbers while the GPU
works through the update. Read before it, they left the GPU idle for the host's round trip and the
update's launch, in every step. The gradients are dropped (``zero_grad(set_to_none=True)``) before
the host waits too: their memory goes back to the allocator in stream order, so the update still
reads them, and the host's walk over the parameters (one call per parameter) runs while the GPU
works through the update.

Given the model's layers (the trainer's, on CUDA, without DDP), the update runs on a stream of
its own, layer by layer (:class:`LayeredStep`), beside the next step's first forward, which
waits for each layer's update just before it uses that layer, so most of the update overlaps
the forward instead of preceding it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


class GuardedUpdate:
    """``update(loss, grad_norm, max_norm)`` → the loss and the norm as floats, the gradients
    clipped to ``max_norm`` (None: not clipped) and the optimizer stepped unless either number
    is non-finite, the gradients dropped either way; or ``read(queue(...))``, with other work
    queued between the two. Its one host sync is the step's."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        layers: list[list[Tensor]] | None = None,
    ):
        self.optimizer = optimizer
        self.in_kernel = bool(optimizer.defaults.get("fused"))
        self._host = self._ready = None
        self.side: LayeredStep | None = None  # the update beside the next forward
        if self.in_kernel and device.type == "cuda":
            self._host = torch.empty(2, dtype=torch.float32, pin_memory=True)
            self._ready = torch.cuda.Event()
            if layers is not None:
                self.side = LayeredStep(optimizer, layers)

    def __call__(
        self, loss: Tensor, grad_norm: Tensor, max_norm: float | None = None
    ) -> tuple[float, float]:
        return self.read(self.queue(loss, grad_norm, max_norm))

    def queue(
        self, loss: Tensor, grad_norm: Tensor, max_norm: float | None = None
    ) -> tuple[float, float] | None:
        """The update queued (or, on the host's path, done) and the gradients dropped; returns
        what :meth:`read` takes. Between the two the host may queue more work (the trainer
        queues the next step's first forward there)."""
        stats = torch.stack([loss.detach().float(), grad_norm.detach().float()])
        queued = None  # CUDA, in the kernel: read() waits for the numbers
        if not self.in_kernel:
            queued = tuple(stats.tolist())
            if all(map(math.isfinite, queued)):
                if max_norm is not None:
                    torch.nn.utils.clip_grads_with_norm_(self._params(), max_norm, grad_norm)
                self.optimizer.step()
        else:
            # 1.0 when either is non-finite: the kernel then skips the update. 0-dim, as the
            # step counts it is subtracted from.
            self.optimizer.found_inf = (~stats.isfinite().all()).float()
            # The kernel divides every gradient by it: clip_grad_norm_'s coefficient
            # max_norm / (norm + 1e-6), at most 1, inverted.
            self.optimizer.grad_scale = (
                None if max_norm is None else ((stats[1] + 1e-6) / max_norm).clamp(min=1.0)
            )
            if self._host is not None:
                self._host.copy_(stats, non_blocking=True)
                self._ready.record()
            if self.side is not None:
                self.side.step()
            else:
                self.optimizer.step()
            if self._host is None:  # on the CPU the numbers are there already
                queued = tuple(stats.tolist())
        self.optimizer.zero_grad(set_to_none=True)
        return queued

    def _params(self) -> list[Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def read(self, queued: tuple[float, float] | None) -> tuple[float, float]:
        """The step's loss and gradient norm as floats: the step's one host sync on CUDA."""
        if queued is not None:
            return queued
        self._ready.synchronize()
        loss_f, norm_f = self._host.tolist()
        if self.side is not None:  # what the stream runs from here on sees the whole update
            torch.cuda.current_stream().wait_stream(self.side.stream)
        return loss_f, norm_f


class LayeredStep:
    """The fused optimizer's step on a stream of its own, one layer at a time, each layer's end
    marked by an event that the next forward waits on before that layer (:meth:`wait`, the
    model's ``before_layer``). The update, bound by memory bandwidth, then runs beside the next
    forward's first layers, bound by the tensor cores, instead of before all of them.

    ``layers`` lists the parameters in the order the forward uses them, a list a layer; a
    parameter of the optimizer in none of them joins the last. The arithmetic is the fused
    kernel's, element by element, so the weights are bitwise those of one ``step()``.
    Everything queued on the main stream after :meth:`GuardedUpdate.read` waits for the whole
    update; in between, only a forward that waits layer by layer may run."""

    def __init__(self, optimizer: torch.optim.Optimizer, layers: list[list[Tensor]]):
        self.optimizer = optimizer
        self.stream = torch.cuda.Stream()
        where = {id(p): i for i, layer in enumerate(layers) for p in layer}
        last = len(layers) - 1
        # Per layer, per optimizer group: the group's parameters in that layer.
        self.parts: list[list[list[Tensor]]] = [
            [[] for _ in optimizer.param_groups] for _ in layers
        ]
        for gi, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                self.parts[where.get(id(p), last)][gi].append(p)
        self.events = [torch.cuda.Event() for _ in layers]

    def step(self) -> None:
        """Queue the update layer by layer on the side stream, after everything queued so far
        on the main one (the gradients, the clip's scale, the non-finite flag)."""
        opt, main = self.optimizer, torch.cuda.current_stream()
        self.stream.wait_stream(main)
        groups = opt.param_groups
        # Tensors of the main stream the side stream reads: not reused before it has.
        for t in (getattr(opt, "grad_scale", None), getattr(opt, "found_inf", None)):
            if t is not None:
                t.record_stream(self.stream)
        for group in groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.record_stream(self.stream)
        try:
            with torch.cuda.stream(self.stream):
                for parts, event in zip(self.parts, self.events, strict=True):
                    opt.param_groups = [
                        {**g, "params": ps} for g, ps in zip(groups, parts, strict=True) if ps
                    ]
                    opt.step()
                    event.record()
        finally:
            opt.param_groups = groups

    def wait(self, layer: int) -> None:
        """Make the current stream wait for layer ``layer``'s update (a no-op before the first
        update: an event never recorded is complete)."""
        torch.cuda.current_stream().wait_event(self.events[layer])
