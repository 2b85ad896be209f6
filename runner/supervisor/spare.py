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
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from m3run.runner.procs import signal_group, spawn_logged
from m3run.runner.protocol import STANDBY_ARG, WORKER_LOG, WorkerPhase

# The spare's command line: the worker's module with the one standby argument.
SPARE_ARGV = (sys.executable, "-m", "m3run.runner.train", STANDBY_ARG)


class WarmSpare:
    """At most one spare worker process for ``run_dir``."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.proc: subprocess.Popen | None = None

    def ready(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @staticmethod
    def runs(argv: list[str]) -> bool:
        """Whether a spare can become the worker of ``argv``: the worker's own module (not
        torchrun) under the spare's interpreter."""
        return tuple(argv[:3]) == SPARE_ARGV[:3]

    def start(self, env: dict[str, str]) -> None:
        """Spawn a spare unless one is waiting. Its output (nothing, unless its imports fail)
        goes to worker.log."""
        if self.ready():
            return
        self.discard()
        self.proc, _ = spawn_logged(
            SPARE_ARGV, self.run_dir / WORKER_LOG, env=env, stdin=subprocess.PIPE
        )

    def take(self, worker_args: list[str]) -> subprocess.Popen | None:
        """Hand the waiting spare ``worker_args`` (the worker's arguments after its module)
        and return it as the new worker's process; None when no live spare waits (the caller
        spawns a fresh worker)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            self._reap(proc)
            return None
        try:
            assert proc.stdin is not None
            proc.stdin.write((json.dumps(worker_args) + "\n").encode())
            proc.stdin.close()  # one command; EOF after it
        except OSError:  # it died between the poll and the write
            self._reap(proc)
            return None
        return proc

    def discard(self) -> None:
        """Kill the spare, if any, and reap it."""
        proc, self.proc = self.proc, None
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
    ):
        self.spare = WarmSpare(run_dir)
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
