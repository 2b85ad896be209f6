"""`m3run launch` of the tiny demo run in a subprocess, watched from the test: the chaos tests'
way of driving a real supervisor over the real worker."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from helpers.runs import DEMO_CONFIG, REPO, tiny_run_overrides, worker_env
from m3run.runner.files import read_json
from m3run.runner.protocol import HEARTBEAT_FILE, STATE_FILE

TOTAL_STEPS = 24
INTERVAL = 4
SUPERVISOR = {
    "supervisor.smoke": "false",
    "supervisor.preemption_provider": "none",
    "supervisor.backoff_initial_s": 0.1,
    "supervisor.backoff_max_s": 0.5,
    "supervisor.stop_grace_s": 20,
}


def overrides(corpus: Path, **extra) -> list[str]:
    return tiny_run_overrides(
        corpus,
        **{
            "train.total_steps": TOTAL_STEPS,
            "log.heartbeat_interval_s": 0.05,
            "checkpoint.interval_steps": INTERVAL,
            "checkpoint.keep_last": 4,
            **SUPERVISOR,
            **extra,
        },
    )


def launch_argv(run_dir: Path, sets: list[str], *extra: str) -> list[str]:
    """`m3run launch` of the demo recipe into `run_dir` with `--set` overrides, then `extra`."""
    argv = [sys.executable, "-m", "m3run.runner.cli", "launch", str(DEMO_CONFIG)]
    argv += ["--run-dir", str(run_dir), *extra]
    for kv in sets:
        argv += ["--set", kv]
    return argv


class Run:
    """One `m3run launch` in the foreground, in a subprocess, its output kept in a file."""

    def __init__(self, run_dir: Path, sets: list[str], *extra: str, env: dict | None = None):
        self.run_dir = run_dir
        self.out = run_dir.parent / f"{run_dir.name}.launch.{time.monotonic_ns()}.txt"
        argv = launch_argv(run_dir, sets, *extra)
        with open(self.out, "w") as f:
            self.proc = subprocess.Popen(
                argv, stdout=f, stderr=subprocess.STDOUT, env=env or worker_env(), cwd=REPO
            )

    def wait(self, timeout: float = 120) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"launch did not end in {timeout}s:\n{self.output()}") from None

    def output(self) -> str:
        return self.out.read_text()

    def state(self) -> dict:
        return read_json(self.run_dir / STATE_FILE) or {}

    def heartbeat(self) -> dict:
        return read_json(self.run_dir / HEARTBEAT_FILE) or {}

    def wait_for(self, predicate, what: str, timeout: float = 90, poll_s: float = 0.02) -> object:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"launch exited {self.proc.returncode} while waiting for "
                    f"{what}:\n{self.output()}"
                )
            time.sleep(poll_s)
        raise AssertionError(f"timed out waiting for {what}:\n{self.output()}")

    def worker_at(self, min_step: int, after_pid: int | None = None) -> int:
        """Wait for a worker (other than after_pid) training at min_step or later; its pid
        (under torchrun, torchrun's)."""

        def ready():
            state, hb = self.state(), self.heartbeat()
            pid = state.get("worker_pid")
            if (
                pid
                and pid != after_pid
                and hb.get("ts", 0) >= state["worker_started_at"]
                and hb.get("step", -1) >= min_step
                and hb.get("phase") == "training"
            ):
                return pid
            return None

        return self.wait_for(ready, f"a worker at step >= {min_step}", poll_s=0.005)
