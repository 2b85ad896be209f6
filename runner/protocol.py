"""The contract between the training worker, the supervisor and the CLI. Torch-free.

Everything the three sides exchange goes through the run directory (see DESIGN.md, "Run
directory") and the worker's exit code. This module spells each file name, exit code, phase and
record shape once; both sides import it and nothing else of each other.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, Literal

import pydantic

# ----------------------------------------------------------------------------- exit codes

# Worker exit codes (sysexits-style). Any other code is a crash: the supervisor restarts it.
EXIT_OK = 0
EXIT_STOPPED = 75  # stopped or preempted after a saved checkpoint (EX_TEMPFAIL: "try again")
EXIT_NAN = 76  # a NaN excursion the in-process rollback could not heal
EXIT_CONFIG = 78  # bad config or data (EX_CONFIG): never restarted
# A worker whose checkpoint could not be written exits as a crash, so the supervisor restarts
# it from the latest complete checkpoint.
EXIT_SAVE_FAILED = 1
# Supervisor exit codes (the container's exit).
EXIT_UNAVAILABLE = 69  # GPU unhealthy: replace the node (EX_UNAVAILABLE)
EXIT_SOFTWARE = 70  # restart budget or no-progress limit spent (EX_SOFTWARE)
EXIT_REFUSED = 1  # launch refused: the run dir is busy (another supervisor holds the lock)

# ----------------------------------------------------------------------------- file names

CONFIG_FILE = "config.yaml"
STATE_FILE = "state.json"
HEARTBEAT_FILE = "heartbeat.json"
METRICS_FILE = "metrics.jsonl"
EVENTS_FILE = "events.jsonl"
LOCK_FILE = "supervisor.lock"
# flock held by the worker (local rank 0) for its lifetime: one writer per run dir, and the way
# a relaunch finds an orphaned worker (never by a pid read from state.json).
WORKER_LOCK_FILE = "worker.lock"
CHECKPOINTS_DIR = "checkpoints"
WORKER_LOG = "worker.log"
SUPERVISOR_LOG = "supervisor.log"
# The preflight smoke test's result, written by the supervisor's smoke subprocess.
SMOKE_FILE = "smoke.json"
# The check that subprocess is running (SmokeProgress), rewritten as each check starts.
SMOKE_PROGRESS_FILE = "smoke_progress.json"
# `m3run stop --grace S` writes a StopRequest here before signalling the supervisor; the
# supervisor gives the worker min(S, supervisor.stop_grace_s) to save.
STOP_REQUEST_FILE = "stop_request.json"
# The run's tokenizer as a HF tokenizer.json, copied (or converted from tiktoken's gpt2) at the
# first launch: generate and export need nothing outside the run dir.
TOKENIZER_FILE = "tokenizer.json"
# Per-rank files of a torchrun worker: every local rank heartbeats (rank 0 into heartbeat.json,
# what status shows; the others beside it, watched for hangs), and each rank's protocol exit
# code is recorded by the rank wrapper, since torchrun exits 1 whatever its ranks' codes were.
RANK_HEARTBEAT_GLOB = "heartbeat.local*.json"
WORKER_EXIT_GLOB = "worker_exit.local*.json"
# Every file m3run writes at a run dir's top level (the per-rank ones match the globs above).
RUN_DIR_FILES = (
    CONFIG_FILE,
    STATE_FILE,
    HEARTBEAT_FILE,
    METRICS_FILE,
    EVENTS_FILE,
    LOCK_FILE,
    WORKER_LOCK_FILE,
    WORKER_LOG,
    SUPERVISOR_LOG,
    SMOKE_FILE,
    SMOKE_PROGRESS_FILE,
    STOP_REQUEST_FILE,
    TOKENIZER_FILE,
)


def heartbeat_file(local_rank: int = 0) -> str:
    """heartbeat.json for local rank 0, heartbeat.local<r>.json for the others."""
    return HEARTBEAT_FILE if local_rank == 0 else f"heartbeat.local{local_rank}.json"


def worker_exit_file(local_rank: int = 0) -> str:
    """Where the rank wrapper records local rank `local_rank`'s exit code."""
    return f"worker_exit.local{local_rank}.json"


# ----------------------------------------------------------------------------- environment

# Test-only fault injection read by the worker (never set in production):
#   M3RUN_FAULT="nan_at_step=7"     the loss of optimizer step 7 becomes NaN (all micro-batches);
#                                   "7x3": the first 3 attempts at step ≥ 7 (skipped steps retry)
#   M3RUN_FAULT="nan_from_step=7"   every step from 7 on is NaN (rollback cannot heal → exit 76)
#   M3RUN_FAULT="hang_at_step=7"    the worker sleeps forever before step 7
#   M3RUN_FAULT="hold_at_step=7"    the worker waits before step 7 (heartbeat going) until
#                                   SIGTERM/SIGINT, then runs step 7 and stops: a test's pacing
#   M3RUN_FAULT="crash_at_step=7"   the worker exits 1 before step 7
#                                   (a checkpoint write in flight finishes first, as in any crash
#                                   that unwinds Python; only a SIGKILL loses it)
#   M3RUN_FAULT="crash_at_startup"  the worker exits 1 before training
#   M3RUN_FAULT="slow_save=2.0"     each checkpoint write sleeps this many seconds mid-write
#                                   (data files written, meta.json not yet; with async_save,
#                                   on the background thread while training goes on)
#   M3RUN_FAULT="hold_save=PATH"    each checkpoint write waits mid-write until PATH exists
#                                   (bounded: worker/faults.py HOLD_SAVE_MAX_S): a test's pacing
#                                   by a file, not by a sleep
#                                   (a cancelled write ends either wait at once, as a real one
#                                   stops at its next block)
#   M3RUN_FAULT="stall_save_at_step=10"  the write of the first checkpoint at step ≥ 10 stops
#                                   mid-write for good (a torn write that waits for a SIGKILL)
#   M3RUN_FAULT="save_error_at_step=10"  the checkpoint write for the first save at step ≥ 10
#                                   fails mid-write with an injected OSError (EIO)
# Several faults are separated by commas. Each fires once per process unless named *_from_*.
FAULT_ENV = "M3RUN_FAULT"
# Each fault's value: "step" a step number (nan_at_step also "7x3"), "seconds" a number, "path"
# a file path, "" none.
FAULTS = {
    "nan_at_step": "step",
    "nan_from_step": "step",
    "hang_at_step": "step",
    "hold_at_step": "step",
    "crash_at_step": "step",
    "crash_at_startup": "",
    "slow_save": "seconds",
    "hold_save": "path",
    "stall_save_at_step": "step",
    "save_error_at_step": "step",
}
# Test-only companion of FAULT_ENV, read by the supervisor: "first" passes M3RUN_FAULT to the
# first worker it starts only, so a chaos test can make one worker misbehave and check that the
# restarted one heals the run; "all" (the default) passes it to every worker.
FAULT_SCOPE_ENV = "M3RUN_FAULT_SCOPE"
# Test-only fault of the warm spare, read by `--standby` alone and passed to every spare whatever
# M3RUN_FAULT_SCOPE says: "crash_at_import" makes each spare exit 1 during its imports, before it
# reads its arguments (a spare that cannot start); "hang_at_import" makes it sleep there for
# good, alive but never ready (a wedged spare); a worker started plainly ignores it.
SPARE_FAULT_ENV = "M3RUN_SPARE_FAULT"
# Set by the supervisor for a warm spare: the descriptor of a pipe on which the spare writes one
# byte once its imports are done, so a spare that is alive but never got there is told apart.
SPARE_READY_FD_ENV = "M3RUN_SPARE_READY_FD"
# Set by the supervisor for the worker it starts: its own pid, so the worker can tell its
# supervisor's supervisor.lock from another supervisor's (then it refuses to write).
SUPERVISOR_PID_ENV = "M3RUN_SUPERVISOR_PID"
# The worker's one argument as a warm spare (`python -m m3run.runner.train --standby`): import, then
# read the worker's arguments as a JSON list from one line of stdin (runner/supervisor/spare.py).
STANDBY_ARG = "--standby"
# Set by the supervisor for the processes it starts (the worker, the smoke test): the console's
# LogFormat. With json the worker prints each logged step and eval, and the smoke test each
# check, as one WorkerRecord (JSON) instead of a text line, and the supervisor puts its fields
# on its own JSON console; every other line stays text, which the supervisor wraps in a record.
LOG_FORMAT_ENV = "M3RUN_LOG_FORMAT"
# events.jsonl "event" of a supervisor whose console is gone (a closed terminal's SIGHUP, EIO or
# EPIPE on stdout): the run goes on, recorded in the run dir only, as a detached one is.
CONSOLE_LOST_EVENT = "console_lost"
# events.jsonl "event"s of the warm spare (runner/supervisor/spare.py): one spare exited before it
# was handed a run; one was found stopped at the handover and killed; too many failed, so the
# run goes on without spares.
SPARE_FAILED_EVENT = "spare_failed"
SPARE_DISCARDED_EVENT = "spare_discarded"
SPARES_OFF_EVENT = "spares_off"

# ----------------------------------------------------------------------------- phases


class LogFormat(StrEnum):
    """The console's format (`m3run launch --log-format`): text for people, json (one object
    per line) for log collectors."""

    TEXT = "text"
    JSON = "json"


class SupervisorPhase(StrEnum):
    """state.json "phase"."""

    PREFLIGHT = "preflight"  # lock taken, config frozen, GPU health gate and smoke test running
    RUNNING = "running"  # a worker is alive and supervised
    RESTARTING = "restarting"  # the worker died or hung; waiting out the backoff
    STOPPING = "stopping"  # a stop or preemption was requested; the worker is saving
    FINISHED = "finished"  # the worker trained to total_steps (supervisor exit 0)
    STOPPED = "stopped"  # stopped by the user after a save (supervisor exit 0)
    PREEMPTED = "preempted"  # cloud preemption notice; saved and exited (supervisor exit 75)
    FAILED = "failed"  # gave up: bad config, unhealthy GPU, restart budget (exit 78/69/70)
    # Never written: reported by readers when state.json claims an active phase but the
    # supervisor's pid is gone (it was SIGKILLed, OOM-killed, or the host rebooted).
    DEAD = "dead"


ACTIVE_PHASES = frozenset(
    {
        SupervisorPhase.PREFLIGHT,
        SupervisorPhase.RUNNING,
        SupervisorPhase.RESTARTING,
        SupervisorPhase.STOPPING,
    }
)
TERMINAL_PHASES = frozenset(
    {
        SupervisorPhase.FINISHED,
        SupervisorPhase.STOPPED,
        SupervisorPhase.PREEMPTED,
        SupervisorPhase.FAILED,
    }
)


class WorkerPhase(StrEnum):
    """heartbeat.json "phase"."""

    STARTUP = "startup"  # imports, building the model, optimizer and data loader
    LOADING = "loading"  # reading the checkpoint it resumes from
    COMPILING = "compiling"  # the first steps under torch.compile / Triton autotuning
    TRAINING = "training"
    CHECKPOINTING = "checkpointing"  # waiting for a checkpoint write
    EVAL = "eval"
    STOPPING = "stopping"  # a stop was requested: saving, then exit 75
    FINISHED = "finished"  # the last heartbeat before exit 0
    STOPPED = "stopped"  # the last heartbeat before exit 75
    FAILED = "failed"  # the last heartbeat before exit 76


# The worker's last phase before it exits, and the exit code each stands for.
FINAL_WORKER_PHASES = {
    WorkerPhase.FINISHED: EXIT_OK,
    WorkerPhase.STOPPED: EXIT_STOPPED,
    WorkerPhase.FAILED: EXIT_NAN,
}

# ----------------------------------------------------------------------------- records


def _number(value: Any) -> float | None:
    """A finite int or float from a JSON value, else None (bool is not a number here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if math.isfinite(value) else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _phase(enum: type[StrEnum], value: Any) -> Any:
    try:
        return enum(value)
    except ValueError:
        return None


@dataclass(frozen=True)
class Heartbeat:
    """heartbeat.json: what a worker rank last said about itself. Written by the worker (atomic
    replace, every log.heartbeat_interval_s at most); read by the supervisor for hang detection
    and VRAM, and by `m3run status`. Every field but ``ts`` may be missing."""

    ts: float
    phase: WorkerPhase | None = None
    pid: int | None = None
    step: int | None = None
    total_steps: int | None = None
    loss: float | None = None
    lr: float | None = None
    grad_norm: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    # The FLOP/s the MFU is a fraction of (the GPU's nominal dense bf16 peak, or M3RUN_PEAK_FLOPS).
    mfu_peak_flops: float | None = None
    vram_bytes: int | None = None
    step_time_s: float | None = None
    checkpoint_time_s: float | None = None
    checkpoint_write_s: float | None = None
    checkpoint_in_flight_step: int | None = None
    last_checkpoint_step: int | None = None

    @classmethod
    def from_dict(cls, data: dict | None) -> Heartbeat | None:
        """The record, or None when `data` has no numeric ``ts`` (missing, torn or foreign).
        Fields of the wrong type read as missing."""
        if not data or _number(data.get("ts")) is None:
            return None
        values: dict[str, Any] = {"ts": float(data["ts"])}
        for f in dataclasses.fields(cls):
            if f.name == "ts":
                continue
            raw = data.get(f.name)
            if f.name == "phase":
                values["phase"] = _phase(WorkerPhase, raw)
            elif f.name in _HEARTBEAT_INTS:
                values[f.name] = _int(raw)
            else:
                values[f.name] = _number(raw)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_HEARTBEAT_INTS = frozenset(
    {
        "pid",
        "step",
        "total_steps",
        "vram_bytes",
        "checkpoint_in_flight_step",
        "last_checkpoint_step",
    }
)


@dataclass(frozen=True)
class WorkerExit:
    """worker_exit.local<r>.json: one torchrun rank's protocol exit code."""

    code: int
    time: float
    pid: int | None = None

    @classmethod
    def from_dict(cls, data: dict | None) -> WorkerExit | None:
        if not data:
            return None
        code, when = _int(data.get("code")), _number(data.get("time"))
        if code is None or when is None:
            return None
        return cls(code=code, time=float(when), pid=_int(data.get("pid")))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class StopRequest:
    """stop_request.json: `m3run stop --grace S` asks for at most S seconds of save time."""

    grace_s: float
    time: float
    pid: int | None = None

    @classmethod
    def from_dict(cls, data: dict | None) -> StopRequest | None:
        if not data:
            return None
        grace, when = _number(data.get("grace_s")), _number(data.get("time"))
        if grace is None or when is None:
            return None
        return cls(grace_s=float(grace), time=float(when), pid=_int(data.get("pid")))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class StopSaveFigures:
    """What a save on a stop costs this run, as the smoke test measured it: the bytes of one
    full checkpoint (the weights and the optimizer state) and the run dir's filesystem write
    speed in bytes per second. Kept under "stop_save" in smoke.json and in state.json's
    smoke_passed record, so that a relaunch that skips the smoke test still has them."""

    checkpoint_bytes: int
    write_bytes_per_s: float

    @property
    def write_s(self) -> float:
        """Seconds to write one full checkpoint at the measured speed."""
        return self.checkpoint_bytes / self.write_bytes_per_s

    @classmethod
    def from_dict(cls, data: Any) -> StopSaveFigures | None:
        """None for a record without the figures (one written before they were measured) or
        with damaged ones."""
        if not isinstance(data, dict):
            return None
        size, speed = _int(data.get("checkpoint_bytes")), _number(data.get("write_bytes_per_s"))
        if size is None or speed is None or size <= 0 or speed <= 0:
            return None
        return cls(checkpoint_bytes=size, write_bytes_per_s=float(speed))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SmokeVerdict:
    """smoke.json: the preflight smoke subprocess's verdict; ``stop_save`` when check 7 could
    measure it."""

    ok: bool
    message: str
    checks: list = dataclasses.field(default_factory=list)
    stop_save: StopSaveFigures | None = None

    @classmethod
    def from_dict(cls, data: dict | None) -> SmokeVerdict | None:
        if not data or not isinstance(data.get("ok"), bool):
            return None
        checks = data.get("checks")
        return cls(
            ok=data["ok"],
            message=str(data.get("message")),
            checks=checks if isinstance(checks, list) else [],
            stop_save=StopSaveFigures.from_dict(data.get("stop_save")),
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SmokeProgress:
    """smoke_progress.json: the check the preflight smoke subprocess is running, `number` of
    `total`, since `started`. The supervisor copies it into state.json ("preflight_check") so
    that `m3run status` shows where a long smoke test is."""

    number: int
    total: int
    name: str
    started: float

    @classmethod
    def from_dict(cls, data: dict | None) -> SmokeProgress | None:
        if not data:
            return None
        number, total = _int(data.get("number")), _int(data.get("total"))
        name, started = data.get("name"), _number(data.get("started"))
        if number is None or total is None or not isinstance(name, str) or started is None:
            return None
        return cls(number=number, total=total, name=name, started=float(started))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- console records


class _WorkerRecord(pydantic.BaseModel):
    # Closed, and read strictly (parse_worker_record): a line some library printed that happens
    # to be JSON is not taken for a record (it is echoed as a plain line).
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    def level(self) -> str:
        """The console level of the record."""
        return "info"


class StepRecord(_WorkerRecord):
    """A logged training step as the worker prints it on a json console: metrics.jsonl's train
    record plus what only the console line says (total steps, ETA, peak VRAM)."""

    event: Literal["train"] = "train"
    time: float
    step: int
    total_steps: int
    loss: float
    ppl: float
    lr: float
    grad_norm: float
    tokens_per_s: float
    tokens_seen: int
    mfu: float | None = None
    vram_bytes: int | None = None
    eta_s: float | None = None
    tokens_by_source: dict[str, int] | None = None


class EvalRecord(_WorkerRecord):
    """An eval as the worker prints it on a json console."""

    event: Literal["eval"] = "eval"
    time: float
    step: int
    eval_loss: float
    ppl: float


class SmokeCheckRecord(_WorkerRecord):
    """One preflight smoke check's outcome as the smoke subprocess prints it on a json
    console."""

    event: Literal["smoke_check"] = "smoke_check"
    time: float
    number: int
    total: int
    name: str
    status: Literal["ok", "failed", "skipped"]
    seconds: float
    message: str

    def level(self) -> str:
        return "error" if self.status == "failed" else "info"


WorkerRecord = Annotated[
    StepRecord | EvalRecord | SmokeCheckRecord, pydantic.Field(discriminator="event")
]


@functools.cache
def _worker_record() -> pydantic.TypeAdapter:
    return pydantic.TypeAdapter(WorkerRecord)


def worker_record_line(record: StepRecord | EvalRecord | SmokeCheckRecord) -> str:
    """The one line a worker prints for `record` (non-finite numbers as null)."""
    return record.model_dump_json()


def parse_worker_record(line: str) -> StepRecord | EvalRecord | SmokeCheckRecord | None:
    """The record a worker line holds, or None for any other line (text, foreign JSON)."""
    if not line.startswith("{"):
        return None
    try:
        return _worker_record().validate_json(line, strict=True)
    except pydantic.ValidationError:
        return None


@dataclass
class RunState:
    """state.json: what the run's supervisor says about it. Written by the supervisor (atomic
    replace on every change, refreshed every few seconds); read by `m3run status`, `stop`, the
    liveness check and the next supervisor. Read through `from_dict`, which takes a damaged or
    forged file field by field: a value of the wrong type reads as missing."""

    phase: SupervisorPhase | None = None
    reason: str | None = None
    supervisor_pid: int | None = None
    supervisor_create_time: float | None = None
    worker_pid: int | None = None
    worker_create_time: float | None = None
    worker_started_at: float | None = None
    started_at: float | None = None
    updated_at: float | None = None
    config_hash: str | None = None
    run_dir: str | None = None
    resume: str | None = None
    lr_scale: float | None = None
    exit_code: int | None = None
    last_exit: dict | None = None
    last_checkpoint_step: int | None = None
    heartbeat_timeout_s: float | None = None
    stop_grace_s: float | None = None
    mirror_flush_s: float | None = None
    peak_vram_bytes: int | None = None
    longest_startup_s: float | None = None
    # The last smoke test that passed here: config_hash, device (GPU UUIDs or host), time.
    smoke_passed: dict | None = None
    # While the preflight smoke test runs: the check under way (a SmokeProgress dict).
    preflight_check: dict | None = None
    # One record per restart across every supervisor of the run: time, reason, kind,
    # exit_code, resume, resume_step, lr_scale, backoff_s, supervisor_pid.
    restarts: list[dict] = dataclasses.field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict | None) -> RunState | None:
        if not isinstance(data, dict):
            return None
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = data.get(f.name)
            if f.name == "phase":
                values[f.name] = _phase(SupervisorPhase, raw)
            elif f.name in _STATE_INTS:
                values[f.name] = _int(raw)
            elif f.name in _STATE_TEXTS:
                values[f.name] = raw if isinstance(raw, str) else None
            elif f.name in ("last_exit", "smoke_passed", "preflight_check"):
                values[f.name] = raw if isinstance(raw, dict) else None
            elif f.name == "restarts":
                values[f.name] = (
                    [r for r in raw if isinstance(r, dict)] if isinstance(raw, list) else []
                )
            else:
                values[f.name] = _number(raw)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_STATE_INTS = frozenset(
    {"supervisor_pid", "worker_pid", "exit_code", "last_checkpoint_step", "peak_vram_bytes"}
)
_STATE_TEXTS = frozenset({"reason", "config_hash", "run_dir", "resume"})
