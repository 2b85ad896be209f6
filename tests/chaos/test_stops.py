"""Stopping a real run on a bad day: stops repeated while the checkpoint is being written, and
run dirs whose state.json names processes that are not the run's."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
from helpers.launching import Run, overrides
from helpers.runs import REPO, worker_env
from helpers.supervision import unrelated_process

from m3run.runner.checkpoint.layout import list_checkpoints
from m3run.runner.files import read_jsonl
from m3run.runner.protocol import EVENTS_FILE, EXIT_OK, FAULT_ENV, STATE_FILE

pytestmark = pytest.mark.slow


def m3run_stop(run_dir, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "m3run.runner.cli", "stop", str(run_dir), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=worker_env(),
        cwd=REPO,
    )


def test_repeated_stops_during_a_slow_save_wait_for_the_same_checkpoint(corpus, tmp_path):
    run_dir, release = tmp_path / "run", tmp_path / "release"
    # Every checkpoint write holds mid-write (data files written, meta.json not yet) until the
    # test creates `release`: the second stop reads state.json while the first stop's save is
    # under way however slowly its process starts. The grace covers the hold.
    sets = overrides(corpus, **{"supervisor.stop_grace_s": 120})
    run = Run(run_dir, sets, env=worker_env(**{FAULT_ENV: f"hold_save={release}"}))
    run.worker_at(2)
    first = m3run_stop(run_dir)
    run.wait_for(lambda: run.state().get("phase") == "stopping", "the stop to reach the worker")
    second = m3run_stop(run_dir)
    said: list[str] = []  # the second stop's output, line by line as it comes
    reader = threading.Thread(target=lambda: said.extend(second.stdout), daemon=True)
    reader.start()
    run.wait_for(
        lambda: any("waiting for the same save" in line for line in said),
        "the second stop to wait for the same save",
    )
    run.proc.send_signal(signal.SIGTERM)  # and a container runtime's SIGTERM on top
    run.wait_for(lambda: "stop_repeated" in _events(run_dir), "the repeated stop's event")
    release.touch()
    assert run.wait() == EXIT_OK, run.output()
    out1, _ = first.communicate(timeout=60)
    assert second.wait(timeout=60) == 0 and first.returncode == 0, (out1, said)
    reader.join(timeout=60)
    assert "already stopping" in "".join(said), said
    events = _events(run_dir)
    assert "force_kill" not in events, events
    state = run.state()
    assert state["phase"] == "stopped" and "worker saved and exited 75" in state["reason"]
    complete = [c.step for c in list_checkpoints(run_dir) if c.complete]
    assert complete and complete[-1] == state["last_checkpoint_step"]
    assert run.heartbeat()["step"] == state["last_checkpoint_step"]  # no step lost


def _events(run_dir) -> list[str]:
    path = run_dir / EVENTS_FILE
    return [e["event"] for e in read_jsonl(path)] if path.exists() else []


def _forge(run_dir, pid: int, with_create_time: bool) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    born = psutil.Process(pid).create_time()
    state = {
        "phase": "running",
        "supervisor_pid": pid,
        "worker_pid": pid,
        "worker_create_time": born,
        "updated_at": time.time(),
    }
    if with_create_time:
        state["supervisor_create_time"] = born
    (run_dir / STATE_FILE).write_text(json.dumps(state))


@pytest.mark.parametrize("with_create_time", [False, True], ids=["no-create-time", "create-time"])
def test_an_unrelated_pid_in_state_json_survives_stop_force_and_launch(
    corpus, tmp_path, with_create_time
):
    bystander = unrelated_process()
    try:
        run_dir = tmp_path / "run"
        for args in ((), ("--force", "--grace", "0")):
            _forge(run_dir, bystander.pid, with_create_time)
            stop = m3run_stop(run_dir, *args)
            out, _ = stop.communicate(timeout=60)
            assert stop.returncode == 1, out
            assert "nothing was signalled" in out, out
            assert bystander.poll() is None, f"`m3run stop {' '.join(args)}` signalled it"
        _forge(run_dir, bystander.pid, with_create_time)
        sets = overrides(corpus, **{"train.total_steps": 4})
        run = Run(run_dir, sets)
        assert run.wait() == EXIT_OK, run.output()
        assert bystander.poll() is None, "launch signalled a process that is not its worker"
    finally:
        bystander.kill()
