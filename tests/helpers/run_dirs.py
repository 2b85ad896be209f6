"""Run directories as a supervisor leaves them, written by the tests for the `m3run` commands
that read them (status, stop, logs, health), and the commands invoked in-process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
from typer.testing import CliRunner

from m3run.runner.cli import app
from m3run.runner.protocol import HEARTBEAT_FILE, METRICS_FILE, STATE_FILE

_cli = CliRunner()


def invoke(*args: str):
    return _cli.invoke(app, [str(a) for a in args])


def me() -> tuple[int, float]:
    return os.getpid(), psutil.Process().create_time()


def write_run(
    run_dir: Path, phase: str = "running", *, alive: bool = True, hb_age: float = 1.0, **state
) -> Path:
    """A run dir as a supervisor would leave it; `alive` = this test process plays the
    supervisor (its pid and create time are recorded), else a pid that no longer exists."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if alive:
        pid, ctime = me()
    else:
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        pid, ctime = dead.pid, time.time() - 5
    now = time.time()
    record = {
        "phase": phase,
        "supervisor_pid": pid,
        "supervisor_create_time": ctime,
        "worker_pid": None,
        "worker_create_time": None,
        "worker_started_at": now - 60,
        "restarts": [
            {
                "time": now - 30,
                "reason": "worker crashed (exit 1)",
                "exit_code": 1,
                "resume_step": 10,
            }
        ],
        "last_checkpoint_step": 20,
        "heartbeat_timeout_s": 10.0,
        "stop_grace_s": 5.0,
        "reason": None,
        "config_hash": "abc",
        "started_at": now - 100,
        "updated_at": now,
        "peak_vram_bytes": 3 * 2**30,
        **state,
    }
    (run_dir / STATE_FILE).write_text(json.dumps(record))
    (run_dir / HEARTBEAT_FILE).write_text(
        json.dumps(
            {
                "pid": 1,
                "phase": "training",
                "step": 25,
                "total_steps": 100,
                "loss": 2.0,
                "lr": 1e-3,
                "grad_norm": 0.5,
                "tokens_per_s": 1234.0,
                "mfu": 0.41,
                "vram_bytes": 2**30,
                "step_time_s": 0.5,
                "checkpoint_time_s": 1.0,
                "last_checkpoint_step": 20,
                "ts": now - hb_age,
            }
        )
    )
    with open(run_dir / METRICS_FILE, "w") as f:
        for step in range(1, 26):
            f.write(
                json.dumps(
                    {
                        "kind": "train",
                        "step": step,
                        "loss": 5 - step / 10,
                        "ppl": 1.0,
                        "lr": 1e-3,
                        "grad_norm": 1.0,
                        "tokens_per_s": 1e3,
                        "time": now,
                    }
                )
                + "\n"
            )
        f.write(json.dumps({"kind": "eval", "step": 20, "eval_loss": 3.1, "time": now}) + "\n")
    return run_dir
