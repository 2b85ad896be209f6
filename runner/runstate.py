"""Reading a run directory from outside the supervisor: state, heartbeat, events, metrics.

This is what `m3run status`, `m3run logs`, `m3run stop` (runner/stopping.py) and the container
liveness check see.
Torch-free and GPU-free: it reads files and asks the OS (psutil) whether recorded pids still
belong to the processes that wrote them. It imports only the shared torch-free modules, never
the supervisor's or health's: what `m3run status` adds from those (the mirror's lag, the GPU
rows) and how it lays a status out are the CLI's (runner/cli/report.py).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from m3run.runner.files import lock_holder, read_json
from m3run.runner.procs import (
    born_as_recorded,
    owns_lock,
    process_matches,
    runs_m3run,
    tail_text,
)
from m3run.runner.protocol import (
    ACTIVE_PHASES,
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    HEARTBEAT_FILE,
    LOCK_FILE,
    METRICS_FILE,
    RUN_DIR_FILES,
    STATE_FILE,
    SUPERVISOR_LOG,
    TERMINAL_PHASES,
    WORKER_LOCK_FILE,
    WORKER_LOG,
    Heartbeat,
    RunState,
    SupervisorPhase,
)

# Where run names resolve: ./runs/, or the directory the M3RUN_RUNS environment variable names.
RUNS_ENV = "M3RUN_RUNS"


def runs_root_dir() -> Path:
    return Path(os.environ.get(RUNS_ENV) or "runs")


# Slack on top of the supervisor's own hang allowance before the liveness check calls a run
# stale: the supervisor polls, then signals, then waits for the worker to exit.
LIVENESS_SLACK_S = 30.0
# The supervisor refreshes state.json every few seconds while it watches; its longest blocking
# steps (hashing checkpoints to pick a resume step, waiting for GPU memory) take minutes at most.
SUPERVISOR_STALE_S = 600.0


class RunNotFoundError(Exception):
    """RUN names no run directory. The message names the value and what to pass instead."""


# --------------------------------------------------------------------------- locating runs


def resolve_run(run: str | os.PathLike | None, root: Path | None = None) -> Path:
    """A run directory from RUN: an existing path, else a name under ./runs/. Without RUN, the
    run under ./runs/ whose state.json changed last. ./runs/ is `root`, else runs_root_dir()."""
    runs_root = root if root is not None else runs_root_dir()
    if run is None:
        candidates = (
            [p.parent for p in runs_root.glob(f"*/{STATE_FILE}")] if runs_root.is_dir() else []
        )
        if not candidates:
            raise RunNotFoundError(
                f"no run found under {runs_root}/ (no */{STATE_FILE}); pass RUN as a run "
                "directory path or a name under ./runs/"
            )
        return max(candidates, key=lambda p: (p / STATE_FILE).stat().st_mtime)
    path = Path(run)
    if path.is_dir():
        return _checked_run_dir(path)
    named = runs_root / str(run)
    if named.is_dir():
        return _checked_run_dir(named)
    # `runs_root / "/abs"` is "/abs" again: name the second place only when it differs.
    where = (
        f"{path} is not a directory"
        if named == path
        else f"neither {path} nor {named} is a directory"
    )
    raise RunNotFoundError(
        f"run {str(run)!r} not found: {where}; pass a run directory path or one of the names "
        f"under ./runs/ ({_names(runs_root)})"
    )


def _checked_run_dir(path: Path) -> Path:
    """`path`, unless it is a directory with entries none of which is m3run's (`/etc`)."""
    try:
        entries = {e.name for e in os.scandir(path)}
    except OSError as e:
        raise RunNotFoundError(f"cannot read the run directory {path}: {e}") from None
    if entries and not entries & {*RUN_DIR_FILES, CHECKPOINTS_DIR}:
        raise RunNotFoundError(
            f"{path} is not a run directory: it has none of {STATE_FILE}, {CONFIG_FILE}, "
            f"{CHECKPOINTS_DIR}/; pass a run directory (runs/<name>) or a name under ./runs/"
        )
    return path


def list_runs(root: Path | None = None) -> list[dict]:
    """`m3run list`: every run dir under the runs root, newest first, with its phase, step,
    loss and when its state last changed."""
    root = root if root is not None else runs_root_dir()
    rows = []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        if not _is_run(path):
            continue
        st = collect_status(path)
        rows.append(
            {
                k: st.get(k)
                for k in ("run_dir", "phase", "step", "total_steps", "loss", "updated_at")
            }
        )
    return sorted(rows, key=lambda r: r["updated_at"] or 0.0, reverse=True)


def _names(runs_root: Path) -> str:
    """The run dirs under the runs root, for a message: other folders there (a prepared data
    set, say) are no run to pass."""
    if not runs_root.is_dir():
        return "none: ./runs/ does not exist here"
    names = [p.name for p in sorted(runs_root.iterdir()) if _is_run(p)]
    return ", ".join(names) if names else "none"


def _is_run(path: Path) -> bool:
    """A launched run: a directory with its frozen config or a supervisor's state (what `list`
    shows and names are suggested from)."""
    return (path / STATE_FILE).is_file() or (path / CONFIG_FILE).is_file()


# --------------------------------------------------------------------------- processes


def supervisor_alive(state: RunState | None, run_dir: Path | None = None) -> bool:
    """The supervisor state.json names is alive: its pid was born at the recorded create time
    and, given the run dir, holds that run dir's supervisor.lock (what `stop` requires before
    it signals; status and the liveness check read the pid and create time only)."""
    if not state:
        return False
    pid, born = state.supervisor_pid, state.supervisor_create_time
    if run_dir is None:
        return process_matches(pid, born)
    return owns_lock(pid, born, Path(run_dir) / LOCK_FILE)


def orphan_worker(run_dir: Path) -> int | None:
    """The pid holding the run dir's worker.lock (a worker, alive), else None."""
    return lock_holder(Path(run_dir) / WORKER_LOCK_FILE)


def live_run_process(run_dir: Path) -> tuple[str, int] | None:
    """("supervisor" or "worker", pid) of a process state.json names that is alive and still
    this run's, whatever the lock files say (they may have been deleted): born at its recorded
    create time, as `stop` requires, and running m3run's command line, which stands in for
    the lock a deleted file no longer proves. None when the run is not active or its
    processes are gone. This process never counts (a relaunch from the same process)."""
    state = read_state(run_dir)
    if state is None or state.phase not in ACTIVE_PHASES:
        return None
    for what, pid, born in (
        ("supervisor", state.supervisor_pid, state.supervisor_create_time),
        ("worker", state.worker_pid, state.worker_create_time),
    ):
        if pid != os.getpid() and born_as_recorded(pid, born) and runs_m3run(pid):
            return what, pid
    return None


def effective_phase(state: RunState | None, run_dir: Path | None = None) -> str | None:
    """state.json's phase, or DEAD when it claims an active phase but the supervisor is gone."""
    if not state:
        return None
    phase = state.phase
    if phase in ACTIVE_PHASES and not supervisor_alive(state, run_dir):
        return SupervisorPhase.DEAD
    return phase


def settled_phase(run_dir: Path, by_lock: bool = True) -> tuple[RunState | None, str | None]:
    """state.json and its effective phase, for a reader that acts on or shows DEAD. A
    supervisor writes its final phase and only then releases its lock and exits, so a
    state.json read just before that write, checked against a process gone just after it, would
    call a cleanly ended run DEAD: DEAD stands only when a second read, made after the
    supervisor was seen gone, still names an active phase. ``by_lock``: the supervisor counts
    as alive only while it holds the run dir's lock (what `stop` needs before it signals);
    else its pid and create time are enough (status, the liveness probe)."""
    lock_dir = run_dir if by_lock else None
    state = read_state(run_dir)
    phase = effective_phase(state, lock_dir)
    if phase == SupervisorPhase.DEAD:
        state = read_state(run_dir)
        phase = effective_phase(state, lock_dir)
    return state, phase


# --------------------------------------------------------------------------- files


def read_state(run_dir: Path) -> RunState | None:
    return RunState.from_dict(read_json(Path(run_dir) / STATE_FILE))


def state_problem(run_dir: Path) -> str | None:
    """Why state.json exists but cannot be read (None when it is fine or absent)."""
    path = Path(run_dir) / STATE_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        return f"{path} is unreadable ({e})"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        return f"{path} is not valid JSON ({e}); it was damaged or written by something else"
    if not isinstance(data, dict):
        return f"{path} holds a JSON {type(data).__name__}, not an object"
    return None


def read_heartbeat(run_dir: Path) -> Heartbeat | None:
    return Heartbeat.from_dict(read_json(Path(run_dir) / HEARTBEAT_FILE))


def heartbeat_age(heartbeat: Heartbeat | None, now: float | None = None) -> float | None:
    if heartbeat is None:
        return None
    return max(0.0, (time.time() if now is None else now) - heartbeat.ts)


def _last_train_metrics(run_dir: Path) -> dict:
    """The newest train record of metrics.jsonl, reading only the file's tail."""
    path = Path(run_dir) / METRICS_FILE
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 65536))
            tail = f.read().decode("utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return {}
    for line in reversed(tail):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and rec.get("kind", "train") == "train":
            return rec
    return {}


def _last_complete_checkpoint(run_dir: Path) -> int | None:
    from m3run.runner.checkpoint.layout import CheckpointError, list_checkpoints

    try:
        # Sizes only: status must stay instant even with many multi-GB checkpoints.
        done = [c.step for c in list_checkpoints(run_dir, verify=False) if c.complete]
    except (OSError, CheckpointError):  # a run dir deleted under us is not worth a crash
        return None
    return done[-1] if done else None


# --------------------------------------------------------------------------- status


def collect_status(run_dir: Path) -> dict:
    """What the run dir and the process table say about a run, as one JSON-ready dict: all of
    `m3run status` but the mirror's lag and the GPU rows (runner.cli.report adds those)."""
    run_dir = Path(run_dir)
    found, phase = settled_phase(run_dir, by_lock=False)
    state = found or RunState()
    hb = read_heartbeat(run_dir)
    metrics = _last_train_metrics(run_dir)
    now = time.time()

    def pick(key: str) -> Any:
        value = getattr(hb, key) if hb is not None else None
        return metrics.get(key) if value is None else value

    loss = pick("loss")
    ppl = None  # of the loss shown (the heartbeat's is newer than the last metrics record)
    if isinstance(loss, (int, float)) and math.isfinite(loss) and loss < 50:
        ppl = math.exp(loss)
    step = pick("step")
    total = hb.total_steps if hb is not None else None
    step_time = hb.step_time_s if hb is not None else None
    eta = None  # only while a worker trains: a stopped or finished run has none
    numbers = all(isinstance(v, (int, float)) for v in (step, total, step_time))
    if phase == SupervisorPhase.RUNNING and numbers and total >= step:
        eta = (total - step) * step_time
    last_ckpt = state.last_checkpoint_step
    if last_ckpt is None:
        last_ckpt = _last_complete_checkpoint(run_dir)
    worker_pid = state.worker_pid
    worker_alive = process_matches(worker_pid, state.worker_create_time)
    status = {
        "run_dir": str(run_dir),
        "state_problem": state_problem(run_dir),
        "phase": phase,
        "recorded_phase": state.phase,
        "reason": state.reason,
        # While the preflight smoke test runs: the check under way (number, total, name, started).
        "preflight_check": state.preflight_check if phase == SupervisorPhase.PREFLIGHT else None,
        "worker_phase": hb.phase if hb is not None else None,
        "step": step,
        "total_steps": total,
        "loss": loss,
        "ppl": ppl,
        "lr": pick("lr"),
        "grad_norm": pick("grad_norm"),
        "tokens_per_s": pick("tokens_per_s"),
        "mfu": pick("mfu"),
        "mfu_peak_flops": pick("mfu_peak_flops"),
        "eta_s": eta,
        "heartbeat_age_s": heartbeat_age(hb, now),
        "heartbeat_timeout_s": state.heartbeat_timeout_s,
        "vram_bytes": hb.vram_bytes if hb is not None else None,
        "peak_vram_bytes": state.peak_vram_bytes,
        "last_checkpoint_step": last_ckpt,
        "restarts": state.restarts,
        "last_exit": state.last_exit,
        "lr_scale": state.lr_scale,
        "supervisor_pid": state.supervisor_pid,
        "supervisor_alive": supervisor_alive(state),
        "worker_pid": worker_pid,
        "worker_alive": worker_alive,
        "config_hash": state.config_hash,
        "started_at": state.started_at,
        "updated_at": state.updated_at,
    }
    if phase == SupervisorPhase.FAILED:
        status["error"] = _error_tail(run_dir)
    return status


def _error_tail(run_dir: Path, lines: int = 8) -> list[str]:
    """The end of the worker's error output: from its last `error:` line on, else the last
    few lines of worker.log."""
    try:
        tail = tail_text(Path(run_dir) / WORKER_LOG, 200).splitlines()
    except OSError:
        return []
    starts = [i for i, line in enumerate(tail) if line.startswith("error:")]
    picked = tail[starts[-1] :] if starts else tail[-lines:]
    return picked[:lines]


# --------------------------------------------------------------------------- liveness


def liveness(run_dir: Path, now: float | None = None) -> tuple[bool, str]:
    """(healthy, why) for a container HEALTHCHECK / Kubernetes liveness probe. Reads the run dir
    only and never touches the GPU: healthy while the supervisor process is alive in an active
    phase and, when a worker is running, its heartbeat is within the supervisor's calibrated
    allowance (plus slack for the supervisor's own reaction)."""
    now = time.time() if now is None else now
    state, phase = settled_phase(run_dir, by_lock=False)
    if not state:
        return False, f"no {STATE_FILE} in {run_dir}: no supervisor has run here"
    if phase == SupervisorPhase.DEAD:
        return False, (
            f"supervisor pid {state.supervisor_pid} is gone but {STATE_FILE} says {state.phase!r}"
        )
    if phase in TERMINAL_PHASES:
        return False, f"run is not running (phase {phase}: {state.reason or 'no reason'})"
    updated = state.updated_at
    if isinstance(updated, (int, float)) and now - updated > SUPERVISOR_STALE_S:
        return False, (
            f"supervisor pid {state.supervisor_pid} has not updated {STATE_FILE} for "
            f"{now - updated:.0f}s (it refreshes it every few seconds); it is stuck"
        )
    if phase != SupervisorPhase.RUNNING:
        return True, f"phase {phase}; supervisor pid {state.supervisor_pid} alive"
    hb = read_heartbeat(run_dir)
    started = state.worker_started_at or 0.0
    age = heartbeat_age(hb, now)
    if age is None or hb.ts < started:
        age = now - started if started else None  # no heartbeat from this worker yet
    allowance = state.heartbeat_timeout_s
    if age is None or not isinstance(allowance, (int, float)):
        return True, "running; no heartbeat allowance recorded yet"
    if age > allowance + LIVENESS_SLACK_S:
        return False, (
            f"heartbeat is {age:.0f}s old, over the {allowance:.0f}s allowance + "
            f"{LIVENESS_SLACK_S:.0f}s slack; the supervisor is not healing it"
        )
    return True, f"running; heartbeat {age:.1f}s old (allowance {allowance:.0f}s)"


# --------------------------------------------------------------------------- logs


def log_path(run_dir: Path, supervisor: bool = False) -> Path:
    return Path(run_dir) / (SUPERVISOR_LOG if supervisor else WORKER_LOG)


def follow(
    path: Path,
    run_dir: Path,
    offset: int,
    write: Callable[[str], Any] = sys.stdout.write,
    poll_s: float = 0.25,
    idle_exit_s: float = 1.0,
) -> None:
    """Print what is appended to `path` from `offset` on, until the run is no longer active
    (then drain for `idle_exit_s`) or the user interrupts."""
    idle_since: float | None = None
    while True:
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            data = b""
        if data:
            offset += len(data)
            write(data.decode("utf-8", errors="replace"))
            if hasattr(sys.stdout, "flush"):
                sys.stdout.flush()
        if effective_phase(read_state(run_dir)) in ACTIVE_PHASES:
            idle_since = None
        elif not data:
            idle_since = idle_since or time.monotonic()
            if time.monotonic() - idle_since >= idle_exit_s:
                return
        time.sleep(poll_s)
