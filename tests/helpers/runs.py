"""Seconds-long real runs: the demo recipe shrunk by --set overrides, and the environment a
worker or supervisor child gets in tests."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEMO_CONFIG = REPO / "configs" / "demo_cpu.yaml"


def tiny_run_overrides(corpus: Path, **extra) -> list[str]:
    """--set overrides that turn configs/demo_cpu.yaml into a seconds-long run on `corpus`."""
    base = {
        "data.train_path": str(corpus / "train"),
        "data.val_path": str(corpus / "val"),
        "data.seq_len": 64,
        "model.vocab_size": 512,
        "model.d_model": 64,
        "model.d_intermediate": 128,
        "train.micro_batch_size": 4,
        "train.total_steps": 30,
        "train.warmup_steps": 5,
        "checkpoint.interval_steps": 5,
        "eval.interval_steps": 0,
        "log.interval_steps": 1,
        "log.heartbeat_interval_s": 0.2,
        "supervisor.preemption_provider": "none",
        # On a GPU the tiny shapes have no tuned scan plan: no test tunes one unless it says so.
        "supervisor.tune_scan": "false",
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def worker_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("M3RUN_FAULT", None)
    env.pop("WANDB_PROJECT", None)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    # One intra-op thread per process: the runs are tiny and run beside one another (two xdist
    # workers; a reference run next to the one under test), and torch's default pool in each
    # oversubscribed a 2-core machine, where a resumed run beside its reference trained many
    # times slower than alone.
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env
