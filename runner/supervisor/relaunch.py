"""Between a dead worker and the next: the restart asked of restarts.RestartPolicy (a refusal
ends the run, exit 70), its record (an entry in state.json's ``restarts``, the ``restart`` or
``rollback`` event), the backoff waited out from the worker's exit, then the dead worker's GPU
memory released and the health gate passed. A stop request during the wait, or one there after
the gate, ends the run without a worker."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from m3run.runner.protocol import EXIT_SOFTWARE, SupervisorPhase
from m3run.runner.supervisor.events import EventLog
from m3run.runner.supervisor.preflight import GpuWatch, Preflight, PreflightEnd
from m3run.runner.supervisor.restarts import RestartPolicy
from m3run.runner.supervisor.settings import SupervisorSettings
from m3run.runner.supervisor.state import StateFile


class Relaunch:
    """The restarts of one supervisor. ``policy`` counts them (the supervisor calls its
    ``progress()`` at each new complete checkpoint); each is appended to the restarts of
    ``state_file``'s RunState, which ``write_state`` (the supervisor's: it also records the peak
    VRAM and the longest startup) writes; ``stop_requested`` is polled through the wait."""

    def __init__(
        self,
        settings: SupervisorSettings,
        worker_log: Path,
        state_file: StateFile,
        write_state: Callable[..., None],
        log: EventLog,
        preflight: Preflight,
        gpu: GpuWatch | None,
        stop_requested: Callable[[], bool],
    ):
        self.policy = RestartPolicy(settings)
        self.poll_s = settings.poll_s
        self.worker_log = worker_log
        self.state_file = state_file
        self.write_state = write_state
        self.log = log
        self.preflight = preflight
        self.gpu = gpu
        self.stop_requested = stop_requested

    def prepare(
        self,
        kind: str,
        reason: str,
        resume: str,
        lr_scale: float,
        *,
        exit_code: int,
        pid: int,
        exited: float,
    ) -> PreflightEnd | None:
        """Restart after the worker ``pid`` exited ``exit_code`` at ``exited`` (monotonic), as
        restarts.diagnose said (``kind``, ``reason``, ``resume``), at ``lr_scale``. None: start
        the next worker now; otherwise how the run ends.

        The backoff counts from the worker's exit: the verification of what it left, done
        since, is part of the wait rather than added to it."""
        grant = self.policy.grant(reason, self.worker_log)
        if isinstance(grant, str):
            return PreflightEnd(EXIT_SOFTWARE, grant)
        resume_step = self.state_file.resume_step(resume)
        restarts = self.state_file.state.restarts
        restarts.append(
            {
                "time": grant.time,
                "reason": reason,
                "kind": kind,
                "exit_code": exit_code,
                "resume": resume,
                "resume_step": resume_step,
                "lr_scale": lr_scale,
                "backoff_s": grant.backoff_s,
                "supervisor_pid": os.getpid(),
            }
        )
        self.write_state(
            force=True,
            phase=SupervisorPhase.RESTARTING,
            reason=reason,
            worker_pid=None,
            worker_create_time=None,
            lr_scale=lr_scale,
        )
        self.log.emit(
            "rollback" if kind == "nan" else "restart",
            reason=reason,
            kind=kind,
            exit_code=exit_code,
            resume=resume,
            resume_step=resume_step,
            backoff_s=grant.backoff_s,
            wait_s=round(max(0.0, exited + grant.backoff_s - time.monotonic()), 3),
            restart=len(restarts),
            restarts_in_window=grant.in_window,
        )
        deadline = exited + grant.backoff_s
        while time.monotonic() < deadline:
            if self.stop_requested():
                return PreflightEnd(stopped=True)
            self.write_state()  # keeps updated_at fresh for the liveness check
            time.sleep(min(self.poll_s, max(0.0, deadline - time.monotonic())))
        if self.gpu is not None:
            self.gpu.wait_released(pid)
            end = self.preflight.gate("before restart")
            if end is not None:
                return end
        if self.stop_requested():
            return PreflightEnd(stopped=True)
        return None
