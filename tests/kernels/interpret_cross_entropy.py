"""Run by test_triton_cpu.py in the Triton interpreter (TRITON_INTERPRET=1, set before Triton
loads): the cross-entropy kernel (kernels/cross_entropy.py) in fp32 against the PyTorch chunked
loss in float64 (the loss and both gradients), with ignored targets, padding columns past
n_classes and a vocabulary that spans two of the kernel's column blocks and ends inside the
second; the operator's own outputs on an all-ignored chunk (loss 0, gradient 0); the same under
torch.compile with fullgraph (bitwise); and torch.library.opcheck. Prints "ok" at the end."""

from __future__ import annotations

import interpret_scan  # noqa: F401  (importing it patches the interpreter's loop bounds)
import torch

from m3run.kernels import cross_entropy
from m3run.model.loss import LinearCrossEntropy


def run(hidden, weight, targets, n_classes, kernel: bool):
    """The loss and its gradients through the chunked Function, the kernel's path or not."""
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = LinearCrossEntropy.apply(hidden, weight, targets, 5, n_classes, kernel)
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad


def main() -> None:
    torch.manual_seed(0)
    rows, d, v, n_classes = 12, 8, cross_entropy.BLOCK + 200, cross_entropy.BLOCK + 150
    hidden = torch.randn(rows, d, dtype=torch.float64)
    weight = torch.randn(v, d, dtype=torch.float64)
    targets = torch.randint(0, n_classes, (rows,))
    targets[[1, 7]] = cross_entropy.IGNORE_INDEX
    targets[3] = n_classes - 1  # the last class, in the second block
    want = run(hidden, weight, targets, n_classes, kernel=False)
    got = run(hidden.float(), weight.float(), targets, n_classes, kernel=True)
    for name, a, b in zip(("loss", "dhidden", "dweight"), got, want, strict=True):
        assert a.dtype == torch.float32 and a.shape == b.shape, (name, a.dtype, a.shape, b.shape)
        err = ((a.double() - b).norm() / b.norm()).item()
        assert err < 1e-5, f"{name}: relative error {err:.2e}"
    assert not got[2][n_classes:].any(), "a padding row of the head got a gradient"

    logits = torch.randn(3, v)
    none = torch.full((3,), cross_entropy.IGNORE_INDEX)
    grad, loss = cross_entropy.ce_grad(logits, none, torch.tensor(1.0), n_classes)
    assert not grad.any() and not loss.any(), "an ignored row got a loss or a gradient"

    compiled = torch.compile(cross_entropy.ce_grad, backend="aot_eager", fullgraph=True)
    args = (logits, targets[:3], torch.tensor(0.25), n_classes)
    for a, b in zip(compiled(*args), cross_entropy.ce_grad(*args), strict=True):
        assert torch.equal(a, b), "compiled differs from eager"
    torch.library.opcheck(cross_entropy.ce_grad_op, args)
    print("ok")


if __name__ == "__main__":
    main()
