"""What the supervisor knows about the run's checkpoints: every new one verified (sha256) off
the watch loop, which ones a restart may resume from, the rollback target after a NaN exit,
and the learning-rate cut that goes with it.

A restart resumes from "latest" unless some checkpoints must be skipped: those newer than an
explicit `--resume STEP` (another trajectory) and those past a rollback target. Then it names
the newest verified checkpoint that may be used.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from pathlib import Path

from m3run.runner.checkpoint.layout import (
    META_FILE,
    CheckpointInfo,
    list_checkpoints,
    verify_checkpoint,
)
from m3run.runner.supervisor.events import EventLog

Key = tuple[int, int]


def checkpoint_key(info: CheckpointInfo) -> Key:
    """(step, meta.json mtime): a re-saved step is a new checkpoint."""
    try:
        mtime = (info.path / META_FILE).stat().st_mtime_ns
    except OSError:
        mtime = 0
    return info.step, mtime


class CheckpointVerifier:
    """Hashes new checkpoints on a thread of its own (a 435M run's checkpoint is ~5 GB)."""

    def __init__(self) -> None:
        self._todo: queue.Queue[tuple[Key, Path] | None] = queue.Queue()
        self.done: queue.Queue[tuple[Key, bool, str | None]] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="ckpt-verify", daemon=True)
        self._thread.start()

    def submit(self, key: Key, path: Path) -> None:
        self._todo.put((key, path))

    def drain(self) -> None:
        """Block until every submitted checkpoint is verified."""
        self._todo.join()

    def close(self) -> None:
        self._todo.put(None)

    def _work(self) -> None:
        while True:
            item = self._todo.get()
            try:
                if item is None:
                    return
                key, path = item
                try:
                    # Recorded: the worker this supervisor restarts then skips hashing it.
                    ok, reason = verify_checkpoint(path, full=True, record_verified=True)
                except Exception as e:  # never let the thread die: drain() would wait forever
                    ok, reason = False, f"could not verify: {type(e).__name__}: {e}"
                self.done.put((key, ok, reason))
            finally:
                self._todo.task_done()


class CheckpointTracker:
    """The checkpoints of one run dir as the supervisor sees them. `last_step` is the newest
    verified save of the current trajectory (after a rollback, lower than checkpoints left over
    from before it)."""

    def __init__(self, run_dir: Path, log: EventLog, resume: str):
        self.run_dir = run_dir
        self.log = log
        self.verifier = CheckpointVerifier()
        self.last_step: int | None = None
        self._known: set[Key] = set()
        self._reported_torn: set[Key] = set()
        self._stale: dict[int, int] = {}  # step -> meta mtime at the time it was marked stale
        self._base_resume = resume  # what "nothing newer is usable" falls back to
        self._initial_key: Key | None = None

    def close(self) -> None:
        self.verifier.close()

    def _list(self) -> list[CheckpointInfo]:
        return list_checkpoints(self.run_dir, verify=False)

    def start(self, resume: str) -> None:
        """Take stock of what the run dir holds before the first worker starts."""
        infos = self._list()
        for info in infos:
            self._known.add(checkpoint_key(info))
            if not info.complete:
                self._reported_torn.add(checkpoint_key(info))
        complete = [i for i in infos if i.complete]
        if complete:
            self.last_step = complete[-1].step
            # Hash the newest one off the loop: a corrupt one is reported (the worker's
            # `--resume latest` skips it), and it is not progress.
            self._initial_key = checkpoint_key(complete[-1])
            self.verifier.submit(self._initial_key, complete[-1].path)
        # Resuming from an explicit step (or from nothing) while newer checkpoints exist:
        # those belong to another trajectory; a restart must not jump onto them.
        if resume != "latest":
            self._mark_stale(infos, above=-1 if resume == "none" else int(resume))

    def _mark_stale(self, infos: Sequence[CheckpointInfo], above: int) -> None:
        for info in infos:
            if info.step > above:
                self._stale[info.step] = checkpoint_key(info)[1]

    def _is_stale(self, info: CheckpointInfo) -> bool:
        return self._stale.get(info.step) == checkpoint_key(info)[1]

    def scan(self) -> bool:
        """Submit new checkpoints for verification, report torn ones, collect verdicts. True if
        a new checkpoint was verified complete (progress)."""
        try:
            infos = self._list()
        except Exception as e:  # a transient listing error is retried on the next poll
            self.log.emit("checkpoint_scan_error", reason=str(e), level="warning")
            return False
        for info in infos:
            key = checkpoint_key(info)
            if key in self._known:
                continue
            if info.complete:
                self._known.add(key)
                self.verifier.submit(key, info.path)
            elif key not in self._reported_torn and (info.path / META_FILE).exists():
                self._reported_torn.add(key)
                self.log.emit(
                    "checkpoint_incomplete",
                    level="warning",
                    step=info.step,
                    reason=f"{info.path}: {info.reason}; it will not be resumed from",
                )
        return self.collect()

    def settle(self) -> bool:
        """After a worker exits: verify everything it left. True on progress."""
        self.verifier.drain()
        progressed = self.scan()
        self.verifier.drain()
        return self.collect() or progressed

    def collect(self) -> bool:
        progressed = False
        while True:
            try:
                key, ok, reason = self.verifier.done.get_nowait()
            except queue.Empty:
                return progressed
            step = key[0]
            if key == self._initial_key:
                if not ok:
                    earlier = [i.step for i in self._list() if i.complete and i.step < step]
                    self.last_step = earlier[-1] if earlier else None
                    then = (
                        "the worker resumes from an earlier complete one"
                        if earlier
                        else "no other complete checkpoint exists, so the worker refuses to "
                        "start from scratch (exit 78) unless launched with --resume none --force"
                    )
                    self.log.emit(
                        "checkpoint_incomplete",
                        level="warning",
                        step=step,
                        reason=f"the newest existing checkpoint, step {step}, failed "
                        f"verification: {reason}; {then}",
                    )
                continue
            if ok:
                progressed = True
                self.last_step = step
                self.log.emit("checkpoint", reason="verified complete (sha256)", step=step)
            else:
                self.log.emit(
                    "checkpoint_incomplete",
                    level="warning",
                    step=step,
                    reason=f"step {step} failed verification: {reason}; it will not "
                    "be resumed from",
                )

    def _newest_verified(self, before_step: int | None = None) -> CheckpointInfo | None:
        """The newest complete checkpoint a restart may resume from, hashed to be sure."""
        usable = [i for i in reversed(self._list()) if i.complete and not self._is_stale(i)]
        for info in usable:
            if before_step is not None and info.step >= before_step:
                continue
            ok, _ = verify_checkpoint(info.path, full=True)
            if ok:
                return info
        return None

    def resume_target(self) -> str:
        """--resume for a restart: "latest" unless some checkpoints must be skipped, then the
        newest verified one that may be used, else what the run started from."""
        if not self._stale:
            return "latest"
        info = self._newest_verified()
        return str(info.step) if info is not None else self._base_resume

    def rollback_target(self) -> tuple[str, str]:
        """After exit 76: the checkpoint before the latest (the latest may already carry the
        excursion). Returns (--resume value, description)."""
        latest = self._newest_verified()
        if latest is None:
            return self._base_resume, "no complete checkpoint: restarting from the start"
        before = self._newest_verified(before_step=latest.step)
        target = before or latest
        self._mark_stale(self._list(), above=target.step)
        self._base_resume = str(target.step)
        self.last_step = target.step
        if before is None:
            return str(target.step), f"only checkpoint {latest.step} exists: resuming from it"
        return str(target.step), f"rolling back past checkpoint {latest.step} to {target.step}"

    def stored_scale(self, resume: str) -> float:
        """The LR scale stored in the checkpoint a worker resuming from `resume` loads (1.0
        from scratch, or for a checkpoint that predates the field)."""
        if resume == "none":
            return 1.0
        infos = [i for i in self._list() if i.complete]
        if resume.isdigit():
            infos = [i for i in infos if i.step == int(resume)]
        if not infos:
            return 1.0
        stored = (infos[-1].meta or {}).get("lr_scale", 1.0)
        return float(stored) if isinstance(stored, (int, float)) and stored > 0 else 1.0


class LrCut:
    """The learning-rate cut after NaN exits. The worker multiplies the scale stored in the
    checkpoint it loads by --lr-scale, and stores the product in its own checkpoints. After an
    exit 76 the worker must train at the cut scale: a checkpoint written before the cut gets
    the missing factor, one written after it already carries the cut (1.0), and the supervisor
    never raises the LR a checkpoint already has. Consecutive exits compound, since each cut is
    relative to the scale the failing worker ran at."""

    def __init__(self, checkpoints: CheckpointTracker, factor: float):
        self._checkpoints = checkpoints
        self._factor = factor
        self._cut_abs: float | None = None  # the absolute scale the last exit 76 called for
        self._launch_abs = 1.0  # the absolute scale of the running worker

    @property
    def cut(self) -> float | None:
        return self._cut_abs

    def launched(self, resume: str, lr_scale: float) -> None:
        self._launch_abs = self._checkpoints.stored_scale(resume) * lr_scale

    def nan_exit(self) -> None:
        self._cut_abs = self._launch_abs * self._factor

    def lr_scale_for(self, resume: str) -> float:
        """--lr-scale for a worker resuming from `resume`."""
        if self._cut_abs is None:
            return 1.0
        return min(1.0, self._cut_abs / self._checkpoints.stored_scale(resume))
