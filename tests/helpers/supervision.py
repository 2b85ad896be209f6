"""Supervising the stand-in worker (helpers/standin_worker.py): settings that make runs take
milliseconds, run dirs with a plan, a Supervisor in this process or in a child of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from helpers.runs import REPO
from m3run.runner.files import read_json, read_jsonl
from m3run.runner.protocol import EVENTS_FILE, STATE_FILE
from m3run.runner.supervisor.settings import SupervisorSettings
from m3run.runner.supervisor.supervisor import Supervisor

HERE = Path(__file__).resolve().parent
STANDIN = HERE / "standin_worker.py"
DRIVER = HERE / "supervisor_driver.py"

FAST = dict(
    backoff_initial_s=0.05,
    backoff_max_s=0.4,
    startup_timeout_s=5.0,
    stop_grace_s=2.0,
    preemption_provider="none",
    smoke=False,
    min_heartbeat_timeout_s=0.5,
    poll_s=0.05,
    heartbeat_interval_s=0.05,
)


def settings(**over) -> SupervisorSettings:
    return SupervisorSettings(**{**FAST, **over})


def make_run(tmp_path: Path, plan: list[dict]) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    (run_dir / "plan.json").write_text(json.dumps(plan))
    return run_dir


def argv_for(standin: Path, run_dir: Path):
    return lambda resume, lr: [sys.executable, str(standin), str(run_dir), resume, repr(lr)]


def supervise(
    run_dir: Path,
    standin: Path,
    plan: list[dict] | None = None,
    *,
    resume: str = "latest",
    env: dict | None = None,
    gpu=None,
    **over,
) -> tuple[int, dict, list[dict]]:
    if plan is not None:
        (run_dir / "plan.json").write_text(json.dumps(plan))
    sup = Supervisor(
        run_dir,
        settings(**over),
        argv_for(standin, run_dir),
        resume=resume,
        env=env,
        gpu=gpu,
        handle_signals=False,
    )
    code = sup.run()
    return code, read_json(run_dir / STATE_FILE), read_jsonl(run_dir / EVENTS_FILE)


def attempts(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / "attempts.jsonl")


def events_named(events: list[dict], name: str) -> list[dict]:
    return [e for e in events if e["event"] == name]


def spawn_driver(run_dir: Path, standin: Path = STANDIN, **over) -> subprocess.Popen:
    """The supervisor over the stand-in in a process of its own (real signals)."""
    driver = DRIVER
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, str(driver), str(run_dir), json.dumps({**FAST, **over}), str(standin)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def wait_for(predicate, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


LOCK_HOLDER = (
    "import sys, time\n"
    "from m3run.runner.files import PidLock\n"
    "assert PidLock(sys.argv[1]).acquire() is None\n"
    "print('locked', flush=True)\n"
    "time.sleep(120)\n"
)


def hold_lock(lock_path: Path) -> subprocess.Popen:
    """A process in a session of its own that holds `lock_path` (as a worker holds worker.lock)
    until killed; returns once it holds it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", LOCK_HOLDER, str(lock_path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        start_new_session=True,
    )
    assert proc.stdout.readline().strip() == "locked"
    return proc


def unrelated_process() -> subprocess.Popen:
    """A process that is nothing of m3run's, to write into a forged state.json."""
    return subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True
    )


class FakeGpu:
    """A GpuProbe stand-in: verdicts per call, per-process memory, release waits."""

    def __init__(self, verdicts: list[str], mem_total_mib: int = 1000, process_bytes=None):
        self.verdicts, self.calls, self.released = list(verdicts), [], []
        self.mem_total_mib, self.process_bytes = mem_total_mib, process_bytes

    def check(self, allowed_pids):
        verdict = self.verdicts.pop(0) if len(self.verdicts) > 1 else self.verdicts[0]
        self.calls.append(verdict)
        mem = self.mem_total_mib

        class Report:
            def summary(self):
                return f"GPU health: {verdict}"

            def to_dict(self):
                return {"verdict": verdict, "devices": [{"index": 0, "mem_total_mib": mem}]}

        report = Report()
        report.verdict = verdict
        return report

    def process_memory(self, pid):
        return self.process_bytes

    def wait_released(self, pids, timeout_s):
        self.released.append(list(pids))
        return True
