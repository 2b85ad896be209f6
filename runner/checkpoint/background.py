"""Checkpoint writes off the training thread: `BackgroundWriter` runs them one at a time, in the
order they were submitted, and hands each one's outcome back to the training loop, which reports
a step only once its checkpoint is complete on disk."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from m3run.runner.checkpoint.layout import CheckpointError, dir_bytes
from m3run.runner.checkpoint.write import WriteCancelled


@dataclass
class SaveResult:
    """A checkpoint the writer finished: complete on disk, retention applied."""

    step: int
    path: Path
    write_s: float  # write + fsync + rename + retention, seconds
    bytes: int  # size on disk of the checkpoint directory (the triple)


def timed_write(step: int, job: Callable[[], Path]) -> SaveResult:
    """Run `job` (write the checkpoint for `step`, return its directory) and time it."""
    t0 = time.perf_counter()
    path = job()
    return SaveResult(step, path, time.perf_counter() - t0, dir_bytes(path))


# A write job: given its cancel flag, writes the checkpoint and returns its directory.
Job = Callable[[threading.Event], Path]


@dataclass
class _Write:
    step: int
    thread: threading.Thread | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    started: float | None = None  # perf_counter when it began writing (after the one before)
    result: SaveResult | None = None
    error: BaseException | None = None


class BackgroundWriter:
    """Runs checkpoint writes on background threads, one at a time, oldest first.

    `submit(step, job)` queues `job(cancel)` (which writes a checkpoint and returns its
    directory) behind the writes already pending and returns at once. The oldest pending write is
    the one `join()` waits for and `result()` hands over, exactly once, re-raising its failure
    as a CheckpointError in the caller's thread (or WriteCancelled when it was cancelled).
    Nothing is reported complete until its job has returned, i.e. until meta.json is on disk and
    renamed into place. `cancel(step)` asks a pending write to stop (one not yet started never
    starts).

    The threads are not daemons: an interpreter that exits with writes pending finishes them
    first (a kill -9 leaves a torn `.tmp-*` directory, which discovery ignores)."""

    def __init__(self, name: str = "m3run-checkpoint-writer") -> None:
        self.name = name
        self._pending: deque[_Write] = deque()

    @property
    def pending_steps(self) -> list[int]:
        """The steps of the writes submitted and not yet collected, oldest first."""
        return [w.step for w in self._pending]

    @property
    def pending_step(self) -> int | None:
        """The step of the oldest write not yet collected (running or ended), else None."""
        return self._pending[0].step if self._pending else None

    @property
    def elapsed_s(self) -> float:
        """Seconds the oldest pending write has been writing (0 before it began)."""
        started = self._pending[0].started if self._pending else None
        return time.perf_counter() - started if started is not None else 0.0

    def running(self) -> bool:
        """Any pending write has not ended yet."""
        return any(w.thread is not None and w.thread.is_alive() for w in self._pending)

    def finished(self) -> bool:
        """The oldest pending write has ended (successfully or not): `result()` will not block."""
        return bool(self._pending) and not self._pending[0].thread.is_alive()

    def submit(self, step: int, job: Job) -> None:
        before = self._pending[-1].thread if self._pending else None
        write = _Write(step)
        write.thread = threading.Thread(
            target=self._run, args=(write, job, before), name=f"{self.name}-{step}"
        )
        self._pending.append(write)
        write.thread.start()

    @staticmethod
    def _run(write: _Write, job: Job, before: threading.Thread | None) -> None:
        if before is not None:
            before.join()  # one write at a time: two would share the disk and both finish late
        try:
            if write.cancel.is_set():
                raise WriteCancelled(write.step)
            write.started = time.perf_counter()
            write.result = timed_write(write.step, lambda: job(write.cancel))
        except BaseException as e:  # handed to the caller's thread by result()
            write.error = e

    def cancel(self, step: int) -> bool:
        """Ask the pending write of `step` to stop; False when none is pending for it."""
        for w in self._pending:
            if w.step == step:
                w.cancel.set()
                return True
        return False

    def cancelled(self, step: int) -> bool:
        """Whether the pending write of `step` was asked to stop."""
        return any(w.step == step and w.cancel.is_set() for w in self._pending)

    def join(self, timeout: float | None = None) -> bool:
        """Wait up to `timeout` seconds (None: for as long as it takes) for the oldest pending
        write. True when it has ended (or none is pending)."""
        if not self._pending:
            return True
        thread = self._pending[0].thread
        thread.join(timeout)
        return not thread.is_alive()

    def join_all(self) -> None:
        """Wait for every pending write to end (none is collected)."""
        for w in list(self._pending):
            w.thread.join()

    def result(self) -> SaveResult:
        """The oldest write, ended (it is then no longer pending). CheckpointError when it
        failed, naming the step, the cause and what to check; WriteCancelled when cancelled."""
        if not self.finished():
            raise RuntimeError("no finished checkpoint write to collect; call join() first")
        write = self._pending.popleft()
        error, result = write.error, write.result
        if isinstance(error, WriteCancelled):
            raise error
        if error is not None:
            if isinstance(error, CheckpointError):
                raise CheckpointError(
                    f"background checkpoint write failed: {error}", errno=error.errno
                ) from error
            raise CheckpointError(
                f"background checkpoint write for step {write.step} failed with "
                f"{type(error).__name__}: {error}. Nothing was reported complete for this step; "
                "the earlier checkpoints are untouched (the traceback below shows where it failed)"
            ) from error
        assert result is not None
        return result
