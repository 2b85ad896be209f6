"""Shared fixtures: a small token corpus prepared once per session, and the tests dir on
sys.path so helper modules under tests/fakes/ import as `fakes.*`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

DEMO_CONFIG = REPO / "configs" / "demo_cpu.yaml"


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """Token shards prepared from ~400 kB of the Python standard library with a 512-token BPE
    (seconds on 2 cores). Returns the output dir holding train/ and val/."""
    from runner.data import prepare_data

    out = tmp_path_factory.mktemp("corpus") / "data"
    prepare_data(["stdlib"], out, tokenizer="bpe:512", max_bytes=400_000, progress=False)
    return out


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
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def worker_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("M3RUN_FAULT", None)
    env.pop("WANDB_PROJECT", None)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra)
    return env
