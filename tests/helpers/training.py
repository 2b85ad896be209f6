"""The training worker as a subprocess: its command line, a blocking run, and the loss curve it
logged."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers.runs import DEMO_CONFIG, worker_env
from m3run.runner.checkpoint.layout import latest_complete
from m3run.runner.files import read_jsonl
from m3run.runner.protocol import METRICS_FILE


def worker_cmd(run_dir: Path, overrides: list[str], *extra: str) -> list[str]:
    """`python -m m3run.runner.train` on the demo recipe with `--set` overrides, then `extra`."""
    cmd = [sys.executable, "-m", "m3run.runner.train", str(DEMO_CONFIG), "--run-dir", str(run_dir)]
    for o in overrides:
        cmd += ["--set", o]
    return cmd + list(extra)


def run_worker(run_dir, overrides, *extra, env=None, timeout=240):
    """Run the worker to its end; the CompletedProcess has text stdout and stderr."""
    return subprocess.run(
        worker_cmd(run_dir, overrides, *extra),
        env=env or worker_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def train_losses(run_dir: Path) -> dict[int, float]:
    """step → loss, from metrics.jsonl (a replayed step must log the same loss)."""
    out: dict[int, float] = {}
    for rec in read_jsonl(run_dir / METRICS_FILE):
        if rec.get("kind") == "train":
            assert out.get(rec["step"], rec["loss"]) == rec["loss"], rec
            out[rec["step"]] = rec["loss"]
    return out


def sigterm_worker_at(run_dir: Path, overrides: list[str], step: int = 12) -> int:
    """Start the worker, SIGTERM it once it has logged `step`, check it saved and exited 75
    before the end of the 30-step run; the step it stopped at."""
    proc = subprocess.Popen(
        worker_cmd(run_dir, overrides),
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.time() + 180
    while time.time() < deadline and max(train_losses(run_dir) or [0]) < step:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 75, out
    stopped_at = latest_complete(run_dir).step
    assert step <= stopped_at < 30, out
    # Its last line, flushed before the worker's quick exit, names the checkpoint it left.
    last = out.splitlines()[-1]
    assert last == f"stopped at step {stopped_at}; checkpoint step {stopped_at} is complete", out
    return stopped_at
