"""The Triton AdamW (kernels/adamw.py) on a GPU: the checks of interpret_adamw.py (weights and
moments within fp32 rounding of torch's AdamW, the gradient scale, a skipped step that changes
nothing, an unaligned gradient, the state_dict to torch's fused AdamW and back), compiled for the
device; and the trainer's optimizer on CUDA is it. CUDA only."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the AdamW kernel needs a CUDA GPU"),
]


def test_triton_adamw_matches_torch_adamw_on_the_gpu():
    from interpret_adamw import check

    check("cuda")


def test_the_trainer_builds_the_triton_adamw_on_cuda():
    from kernels.adamw import TritonAdamW
    from model import Mamba3LM
    from model.config import ModelConfig
    from runner.config import TrainConfig
    from runner.worker.build import build_optimizer

    train = TrainConfig(total_steps=10, micro_batch_size=2, lr=1e-3, warmup_steps=1)
    with torch.device("cuda"):
        model = Mamba3LM(ModelConfig.preset("tiny", scan_backend="auto"))
    opt = build_optimizer(model, torch.device("cuda"), train, lr=1e-3)
    assert isinstance(opt, TritonAdamW) and opt.defaults["fused"]
