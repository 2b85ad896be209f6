"""The contract between the training worker, the supervisor and the CLI. Torch-free.

Everything the three sides exchange goes through the run directory (see DESIGN.md, "Run
directory") and the worker's exit code; this module names both so no side spells them twice.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

# Worker exit codes (sysexits-style).
EXIT_OK = 0
EXIT_STOPPED = 75  # stopped or preempted after a saved checkpoint (EX_TEMPFAIL: "try again")
EXIT_NAN = 76  # a NaN excursion the in-process rollback could not heal
EXIT_CONFIG = 78  # bad config or data (EX_CONFIG): never restarted
# Supervisor exit codes (the container's exit).
EXIT_UNAVAILABLE = 69  # GPU unhealthy: replace the node (EX_UNAVAILABLE)
EXIT_SOFTWARE = 70  # restart budget or no-progress limit spent (EX_SOFTWARE)

CONFIG_FILE = "config.yaml"
STATE_FILE = "state.json"
HEARTBEAT_FILE = "heartbeat.json"


def heartbeat_file(local_rank: int = 0) -> str:
    """Each worker process of a host heartbeats: local rank 0 into heartbeat.json (what status
    shows), the others into heartbeat.local<r>.json (watched for hangs)."""
    return HEARTBEAT_FILE if local_rank == 0 else f"heartbeat.local{local_rank}.json"


METRICS_FILE = "metrics.jsonl"
EVENTS_FILE = "events.jsonl"
LOCK_FILE = "supervisor.lock"
CHECKPOINTS_DIR = "checkpoints"
WORKER_LOG = "worker.log"
SUPERVISOR_LOG = "supervisor.log"

# Test-only fault injection read by the worker (never set in production):
#   M3RUN_FAULT="nan_at_step=7"     the loss of optimizer step 7 becomes NaN (all micro-batches);
#                                   "7x3": the first 3 attempts at step ≥ 7 (skipped steps retry)
#   M3RUN_FAULT="nan_from_step=7"   every step from 7 on is NaN (rollback cannot heal → exit 76)
#   M3RUN_FAULT="hang_at_step=7"    the worker sleeps forever before step 7
#   M3RUN_FAULT="crash_at_step=7"   the worker exits 1 before step 7
#                                   (a checkpoint write in flight finishes first, as in any crash
#                                   that unwinds Python; only a SIGKILL loses it)
#   M3RUN_FAULT="crash_at_startup"  the worker exits 1 before training
#   M3RUN_FAULT="slow_save=2.0"     each checkpoint write sleeps this many seconds mid-write
#                                   (data files written, meta.json not yet; with async_save,
#                                   on the background thread while training goes on)
#   M3RUN_FAULT="save_error_at_step=10"  the checkpoint write for the first save at step ≥ 10
#                                   fails mid-write with an injected OSError (EIO)
# Several faults are separated by commas. Each fires once per process unless named *_from_*.
FAULT_ENV = "M3RUN_FAULT"


def atomic_write_text(path: str | os.PathLike, text: str, *, fsync: bool = True) -> None:
    """Write text to a temp file beside ``path`` and rename it over ``path``."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | os.PathLike, data: Any, *, fsync: bool = False) -> None:
    """Write JSON beside ``path`` and rename it over ``path`` (readers never see a half-written
    file)."""
    atomic_write_text(path, json.dumps(data, sort_keys=True), fsync=fsync)


def read_json(path: str | os.PathLike) -> dict | None:
    """Read a JSON object, or None if the file is missing or not (yet) valid JSON."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError, IsADirectoryError):
        return None
    return data if isinstance(data, dict) else None


def append_jsonl(path: str | os.PathLike, record: dict) -> None:
    """Append one JSON record as a single write (O_APPEND keeps concurrent lines whole)."""
    line = json.dumps(record, sort_keys=True) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """All complete records of a JSONL file (a torn last line from a killed writer is skipped)."""
    out: list[dict] = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(rec, dict):
                    out.append(rec)
    except FileNotFoundError:
        pass
    return out


def now() -> float:
    return time.time()


# Test-only companion of FAULT_ENV, read by the supervisor: "first" passes M3RUN_FAULT to the
# first worker it starts only, so a chaos test can make one worker misbehave and check that the
# restarted one heals the run; "all" (the default) passes it to every worker.
FAULT_SCOPE_ENV = "M3RUN_FAULT_SCOPE"

# The preflight smoke test's result, written by the supervisor's smoke subprocess.
SMOKE_FILE = "smoke.json"


# `m3run stop --grace S` writes {"grace_s": S, "time": ...} here before signalling the
# supervisor; the supervisor gives the worker min(S, supervisor.stop_grace_s) to save.
STOP_REQUEST_FILE = "stop_request.json"


def worker_exit_file(local_rank: int = 0) -> str:
    """Under torchrun (which exits 1 whatever its ranks' codes were) each rank's protocol exit
    code is recorded here by the supervisor's rank wrapper (`python -m runner.supervisor rank`)."""
    return f"worker_exit.local{local_rank}.json"
