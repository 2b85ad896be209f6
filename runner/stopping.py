"""`m3run stop`: ask a run's supervisor to stop, wait for the run to end, and with --force kill
what is left (the supervisor, or a worker orphaned by a killed supervisor).

Torch-free like runner.runstate, whose readers of state.json and the locks it uses: a process
is signalled only when its recorded pid was born at the recorded time and holds the run dir's
lock.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from m3run.runner.files import append_jsonl, atomic_write_json, read_json
from m3run.runner.procs import signal_group_of
from m3run.runner.protocol import (
    EVENTS_FILE,
    LOCK_FILE,
    STATE_FILE,
    STOP_REQUEST_FILE,
    SUPERVISOR_LOG,
    TERMINAL_PHASES,
    WORKER_LOCK_FILE,
    RunState,
    StopRequest,
    SupervisorPhase,
)
from m3run.runner.runstate import orphan_worker, settled_phase, supervisor_alive

# On top of the grace the worker gets to save: the supervisor's poll, the final checkpoint
# verification and its state write.
STOP_WAIT_MARGIN_S = 30.0


def stop_run(
    run_dir: Path,
    grace_s: float | None = None,
    force: bool = False,
    say: Callable[[str], None] = print,
    poll_s: float = 0.2,
    margin_s: float = STOP_WAIT_MARGIN_S,
) -> int:
    """`m3run stop`: SIGTERM the run's supervisor, which has the worker save and exit, then wait
    until state.json says the run ended. The supervisor is signalled only when the pid
    state.json names was born at the recorded time and holds the run dir's supervisor.lock.
    `grace_s` caps the worker's time to save (default: the run's stop_grace_s). A stop while
    another is under way waits for the same save. With `force`, a run still not stopped after
    the grace (+ margin) is SIGKILLed, supervisor and worker (found by their locks). Returns 0
    once the run is stopped, 1 if it was not running or did not stop."""
    run_dir = Path(run_dir)
    state, phase = settled_phase(run_dir)
    if phase is None:
        say(f"{run_dir} is not running: no supervisor has run there (no {STATE_FILE})")
        return 1
    if phase in TERMINAL_PHASES:
        say(f"{run_dir} is not running: phase {phase} ({state.reason or 'no reason'})")
        return 1
    if phase == SupervisorPhase.DEAD:
        return _stop_orphan(run_dir, state, force, say)

    pid = state.supervisor_pid
    run_grace = state.stop_grace_s
    grace = grace_s if grace_s is not None else (run_grace if run_grace is not None else 120.0)
    request = StopRequest.from_dict(read_json(run_dir / STOP_REQUEST_FILE))
    if phase == SupervisorPhase.STOPPING and request is not None:
        # Another stop is under way: its save is what this one waits for too (a second
        # request must never cut it short).
        grace = request.grace_s
        say(
            f"{run_dir} is already stopping (requested "
            f"{time.strftime('%H:%M:%S', time.localtime(request.time))}, grace {grace:g}s): "
            "waiting for the same save"
        )
    else:
        atomic_write_json(
            run_dir / STOP_REQUEST_FILE,
            StopRequest(grace_s=grace, time=time.time(), pid=os.getpid()).to_dict(),
        )
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            say(f"{run_dir} is not running: supervisor pid {pid} exited just now")
            return 1
        say(
            f"stopping {run_dir}: sent SIGTERM to supervisor pid {pid}; the worker saves a "
            f"checkpoint and exits (grace {grace:g}s)"
        )
    # After the worker's save, the supervisor may wait for the checkpoint mirror.
    flush = state.mirror_flush_s or 0.0
    deadline = time.monotonic() + grace + flush + margin_s
    while True:  # the last read is made at the deadline
        found, phase = settled_phase(run_dir)
        state = found or RunState()
        if phase in TERMINAL_PHASES:
            say(f"{run_dir}: {phase} ({state.reason or 'no reason'})")
            return 0
        if time.monotonic() >= deadline:
            break
        if phase == SupervisorPhase.DEAD:
            say(
                f"{run_dir}: supervisor pid {pid} exited without recording a final phase; see "
                f"{run_dir / SUPERVISOR_LOG}"
            )
            return 1
        time.sleep(poll_s)
    if not force:
        say(
            f"{run_dir} is still {phase} after "
            f"{grace + flush + margin_s:g}s; wait longer, or rerun with --force to kill the "
            "supervisor and the worker (progress since checkpoint "
            f"{state.last_checkpoint_step} is lost)"
        )
        return 1
    worker = orphan_worker(run_dir)
    if worker is not None:
        signal_group_of(worker, signal.SIGKILL)
    if supervisor_alive(state, run_dir):
        os.kill(pid, signal.SIGKILL)
    _mark_killed(run_dir, state, f"killed by `m3run stop --force` after {grace:g}s + margin")
    say(f"{run_dir}: killed (last complete checkpoint step {state.last_checkpoint_step})")
    return 0


def _stop_orphan(run_dir: Path, state: RunState, force: bool, say: Callable[[str], None]) -> int:
    """The supervisor is gone; its worker may still hold worker.lock and train unsupervised."""
    worker = orphan_worker(run_dir)
    recorded = state.supervisor_pid
    if force and worker is not None:
        signal_group_of(worker, signal.SIGKILL)
        _mark_killed(
            run_dir,
            state,
            "supervisor was gone; its orphaned worker was killed by `m3run stop --force`",
        )
        say(f"{run_dir}: the supervisor was gone; killed its orphaned worker pid {worker}")
        return 0
    orphan = (
        f"; worker pid {worker} still holds {WORKER_LOCK_FILE} (`m3run stop --force` kills it)"
        if worker is not None
        else ""
    )
    say(
        f"{run_dir} is not running: supervisor pid {recorded} is gone but {STATE_FILE} says "
        f"{state.phase!r} (no process born at its recorded start time holds "
        f"{LOCK_FILE}: it was killed, or {STATE_FILE} is stale); nothing was signalled{orphan}"
    )
    return 1


def _mark_killed(run_dir: Path, state: RunState, reason: str) -> None:
    """Record a forced stop the supervisor could not record itself."""
    state = dataclasses.replace(
        state,
        phase=SupervisorPhase.STOPPED,
        reason=reason,
        worker_pid=None,
        updated_at=time.time(),
    )
    atomic_write_json(Path(run_dir) / STATE_FILE, state.to_dict())
    append_jsonl(
        Path(run_dir) / EVENTS_FILE,
        {"time": time.time(), "event": SupervisorPhase.STOPPED, "reason": reason, "forced": True},
    )
