"""A foreground `m3run launch` whose terminal goes away (a dropped ssh session, a closed window):
the run trains on without its console, and `m3run stop` still ends it with a checkpoint."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import signal
import subprocess
import sys
import termios
import threading
import time

import pytest
from helpers.launching import launch_argv, overrides
from helpers.runs import REPO, worker_env

from m3run.runner.checkpoint.layout import list_checkpoints
from m3run.runner.files import read_json, read_jsonl
from m3run.runner.protocol import (
    CONSOLE_LOST_EVENT,
    EVENTS_FILE,
    EXIT_OK,
    EXIT_STOPPED,
    HEARTBEAT_FILE,
    STATE_FILE,
)

pytestmark = pytest.mark.slow


def _take_terminal() -> None:
    """In the launch, after its setsid: the pty on its stdout becomes its controlling terminal,
    so closing the pty's other end hangs it up as a closed terminal window does."""
    fcntl.ioctl(1, termios.TIOCSCTTY, 0)


class Console:
    """The launch's stdout and stderr: a pty it holds as its terminal, or a pipe; read on a
    thread (a full pty or pipe would block the launch) until `close` hangs it up."""

    def __init__(self, kind: str):
        self.kind = kind
        if kind == "pty":
            self.read_fd, self.write_fd = pty.openpty()
        else:
            self.read_fd, self.write_fd = os.pipe()
        self._closing = threading.Event()
        self._reader = threading.Thread(target=self._drain, daemon=True)

    def start(self) -> None:
        os.close(self.write_fd)
        self._reader.start()

    def _drain(self) -> None:
        while not self._closing.is_set():
            ready, _, _ = select.select([self.read_fd], [], [], 0.05)
            if ready:
                try:
                    if not os.read(self.read_fd, 65536):
                        break
                except OSError:
                    break
        os.close(self.read_fd)

    def close(self) -> None:
        self._closing.set()
        if self._reader.ident is not None:
            self._reader.join(timeout=10)
            assert not self._reader.is_alive(), "the console reader did not stop"


def _wait(proc: subprocess.Popen, predicate, what: str, timeout: float = 90) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"launch exited {proc.returncode} while waiting for {what}")
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.mark.parametrize("kind", ["pty", "pipe"])
def test_a_closed_terminal_leaves_the_run_training_until_m3run_stop(corpus, tmp_path, kind):
    run_dir = tmp_path / "run"
    sets = overrides(corpus, **{"train.total_steps": 10**6})
    console = Console(kind)
    launch = subprocess.Popen(
        launch_argv(run_dir, sets),
        stdin=subprocess.DEVNULL,
        stdout=console.write_fd,
        stderr=console.write_fd,
        env=worker_env(),
        cwd=REPO,
        start_new_session=True,
        preexec_fn=_take_terminal if kind == "pty" else None,
    )
    try:
        console.start()

        def heartbeat() -> dict:
            return read_json(run_dir / HEARTBEAT_FILE) or {}

        def events(name: str) -> list[dict]:
            return [e for e in read_jsonl(run_dir / EVENTS_FILE) if e["event"] == name]

        _wait(launch, lambda: heartbeat().get("step", 0) >= 2, "the worker to train")
        worker = read_json(run_dir / STATE_FILE)["worker_pid"]
        console.close()  # the pty's hang-up, or the pipe's reader gone
        os.killpg(launch.pid, signal.SIGHUP)  # what a closed terminal sends its session
        _wait(launch, lambda: events(CONSOLE_LOST_EVENT), "the console_lost event")
        step = heartbeat()["step"]
        _wait(launch, lambda: heartbeat().get("step", 0) >= step + 4, "training to go on")
        assert read_json(run_dir / STATE_FILE)["worker_pid"] == worker
        assert len(events(CONSOLE_LOST_EVENT)) == 1

        stop = subprocess.run(
            [sys.executable, "-m", "m3run.runner.cli", "stop", str(run_dir)],
            capture_output=True,
            text=True,
            env=worker_env(),
            cwd=REPO,
            timeout=120,
        )
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert launch.wait(timeout=60) == EXIT_OK
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.wait(timeout=30)
        console.close()

    state = read_json(run_dir / STATE_FILE)
    assert state["phase"] == "stopped", state
    assert state["last_exit"]["code"] == EXIT_STOPPED, state["last_exit"]
    assert "worker saved and exited 75" in state["reason"]
    saved = list_checkpoints(run_dir)
    assert saved and saved[-1].complete and state["last_checkpoint_step"] == saved[-1].step
    assert saved[-1].step >= step + 4
    assert not events("force_kill") and not events("failed")
