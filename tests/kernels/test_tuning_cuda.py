"""The launch-plan tuner's pieces on a GPU (kernels/mamba3/tools/tuning.py): a recorded forward and
backward holds every kernel's launch, the backward's included, which the autograd engine runs on
a thread of its own; and a plan forced on the process reaches that thread, so the scan under
plans of different chunks is the same function. CUDA only."""

from __future__ import annotations

import pytest
import torch

from m3run.kernels.mamba3 import plans as lp
from m3run.kernels.mamba3.tools import tuning

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton scan needs a CUDA GPU"),
]

SHAPE = tuning.Shape(2, 256, 4, 64, 64, 16, 1, torch.bfloat16, reset=True)


def _grads(x: dict, plan: lp.Plan) -> list[torch.Tensor]:
    with lp.launch_plans().forcing(plan):
        y = tuning._scan(x, plan.chunk)
        y.float().square().sum().backward()
    out = [y.detach().float()] + [v.grad.float().clone() for v in x.values() if v.grad is not None]
    for v in x.values():
        v.grad = None
    return out


def test_a_recorded_forward_and_backward_holds_every_kernel():
    x = tuning.scan_inputs(SHAPE, torch.device("cuda"))
    launches = tuning.record(x, lp.Plan(64, dict(lp.DEFAULT_CONFIGS)))
    assert set(lp.KERNELS) <= set(launches), sorted(launches)
    assert launches["bwd_chunk"].cfg == lp.DEFAULT_CONFIGS["bwd_chunk"]


def test_a_forced_plan_reaches_the_backward_at_every_chunk():
    x = tuning.scan_inputs(SHAPE, torch.device("cuda"))
    want = _grads(x, lp.Plan(32, dict(lp.DEFAULT_CONFIGS)))
    for chunk in (16, 64):
        got = _grads(x, lp.Plan(chunk, dict(lp.DEFAULT_CONFIGS)))
        for a, b in zip(got, want, strict=True):
            assert torch.linalg.norm(a - b) <= 5e-2 * torch.linalg.norm(b), chunk  # garbage if not
