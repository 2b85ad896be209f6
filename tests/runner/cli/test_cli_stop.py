"""`m3run stop` on run directories written by the tests and on runs supervised live over a
stand-in worker: not running, a clean stop, the grace, --force, a supervisor ending while the
stop looks, and a reused pid. Stops on a bad day with a real worker: tests/chaos/test_stops.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
from helpers.run_dirs import invoke, write_run
from helpers.runs import REPO
from helpers.supervision import make_run, spawn_driver, wait_for

from m3run.runner import stopping
from m3run.runner.files import read_json, read_jsonl
from m3run.runner.protocol import (
    EVENTS_FILE,
    HEARTBEAT_FILE,
    LOCK_FILE,
    STATE_FILE,
    WORKER_LOCK_FILE,
    SupervisorPhase,
)


def test_stop_on_a_run_that_is_not_running(tmp_path):
    result = invoke("stop", write_run(tmp_path / "a", phase="finished"))
    assert result.exit_code == 1 and "is not running: phase finished" in result.output
    result = invoke("stop", write_run(tmp_path / "b", alive=False))
    assert result.exit_code == 1 and "is gone" in result.output
    (tmp_path / "c").mkdir()
    result = invoke("stop", tmp_path / "c")
    assert result.exit_code == 1 and "no supervisor has run there" in result.output


def test_stop_a_live_run(tmp_path):
    run_dir = make_run(tmp_path, [{"steps": 10**6}])
    proc = spawn_driver(run_dir)
    try:
        wait_for(
            lambda: (read_json(run_dir / HEARTBEAT_FILE) or {}).get("step", 0) >= 2,
            what="the worker to train",
        )
        result = invoke("stop", run_dir)
        assert result.exit_code == 0, result.output
        assert "stopped (" in result.output
        assert proc.wait(timeout=10) == 0
        assert read_json(run_dir / STATE_FILE)["phase"] == SupervisorPhase.STOPPED
        # Stopping again: not running.
        assert invoke("stop", run_dir).exit_code == 1
    finally:
        proc.kill()


def test_stop_grace_caps_the_workers_save_time(tmp_path):
    run_dir = make_run(tmp_path, [{"steps": 10**6, "ignore_term": True}])
    proc = spawn_driver(run_dir, stop_grace_s=60.0)
    try:
        wait_for(
            lambda: (read_json(run_dir / HEARTBEAT_FILE) or {}).get("step", 0) >= 1,
            what="the worker to train",
        )
        t0 = time.monotonic()
        result = invoke("stop", run_dir, "--grace", "0.5")
        assert result.exit_code == 0, result.output
        assert time.monotonic() - t0 < 10
        assert "within the 0.5s stop grace" in read_json(run_dir / STATE_FILE)["reason"]
    finally:
        proc.kill()


def test_stop_force_kills_a_supervisor_that_does_not_stop(tmp_path):
    # A "supervisor" that ignores SIGTERM, and its "worker", each holding its lock.
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    stubborn = (
        "import signal, sys, time\n"
        "from m3run.runner.files import PidLock\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "assert PidLock(sys.argv[1]).acquire() is None\n"
        "print('locked', flush=True)\n"
        "time.sleep(60)\n"
    )

    def start(lock: str, **kw) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-c", stubborn, str(run_dir / lock)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            **kw,
        )
        assert proc.stdout.readline().strip() == "locked"
        return proc

    sup = start(LOCK_FILE)
    worker = start(WORKER_LOCK_FILE, start_new_session=True)
    try:
        run_dir = write_run(
            run_dir,
            supervisor_pid=sup.pid,
            supervisor_create_time=psutil.Process(sup.pid).create_time(),
            worker_pid=worker.pid,
            worker_create_time=psutil.Process(worker.pid).create_time(),
        )
        said: list[str] = []
        code = stopping.stop_run(run_dir, grace_s=0.2, force=False, say=said.append, margin_s=0.3)
        assert code == 1 and "rerun with --force" in said[-1]
        code = stopping.stop_run(run_dir, grace_s=0.2, force=True, say=said.append, margin_s=0.3)
        assert code == 0
        assert sup.wait(timeout=5) == -signal.SIGKILL
        assert worker.wait(timeout=5) == -signal.SIGKILL
        state = read_json(run_dir / STATE_FILE)
        assert state["phase"] == SupervisorPhase.STOPPED and "--force" in state["reason"]
        assert read_jsonl(run_dir / EVENTS_FILE)[-1]["forced"] is True
    finally:
        sup.kill()
        worker.kill()


def test_stop_never_takes_a_supervisor_that_just_ended_for_a_dead_one(tmp_path):
    # A supervisor writes its final phase, then releases its lock and exits. A stop that read
    # state.json just before that write and checked the lock just after the exit used to report
    # "exited without recording a final phase" (exit 1) for a clean stop. Polling without pause,
    # many rounds put reads in that window.
    prompt = (
        "import json, os, signal, sys, time\n"
        "from m3run.runner.files import PidLock, atomic_write_json\n"
        "lock = PidLock(sys.argv[1])\n"
        "assert lock.acquire() is None\n"
        "def stop(*_):\n"
        "    path = sys.argv[2]\n"
        "    state = json.load(open(path))\n"
        "    atomic_write_json(path, {**state, 'phase': 'stopped', 'reason': 'received SIGTERM'})\n"
        "    lock.release()\n"
        "    os._exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "print('locked', flush=True)\n"
        "time.sleep(60)\n"
    )
    for round_ in range(12):
        run_dir = tmp_path / f"r{round_}"
        run_dir.mkdir()
        sup = subprocess.Popen(
            [sys.executable, "-c", prompt, str(run_dir / LOCK_FILE), str(run_dir / STATE_FILE)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        try:
            assert sup.stdout.readline().strip() == "locked"
            write_run(
                run_dir,
                supervisor_pid=sup.pid,
                supervisor_create_time=psutil.Process(sup.pid).create_time(),
            )
            said: list[str] = []
            code = stopping.stop_run(run_dir, grace_s=5.0, say=said.append, poll_s=0.0)
            assert code == 0 and "stopped (received SIGTERM)" in said[-1], (round_, said)
            assert sup.wait(timeout=10) == 0
        finally:
            sup.kill()


def test_stop_refuses_a_reused_pid(tmp_path):
    # Our pid with the wrong create time: a different process now owns the pid.
    run_dir = write_run(tmp_path / "r", supervisor_create_time=time.time() - 10**6)
    result = invoke("stop", run_dir)
    assert result.exit_code == 1 and "is gone" in result.output
