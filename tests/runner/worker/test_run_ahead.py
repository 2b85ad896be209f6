"""The next step's first forward, queued before a step's host read (Trainer._runs_ahead): a
trainer that runs ahead computes bitwise what one that does not computes, through a non-finite
step and its retry, and its data position at every step boundary (what a checkpoint saves) is
the same. On CUDA the update runs beside that forward on a stream of its own, layer by layer
(update.LayeredStep), and the same holds against a trainer doing neither."""

from __future__ import annotations

import pytest
import torch
from helpers.runs import DEMO_CONFIG, tiny_run_overrides

from m3run.runner.config import load_config
from m3run.runner.worker.trainer import Trainer

STEPS = 8
# On the GPU: bf16, fused AdamW, two micro-batches a step, deterministic kernels.
CUDA_RUN = {
    "train.device": "cuda",
    "train.precision": "bf16",
    "train.grad_accum_steps": 2,
    "train.deterministic": "true",
}
ON_CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.cuda,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    ],
)


def _train(corpus, run_dir, monkeypatch, device: str, overlap: bool) -> tuple[list, ...]:
    """STEPS train_step()s, step 4 poisoned: each step's result, data position and whether a
    forward was left ahead, and the final weights. ``overlap``: the forward run ahead and (on
    CUDA) the update beside it, or neither (the trainer's ``overlap``)."""
    monkeypatch.setenv("M3RUN_FAULT", "nan_at_step=4")
    extra = {"train.total_steps": STEPS, **(CUDA_RUN if device == "cuda" else {})}
    overrides = tiny_run_overrides(corpus, **extra)
    trainer = Trainer(load_config(DEMO_CONFIG, overrides), run_dir, resume="none", overlap=overlap)
    outs, positions, ahead = [], [], []
    try:
        trainer.setup()
        # The update runs beside the forward exactly where it should.
        assert (trainer.update.side is not None) == (overlap and device == "cuda")
        trainer.model.train()
        while trainer.step < STEPS:
            outs.append(trainer.train_step())
            positions.append(trainer.loader.state_dict()["windows_consumed"])
            ahead.append(trainer._ahead is not None)
        weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    finally:
        trainer.close()
    return outs, positions, ahead, weights


def _nan_named(outs: list[dict]) -> list[dict]:
    return [{k: "nan" if v != v else v for k, v in out.items()} for out in outs]


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
def test_running_ahead_changes_no_loss_weight_or_data_position(
    corpus, tmp_path, monkeypatch, device
):
    outs, positions, ahead, weights = _train(corpus, tmp_path / "ahead", monkeypatch, device, True)
    ref_outs, ref_positions, ref_ahead, ref_weights = _train(
        corpus, tmp_path / "plain", monkeypatch, device, False
    )
    # One attempt more than steps: step 4 was non-finite, skipped and retried on the next data.
    assert len(outs) == STEPS + 1 and [bool(o.get("bad")) for o in outs].count(True) == 1
    assert outs[3]["bad"] and outs[4]["loss"] == outs[4]["loss"]
    # Float equality (NaN as a string): the same losses, gradient norms and lrs.
    assert _nan_named(outs) == _nan_named(ref_outs)
    assert positions == ref_positions
    # Every attempt but the last ran the next one's first forward ahead; the plain trainer none.
    assert ahead == [True] * STEPS + [False] and not any(ref_ahead)
    assert weights.keys() == ref_weights.keys()
    assert all(torch.equal(weights[k], ref_weights[k]) for k in weights)
