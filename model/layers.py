"""Small building blocks: RMSNorm and the SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from m3run.kernels.mamba3 import uses_triton_kernels


def autocast_dtype(x: Tensor) -> torch.dtype:
    """The dtype autocast computes in on x's device where it is on, else x's own."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def linear_rows(x: Tensor, w: Tensor, sizes: list[int], backend: str) -> list[Tensor]:
    """``x · w[rows]ᵀ`` for consecutive row blocks of ``w``, ``sizes`` rows each (one block:
    the plain linear). Where ``backend`` (model.scan_backend) resolves to Triton, through the
    operator of kernels/linear.py (computed in the autocast dtype as F.linear would be; the
    backward writes w's fp32 gradient from the products themselves); else F.linear a block."""
    if uses_triton_kernels(backend, x):
        from m3run.kernels.linear import linear_rows as op

        return op(x, w, sizes, autocast_dtype(x))
    if len(sizes) == 1:
        return [F.linear(x, w)]
    return [F.linear(x, w_i) for w_i in w.split(sizes)]


class RMSNorm(nn.Module):
    """Weight-only RMSNorm (no bias), computed in fp32 (float64 for float64 input: the exact
    tests' models are float64 throughout) and cast back to the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        w = self.weight.to(acc)
        return F.rms_norm(x.to(acc), (x.shape[-1],), w, self.eps).to(x.dtype)

    def add(self, x: Tensor, delta: Tensor, backend: str = "pytorch") -> tuple[Tensor, Tensor]:
        """``(s, norm(s))`` for ``s = x + delta``: a residual add and this norm after it. Where
        ``backend`` (model.scan_backend) resolves to Triton and the stream is fp32, through the
        operator of kernels/add_rms_norm.py (the norm in delta's dtype; one backward kernel
        writes the stream's gradient and its copy in delta's dtype); else the plain add and
        :meth:`forward`."""
        if x.dtype == torch.float32 and uses_triton_kernels(backend, delta):
            from m3run.kernels.add_rms_norm import add_rms_norm

            return add_rms_norm(x, delta, self.weight, self.eps)
        s = x + delta
        return s, self(s)


class SwiGLU(nn.Module):
    """SwiGLU MLP (Shazeer 2020): down(silu(gate(x)) ⊙ up(x)); gate and up fused in one matmul.

    ``backend`` is the model's kernel choice (model.scan_backend): where it resolves to Triton,
    the gate, the product and the down projection run as one custom operator whose backward
    recomputes the hidden activation instead of saving it (kernels/swiglu.py). Under "auto",
    dtypes the kernels do not take (float64) run the plain module, as the scan does."""

    def __init__(self, d_model: int, d_hidden: int, backend: str = "pytorch"):
        super().__init__()
        self.d_hidden = d_hidden
        self.backend = backend
        self.gate_up = nn.Linear(d_model, 2 * d_hidden, bias=False)  # order: [gate, up]
        self.down = nn.Linear(d_hidden, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        (gu,) = linear_rows(x, self.gate_up.weight, [self.gate_up.out_features], self.backend)
        if uses_triton_kernels(self.backend, gu):
            from m3run.kernels import swiglu

            return swiglu.swiglu_down(gu, self.down.weight)
        gate, up = gu.split(self.d_hidden, dim=-1)
        return self.down(F.silu(gate) * up)
