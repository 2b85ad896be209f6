"""Stop requests: a user's SIGTERM/SIGINT or `m3run stop`, and cloud preemption notices. SIGHUP is
no stop: a closed terminal only takes the console away (runner.supervisor.events).
The first request has the worker save and exit 75 within the stop grace. A repeated SIGTERM or
`m3run stop` waits for that same save (a checkpoint written halfway is worth nothing); only a
second Ctrl-C (SIGINT) or the grace running out kills the worker. A preemption notice upgrades
a user stop (the node is going away)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from m3run.runner.files import read_json
from m3run.runner.procs import describe_exit
from m3run.runner.protocol import (
    EXIT_OK,
    EXIT_STOPPED,
    STOP_REQUEST_FILE,
    StopRequest,
    SupervisorPhase,
)

if TYPE_CHECKING:
    from m3run.runner.supervisor.events import EventLog

USER = "user"
PREEMPTED = "preempted"
# `m3run stop --grace S` written longer ago than this is not this stop's.
_REQUEST_FRESH_S = 60.0


class StopControl:
    """What has been asked of the run. `request` is safe from signal handlers and threads."""

    def __init__(self, run_dir: Path, stop_grace_s: float):
        self.run_dir = run_dir
        self.stop_grace_s = stop_grace_s
        # Re-entrant: request runs in signal handlers, and a second signal may arrive while
        # the first handler holds it.
        self._lock = threading.RLock()
        self.kind: str | None = None  # USER | PREEMPTED
        self.detail = ""
        self.force = False
        self.repeats = 0  # repeated requests that wait for the first one's save
        # The worker was killed at a second Ctrl-C, before its grace ran out: the ending names
        # that, not a grace it never waited out.
        self.force_killed = False
        self.grace_used = stop_grace_s

    @property
    def requested(self) -> bool:
        return self.kind is not None

    def request(self, kind: str, detail: str, *, force_on_repeat: bool = False) -> None:
        """Record a request. `force_on_repeat`: a repeat of this one kills the worker now (a
        second Ctrl-C); any other repeat waits for the save under way."""
        with self._lock:
            if self.kind is None:
                self.kind, self.detail = kind, detail
            elif kind == USER and force_on_repeat:
                self.force = True
            elif kind == USER:
                self.repeats += 1
            if kind == PREEMPTED:
                self.kind, self.detail = kind, detail

    def install_signal_handlers(self) -> dict:
        """SIGTERM and SIGINT become user stop requests (main thread only); returns the
        handlers they replaced, for the caller to restore."""
        if threading.current_thread() is not threading.main_thread():
            return {}

        def handler(signum: int, _frame: Any) -> None:
            # A second Ctrl-C means "now"; a second SIGTERM (`m3run stop`, a container
            # runtime) waits for the save the first one started.
            self.request(
                USER,
                f"received {signal.Signals(signum).name}",
                force_on_repeat=signum == signal.SIGINT,
            )

        return {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}

    def grace(self) -> float:
        """stop_grace_s, shortened by a recent `m3run stop --grace S` request."""
        grace = self.stop_grace_s
        req = StopRequest.from_dict(read_json(self.run_dir / STOP_REQUEST_FILE))
        if self.kind == USER and req is not None and time.time() - req.time < _REQUEST_FRESH_S:
            grace = min(grace, max(0.0, req.grace_s))
        self.grace_used = grace
        return grace

    def _ending(self, reason: str) -> tuple[SupervisorPhase, int, str]:
        if self.kind == PREEMPTED:
            return SupervisorPhase.PREEMPTED, EXIT_STOPPED, reason
        return SupervisorPhase.STOPPED, EXIT_OK, reason

    def without_worker(self) -> tuple[SupervisorPhase, int, str]:
        """(phase, exit code, reason) of a stop that came while no worker ran."""
        return self._ending(f"{self.detail}; no worker was running")

    def after_worker(
        self, exit_code: int, killed_after_grace: bool, finished: bool, ckpt: int | None
    ) -> tuple[SupervisorPhase, int, str]:
        """(phase, exit code, reason) once the stopped worker has exited."""
        if (exit_code == EXIT_OK and not killed_after_grace) or (
            finished and ckpt is not None and exit_code != EXIT_STOPPED
        ):
            # It trained to the end before the stop reached it (a SIGTERM during its exit
            # can still kill it: the run is finished all the same).
            return (
                SupervisorPhase.FINISHED,
                EXIT_OK,
                f"worker finished the run (exit 0) while stopping ({self.detail})",
            )
        if exit_code == EXIT_STOPPED:
            how = f"worker saved and exited 75; last complete checkpoint step {ckpt}"
        elif self.force_killed:
            how = (
                f"worker killed at a second Ctrl-C without waiting for its save "
                f"({describe_exit(exit_code)}); last complete checkpoint step {ckpt}"
            )
        else:
            how = (
                f"worker did not exit 75 within the {self.grace_used:g}s stop grace "
                f"({describe_exit(exit_code)}); last complete checkpoint step {ckpt}"
            )
        return self._ending(f"{self.detail}; {how}")


class StopDelivery:
    """How the stop requests reach one running worker: SIGTERM at the first (it saves and exits
    75), SIGKILL once the grace is spent or at a second Ctrl-C; a repeat that waits is logged.
    ``kill_at`` (monotonic) is also the deadline a hang's SIGTERM sets."""

    def __init__(self, stops: StopControl, log: EventLog):
        self.stops = stops
        self.log = log
        self.sent = False
        self.kill_at: float | None = None
        self._repeats_seen = 0

    def poll(self, worker: Any, now: float, on_sent: Callable[[], None]) -> None:
        """One watch-loop turn for ``worker`` (a WorkerProcess); ``on_sent`` runs before the
        first SIGTERM (the supervisor records the stopping phase)."""
        stops = self.stops
        if stops.requested and not self.sent:
            self.sent = True
            grace = stops.grace()
            on_sent()
            self.log.emit("stop_requested", reason=stops.detail, kind=stops.kind, grace_s=grace)
            worker.terminate()
            self.kill_at = (
                min(self.kill_at, now + grace) if self.kill_at is not None else now + grace
            )
        if stops.repeats > self._repeats_seen:
            self._repeats_seen = stops.repeats
            self.log.emit(
                "stop_repeated",
                reason="another stop request: waiting for the save the first one "
                f"started ({max(0.0, (self.kill_at or now) - now):.0f}s of grace left; a second "
                "Ctrl-C kills the worker now)",
            )
        if stops.force and self.kill_at is not None and self.kill_at > now:
            self.log.emit(
                "force_kill", reason="second Ctrl-C: killing the worker now", level="warning"
            )
            self.kill_at = now
            stops.force_killed = True
        if self.kill_at is not None and now >= self.kill_at:
            worker.kill()

    def deadline_passed(self) -> bool:
        return self.kill_at is not None and time.monotonic() >= self.kill_at
