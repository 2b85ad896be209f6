"""Small building blocks: RMSNorm and the SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """Weight-only RMSNorm (no bias), computed in fp32 and cast back to the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class SwiGLU(nn.Module):
    """SwiGLU MLP (Shazeer 2020): down(silu(gate(x)) ⊙ up(x)); gate and up fused in one matmul."""

    def __init__(self, d_model: int, d_hidden: int):
        super().__init__()
        self.d_hidden = d_hidden
        self.gate_up = nn.Linear(d_model, 2 * d_hidden, bias=False)  # order: [gate, up]
        self.down = nn.Linear(d_hidden, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).split(self.d_hidden, dim=-1)
        return self.down(F.silu(gate) * up)
