"""The learning-rate schedule: linear warmup, then cosine or WSD decay. Torch-free: the worker
trains by it, and a relaunch that changes it says what the learning rate jumps from and to."""

from __future__ import annotations

import math

from m3run.runner.config import RunConfig


def lr_at(cfg: RunConfig, step: int) -> float:
    """Learning rate for optimizer step ``step`` (1-based), before the NaN-rollback scale.

    Linear warmup over ``warmup_steps`` (step 1 gets lr/warmup, never 0), then cosine to
    ``lr·min_lr_ratio`` at ``total_steps``, or WSD: constant, then a linear decay over the last
    ``decay_fraction`` of the steps (Hu et al., MiniCPM 2024).
    """
    t = cfg.train
    peak, floor = t.lr, t.lr * t.min_lr_ratio
    if step <= t.warmup_steps:
        return peak * step / t.warmup_steps
    if t.schedule == "cosine":
        span = max(1, t.total_steps - t.warmup_steps)
        progress = min(1.0, (step - t.warmup_steps) / span)
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    decay_start = max(t.warmup_steps, round(t.total_steps * (1.0 - t.decay_fraction)))
    if step <= decay_start:
        return peak
    progress = min(1.0, (step - decay_start) / max(1, t.total_steps - decay_start))
    return peak + (floor - peak) * progress
