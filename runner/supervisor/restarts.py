"""When to restart a dead worker and when to give up: a budget of restarts per sliding window,
a limit on restarts in a row without a new complete checkpoint, and exponential backoff from the
second restart in a row without one (the first is immediate)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from m3run.runner.protocol import EXIT_NAN, EXIT_STOPPED
from m3run.runner.supervisor.checkpoints import CheckpointTracker, LrCut
from m3run.runner.supervisor.settings import SupervisorSettings
from m3run.runner.supervisor.worker import Outcome


@dataclass(frozen=True)
class Restart:
    """One granted restart."""

    time: float
    backoff_s: float
    in_window: int  # restarts within restart_window_s, this one included


class RestartPolicy:
    """Restart accounting for one supervisor's lifetime."""

    def __init__(self, settings: SupervisorSettings):
        self.s = settings
        self._times: list[float] = []
        self.since_progress = 0

    def progress(self) -> None:
        """A new checkpoint was verified complete."""
        self.since_progress = 0

    def grant(self, failure: str, worker_log: Path) -> Restart | str:
        """A Restart, or the reason to give up (exit 70) naming `failure` and the fix."""
        s = self.s
        now = time.time()
        recent = [t for t in self._times if t > now - s.restart_window_s]
        if len(recent) >= s.max_restarts:
            return (
                f"restart budget spent: {len(recent)} restarts in the last "
                f"{s.restart_window_s:g}s (supervisor.max_restarts={s.max_restarts}); last "
                f"failure: {failure}. Read {worker_log}, fix the cause and "
                "relaunch, or raise supervisor.max_restarts"
            )
        if self.since_progress >= s.no_progress_restarts:
            return (
                f"no progress: {self.since_progress} restarts in a row without a new "
                f"complete checkpoint (supervisor.no_progress_restarts="
                f"{s.no_progress_restarts}); last failure: {failure}. Read "
                f"{worker_log}, fix the cause and relaunch"
            )
        # The first restart (of this launch, or since the last new checkpoint) is immediate: one
        # crash is not a loop. Each further one in a row waits twice as long as the one before,
        # from backoff_initial_s.
        delay = (
            0.0
            if self.since_progress == 0
            else min(s.backoff_max_s, s.backoff_initial_s * 2 ** (self.since_progress - 1))
        )
        self._times.append(now)
        self.since_progress += 1
        return Restart(time=now, backoff_s=delay, in_window=len(recent) + 1)


def diagnose(out: Outcome, checkpoints: CheckpointTracker, lr_cut: LrCut) -> tuple[str, str, str]:
    """(kind, reason, --resume) for a worker that must be restarted."""
    if out.hang is not None:
        return "hang", out.hang, checkpoints.resume_target()
    if out.exit_code == EXIT_NAN:
        lr_cut.nan_exit()
        resume, how = checkpoints.rollback_target()
        return (
            "nan",
            (
                f"worker exit 76: NaN excursion the in-process rollback could not "
                f"heal; {how}, learning rate cut to {lr_cut.cut:g}× the schedule"
            ),
            resume,
        )
    if out.exit_code == EXIT_STOPPED:
        return (
            "unrequested_stop",
            (
                "worker exit 75 (saved and stopped) without a stop request from this "
                "supervisor; resuming"
            ),
            checkpoints.resume_target(),
        )
    reason = f"worker crashed ({out.description()})"
    return "crash", reason, checkpoints.resume_target()
