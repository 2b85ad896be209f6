"""The warm spare: the next worker, started before it is needed.

A restarted worker spends its first seconds in process start and imports (torch, the model, the
kernels, torch's compile stack: the largest part of a warm restart without a spare), work that
does not depend on why or where the run resumes. So once a worker has trained two steps past
the one it resumed from (past its start and compile), the supervisor starts its successor as
``python -m m3run.runner.train --standby`` (runner/worker/standby.py): it imports all of that,
then blocks reading its stdin.
When the supervisor restarts the worker it writes the attempt's header to worker.log and the
worker's arguments (resume, lr scale) to the spare's stdin as one JSON line; the spare becomes
the worker. A spare that has died is replaced by a fresh spawn, as without one.

A spare that exits before it is handed a run (its imports fail: a broken install, a missing
library) is recorded (``spare_failed``), and after ``MAX_SPARE_FAILURES`` of them the run goes on
without spares (``spares_off``): each one costs a full import, and the next would fail the same
way. A spare found stopped (SIGSTOP, a debugger) at the handover is killed (``spare_discarded``,
which counts as a failure) and a plain worker starts at once: handed the run, it would only be
ended as hung once the startup allowance ran out. So is one alive but wedged: a spare writes
one byte on a pipe once its imports are done, and one that has not after
``SPARE_READY_WITHIN_S`` is stuck, not slow.

A launch that runs the preflight smoke test starts a spare before it, so that the first
worker's imports overlap the smoke test instead of following it: the first worker is that
spare. A launch that skips the smoke test spawns its first worker at once, with nothing to
overlap.

The spare never touches the GPU or the run dir before it is told to, holds no lock, and reads
EOF on its stdin when the supervisor goes away (even a SIGKILLed one): it then exits 0. The
supervisor kills it when the run ends. ``supervisor.warm_spare``: ``auto`` keeps one on a GPU
host (where restarts are worth seconds and a spare's imports cost little), ``true`` always,
``false`` never; a torchrun worker has none.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from m3run.runner.procs import signal_group, spawn_logged
from m3run.runner.protocol import (
    SPARE_DISCARDED_EVENT,
    SPARE_FAILED_EVENT,
    SPARE_READY_FD_ENV,
    SPARES_OFF_EVENT,
    STANDBY_ARG,
    WORKER_LOG,
    WorkerPhase,
)

# The spare's command line: the worker's module with the one standby argument.
SPARE_ARGV = (sys.executable, "-m", "m3run.runner.train", STANDBY_ARG)
# Spares that may fail before the run stops starting them: one can die of a passing cause (the
# host short of memory); this many in one run means the next would die the same way.
MAX_SPARE_FAILURES = 3
# A spare alive this long without having said it is ready (its imports done) is wedged, not
# slow: handed the run it would only be ended as hung once the startup allowance ran out. A
# younger one that is still importing is handed the run all the same: it is ahead of a fresh
# worker, which would import everything again. Imports take seconds; a cold cache on a slow
# disk, a minute or so.
SPARE_READY_WITHIN_S = 180.0
# psutil statuses of a spare that would not run if handed the worker's arguments.
_NOT_RUNNING = frozenset(
    {psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD}
)


class WarmSpare:
    """At most one spare worker process for ``run_dir``. ``emit(event, reason, level, **fields)``
    records its failures (the supervisor's event log)."""

    def __init__(
        self,
        run_dir: Path,
        emit: Callable[..., None] | None = None,
        ready_within_s: float = SPARE_READY_WITHIN_S,
    ):
        self.run_dir = run_dir
        self.proc: subprocess.Popen | None = None
        self.failures = 0
        self.off = False  # too many failed: no more spares this run
        self.ready_within_s = ready_within_s
        self._emit = emit or (lambda *a, **k: None)
        self._ready_fd: int | None = None  # the read end of the spare's readiness pipe
        self._imported = False  # the spare said its imports are done
        self._started = 0.0  # time.monotonic() at its spawn

    def ready(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @staticmethod
    def runs(argv: list[str]) -> bool:
        """Whether a spare can become the worker of ``argv``: the worker's own module (not
        torchrun) under the spare's interpreter."""
        return tuple(argv[:3]) == SPARE_ARGV[:3]

    def start(self, env: dict[str, str]) -> None:
        """Spawn a spare unless one is waiting. Its output (nothing, unless its imports fail)
        goes to worker.log. Nothing once too many have failed."""
        if self.ready():
            return
        self._dead_before_handover()
        if self.off:
            return
        read_end, write_end = os.pipe()
        try:
            self.proc, _ = spawn_logged(
                SPARE_ARGV,
                self.run_dir / WORKER_LOG,
                env={**env, SPARE_READY_FD_ENV: str(write_end)},
                stdin=subprocess.PIPE,
                pass_fds=(write_end,),
            )
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)  # the spare holds it now: EOF here once it is gone
        os.set_blocking(read_end, False)
        self._ready_fd, self._imported, self._started = read_end, False, time.monotonic()

    def imported(self) -> bool:
        """Whether the spare has said its imports are done (read off its pipe, never waiting)."""
        if not self._imported and self._ready_fd is not None:
            with contextlib.suppress(BlockingIOError):  # not yet
                self._imported = os.read(self._ready_fd, 1) == b"\n"
        return self._imported

    def _forget(self) -> subprocess.Popen | None:
        """Drop the spare (its process returned) and its readiness pipe."""
        proc, self.proc = self.proc, None
        if self._ready_fd is not None:
            os.close(self._ready_fd)
            self._ready_fd = None
        return proc

    def take(self, worker_args: list[str]) -> subprocess.Popen | None:
        """Hand the waiting spare ``worker_args`` (the worker's arguments after its module)
        and return it as the new worker's process; None when no live spare waits (the caller
        spawns a fresh worker)."""
        if not self.usable():
            return None
        proc = self._forget()
        try:
            assert proc.stdin is not None
            proc.stdin.write((json.dumps(worker_args) + "\n").encode())
            proc.stdin.close()  # one command; EOF after it
        except OSError:  # it died between the poll and the write
            self._failed(proc)
            return None
        return proc

    def usable(self) -> bool:
        """Whether a spare waits that can be handed a run: alive and not stopped. A dead one is
        recorded as failed, a stopped one killed and recorded; the caller then spawns a plain
        worker at once instead of waiting on it."""
        if self._dead_before_handover() or self.proc is None:
            return False
        try:
            status = psutil.Process(self.proc.pid).status()
        except psutil.Error:
            status = psutil.STATUS_DEAD
        pid = self.proc.pid
        if status in _NOT_RUNNING:
            why = (
                f"is {status!r}, not running, at the handover. Something stopped it (SIGSTOP, a "
                "debugger); leave the spare alone"
            )
        else:
            age = time.monotonic() - self._started
            if self.imported() or age <= self.ready_within_s:
                return True
            why = (
                f"is alive but has not finished its imports after {age:.0f} s (a spare is "
                f"wedged after {self.ready_within_s:g} s): an import is stuck, e.g. on a dead "
                f"file system or a lock; py-spy dump --pid {pid} shows where"
            )
        self.discard()
        self._emit(
            SPARE_DISCARDED_EVENT,
            reason=f"warm spare pid {pid} {why}. Killed it and started a plain worker instead "
            "of waiting on it; or set supervisor.warm_spare=false",
            level="warning",
            pid=pid,
            status=status,
        )
        self._count_failure()
        return False

    def _dead_before_handover(self) -> bool:
        """Record the spare as failed if it exited before it was handed a run: a waiting spare
        ends only by its own error or a kill from outside (``discard`` forgets it first)."""
        proc = self.proc
        if proc is None or proc.poll() is None:
            return False
        self._forget()
        self._failed(proc)
        return True

    def _failed(self, proc: subprocess.Popen) -> None:
        self._reap(proc)
        self._emit(
            SPARE_FAILED_EVENT,
            reason=f"warm spare pid {proc.pid} exited with code {proc.returncode} before it "
            f"was handed a run (failure {self.failures + 1} of at most {MAX_SPARE_FAILURES}); "
            f"its error is in {self.run_dir / WORKER_LOG}: fix it, or set "
            "supervisor.warm_spare=false",
            level="warning",
            pid=proc.pid,
            exit_code=proc.returncode,
        )
        self._count_failure()

    def _count_failure(self) -> None:
        self.failures += 1
        if self.failures < MAX_SPARE_FAILURES or self.off:
            return
        self.off = True
        self._emit(
            SPARES_OFF_EVENT,
            reason=f"{self.failures} warm spares failed before they were handed a run (at most "
            f"{MAX_SPARE_FAILURES}): no more spares this run, each restart starts a plain "
            f"worker. Fix the error in {self.run_dir / WORKER_LOG}, then relaunch to have "
            "spares again, or set supervisor.warm_spare=false",
            level="warning",
            failures=self.failures,
        )

    def discard(self) -> None:
        """Kill the spare, if any, and reap it."""
        proc = self._forget()
        if proc is not None and proc.poll() is None:
            signal_group(proc.pid, signal.SIGKILL)
        self._reap(proc)

    @staticmethod
    def _reap(proc: subprocess.Popen | None) -> None:
        if proc is None:
            return
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


class SparePolicy:
    """When the supervisor starts a spare: before a launch's smoke test that runs (the first
    worker), and once a worker has trained two steps past the one it resumed from (its
    successor: its imports never compete with the worker's start and compile). Only where
    ``supervisor.warm_spare`` is true, or auto on a host whose GPU the health gate saw
    (``has_gpu``), and for a worker a spare can run. ``env_for(attempt)`` is the environment of
    that attempt's worker."""

    def __init__(
        self,
        run_dir: Path,
        mode: bool | str,
        has_gpu: Callable[[], bool],
        env_for: Callable[[int], dict[str, str]],
        emit: Callable[..., None] | None = None,
    ):
        self.spare = WarmSpare(run_dir, emit)
        self.mode = mode
        self._has_gpu = has_gpu
        self._env_for = env_for
        self._at_step = 2  # the current worker's step at which its successor starts

    def wanted(self, argv: list[str]) -> bool:
        on = self.mode is True or (self.mode == "auto" and self._has_gpu())
        return on and WarmSpare.runs(argv)

    def before_smoke_test(self, argv: list[str], attempt: int) -> None:
        """The first worker (``argv``, ``attempt``), started beside the smoke test."""
        if self.wanted(argv):
            self.spare.start(self._env_for(attempt))

    def worker_started(self, resume_step: int | None) -> None:
        self._at_step = (resume_step or 0) + 2

    def heartbeat(self, argv: list[str], hb: Any, next_attempt: int) -> None:
        """After each heartbeat ``hb`` of the worker ``argv``: its successor, when due."""
        training = hb is not None and hb.phase == WorkerPhase.TRAINING and hb.step is not None
        if not training or self.spare.ready() or not self.wanted(argv):
            return
        if hb.step >= self._at_step:
            self.spare.start(self._env_for(next_attempt))
