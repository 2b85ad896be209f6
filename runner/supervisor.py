"""The supervisor: keeps one training worker alive until the run finishes, stops or is preempted.

One supervisor owns a run directory (``supervisor.lock``, an flock). It freezes the resolved
config, gates on GPU health and a preflight smoke test, then starts the worker as a child
process in its own process group and watches it:

* exit code (runner.protocol): 0 finished · 75 stopped after a save · 76 NaN not healed ·
  78 bad config/data · anything else a crash;
* heartbeat age against an allowance: ``startup_timeout_s`` until the worker trains, then one
  calibrated from the observed step, checkpoint and eval times × ``heartbeat_safety_factor``
  (or the fixed ``heartbeat_timeout_s``). A stale worker is SIGTERMed, SIGKILLed after
  ``stop_grace_s`` and restarted;
* VRAM (heartbeat ``vram_bytes`` and NVML per process): the peak is recorded, a warning logged
  near capacity;
* every new checkpoint is verified complete (sha256) in a background thread.

Restart policy: exponential backoff (``backoff_initial_s`` doubling up to ``backoff_max_s``);
at most ``max_restarts`` restarts per ``restart_window_s``; ``no_progress_restarts`` restarts in
a row without a new complete checkpoint end the run (exit 70). Exit 76 restarts from the
checkpoint before the latest one with the learning rate scaled by ``nan_lr_factor`` (squared,
cubed, … for consecutive exits 76); exit 78 is never restarted. Before a relaunch the dead
worker's GPU memory must be released and the GPU healthy.

SIGTERM/SIGINT/SIGHUP to the supervisor and cloud preemption notices are forwarded to the worker
as SIGTERM (it saves at the next step boundary and exits 75); ``stop_grace_s`` later it is
SIGKILLed. A second signal kills it at once.

Stop timeouts. ``stop_grace_s`` (default 120 s: a 435M checkpoint with optimizer state is ~5 GB)
must fit inside the container runtime's own stop timeout, or the runtime SIGKILLs everything
mid-save. Docker waits 10 s by default and Kubernetes 30 s: configure them above the grace plus
a few seconds for the supervisor, e.g. ``docker run --stop-timeout 150`` / compose
``stop_grace_period: 150s`` / ``terminationGracePeriodSeconds: 150``. A spot notice gives less
time than that (GCP about 30 s, Azure at least 30 s, AWS 2 min); the save has to fit in it
whatever the grace is, so keep checkpoints frequent on spot capacity.

This module never imports torch: the preflight smoke test, which does, runs in a subprocess.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import structlog
import yaml

from runner import runstate
from runner.checkpoint.layout import CheckpointInfo, list_checkpoints, verify_checkpoint
from runner.files import append_jsonl, atomic_write_json, atomic_write_text, read_json
from runner.protocol import (
    CONFIG_FILE,
    EVENTS_FILE,
    EXIT_CONFIG,
    EXIT_NAN,
    EXIT_OK,
    EXIT_SOFTWARE,
    EXIT_STOPPED,
    EXIT_UNAVAILABLE,
    FAULT_ENV,
    FAULT_SCOPE_ENV,
    HEARTBEAT_FILE,
    LOCK_FILE,
    SMOKE_FILE,
    STATE_FILE,
    STOP_REQUEST_FILE,
    SUPERVISOR_LOG,
    WORKER_LOG,
    worker_exit_file,
)
from runner.runstate import (
    FAILED,
    FINISHED,
    PREEMPTED,
    PREFLIGHT,
    RESTARTING,
    RUNNING,
    STOPPED,
    STOPPING,
)

EXIT_REFUSED = 1  # launch refused: the run dir is busy (another supervisor holds the lock)

# Worker heartbeat phases that precede training: the startup allowance applies.
_STARTUP_PHASES = frozenset({None, "startup", "compiling"})
_SAVE_PHASES = frozenset({"checkpointing", "stopping"})
# The worker's last heartbeat phase before it exits, and the exit code each stands for.
_FINAL_PHASES = {"finished": EXIT_OK, "stopped": EXIT_STOPPED, "failed": EXIT_NAN}
_STATE_REFRESH_S = 2.0  # state.json's updated_at is refreshed at least this often
_CHECKPOINT_SCAN_S = 1.0


class LaunchError(Exception):
    """A launch the supervisor refuses. ``exit_code`` is the supervisor's exit code."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


# --------------------------------------------------------------------------- settings


@dataclass
class SupervisorSettings:
    """The supervisor section of the run config, plus the worker's heartbeat cadence.

    Defaults match runner.config.SupervisorConfig; `from_config` copies a loaded config."""

    max_restarts: int = 10
    restart_window_s: float = 3600.0
    no_progress_restarts: int = 3
    backoff_initial_s: float = 2.0
    backoff_max_s: float = 300.0
    startup_timeout_s: float = 900.0
    heartbeat_timeout_s: float | None = None
    heartbeat_safety_factor: float = 5.0
    stop_grace_s: float = 120.0
    nan_lr_factor: float = 0.5
    preemption_provider: str = "auto"
    preemption_poll_s: float = 5.0
    metadata_url: str | None = None
    smoke: bool = True
    vram_warn_fraction: float = 0.95
    # From log.heartbeat_interval_s: a training worker writes heartbeat.json this often at most.
    heartbeat_interval_s: float = 2.0
    # Not in the config: a floor under the calibrated allowance (scheduler jitter, page cache
    # flushes and GC pauses should never look like a hang) and the watch loop's poll period.
    min_heartbeat_timeout_s: float = 30.0
    poll_s: float = 0.2
    # From the checkpoint section: the object-storage mirror the supervisor keeps up to date
    # (None: no mirror), how many checkpoints it keeps there, and how long the supervisor waits
    # at the end of the run for the newest checkpoint to reach it.
    mirror_url: str | None = None
    mirror_keep_last: int = 3
    mirror_flush_s: float = 60.0
    # Seconds to wait for a dead worker's GPU memory to be released before relaunching.
    gpu_release_timeout_s: float = 60.0
    health_timeout_s: float = 30.0

    @classmethod
    def from_config(cls, cfg: Any, **extra: Any) -> SupervisorSettings:
        sup = cfg.supervisor
        # Every field the config's supervisor section also has, by name: a new config key
        # reaches the supervisor without a second list to keep in step.
        names = [f.name for f in dataclasses.fields(cls) if f.name in type(sup).model_fields]
        values = {n: getattr(sup, n) for n in names}
        values["heartbeat_interval_s"] = cfg.log.heartbeat_interval_s
        values["mirror_url"] = cfg.checkpoint.mirror_url
        values["mirror_keep_last"] = cfg.checkpoint.keep_last
        values["mirror_flush_s"] = cfg.checkpoint.mirror_flush_s
        values.update(extra)
        return cls(**values)


# --------------------------------------------------------------------------- logging


class EventLog:
    """Supervisor transitions: one record in events.jsonl, one structured line in
    supervisor.log (JSON), and optionally one line on the console (human on a terminal,
    JSON otherwise)."""

    def __init__(self, run_dir: Path, console: bool):
        self.run_dir = run_dir
        self._file = open(run_dir / SUPERVISOR_LOG, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        timestamper = structlog.processors.TimeStamper(fmt="iso", utc=True)
        self._log = structlog.wrap_logger(
            structlog.PrintLogger(self._file),
            processors=[
                structlog.processors.add_log_level,
                timestamper,
                structlog.processors.JSONRenderer(sort_keys=True),
            ],
        )
        self._console = None
        if console:
            tty = sys.stdout.isatty()
            renderer = (
                structlog.dev.ConsoleRenderer(colors=True)
                if tty
                else structlog.processors.JSONRenderer(sort_keys=True)
            )
            self._console = structlog.wrap_logger(
                structlog.PrintLogger(sys.stdout),
                processors=[
                    structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=False),
                    renderer,
                ],
            )

    def emit(
        self, event: str, reason: str | None = None, level: str = "info", **fields: Any
    ) -> None:
        record = {"time": time.time(), "event": event, "reason": reason, **fields}
        append_jsonl(self.run_dir / EVENTS_FILE, record)
        getattr(self._log, level)(event, reason=reason, **fields)
        if self._console is not None:
            getattr(self._console, level)(event, reason=reason, **fields)

    def echo(self, line: str) -> None:
        """A worker output line in the foreground console."""
        if self._console is not None:
            sys.stdout.write(line)
            sys.stdout.flush()

    def close(self) -> None:
        self._file.close()


class _LogTail:
    """New complete lines appended to a file since a byte offset (the worker's log)."""

    def __init__(self, path: Path, offset: int):
        self.path, self.offset, self._partial = path, offset, b""

    def lines(self, final: bool = False) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read(1 << 20)
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self._partial + data
        *complete, self._partial = data.split(b"\n")
        if final and self._partial:
            complete.append(self._partial)
            self._partial = b""
        return [c.decode("utf-8", errors="replace") + "\n" for c in complete]


# --------------------------------------------------------------------------- lock


class RunLock:
    """`supervisor.lock`: an exclusive flock held for the supervisor's lifetime. The file holds
    the holder's pid so a refused launch can name it. The kernel drops the lock when the holder
    dies, however it dies."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            run_dir = self.path.parent
            raise LaunchError(
                f"run dir {run_dir} is busy: supervisor pid {holder} holds {self.path}. "
                f"Watch it with `m3run status {run_dir}`, stop it with `m3run stop {run_dir}`, "
                "or launch into another --run-dir",
                EXIT_REFUSED,
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


# --------------------------------------------------------------------------- helpers


def _signal_group(pid: int, sig: int) -> None:
    """Signal the worker's process group (it leads its own session: torchrun's ranks, data
    loader processes and the worker all get it)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _create_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}"
    return f"exit {code}"


def _ckpt_key(info: CheckpointInfo) -> tuple[int, int]:
    """(step, meta.json mtime): a re-saved step is a new checkpoint."""
    try:
        mtime = (info.path / "meta.json").stat().st_mtime_ns
    except OSError:
        mtime = 0
    return info.step, mtime


class _CheckpointVerifier:
    """Hashes new checkpoints off the watch loop (a 435M run's checkpoint is ~5 GB)."""

    def __init__(self) -> None:
        self._todo: queue.Queue[tuple[int, int, Path] | None] = queue.Queue()
        self.done: queue.Queue[tuple[int, int, bool, str | None]] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="ckpt-verify", daemon=True)
        self._thread.start()

    def submit(self, step: int, mtime: int, path: Path) -> None:
        self._todo.put((step, mtime, path))

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
                step, mtime, path = item
                try:
                    ok, reason = verify_checkpoint(path, full=True)
                except Exception as e:  # never let the thread die: drain() would wait forever
                    ok, reason = False, f"could not verify: {type(e).__name__}: {e}"
                self.done.put((step, mtime, ok, reason))
            finally:
                self._todo.task_done()


# --------------------------------------------------------------------------- the supervisor


@dataclass
class _Outcome:
    """How one worker ended."""

    exit_code: int
    hang: str | None = None  # the reason when the supervisor killed it as hung
    killed_after_grace: bool = False


WorkerArgv = Callable[[str, float], list[str]]
Smoke = Callable[["Supervisor"], tuple[bool, str]]


class GpuProbe:
    """The supervisor's view of the GPUs, through runner.health (NVML; no torch, no CUDA
    context). Tests substitute a fake with the same three methods."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s

    def check(self, allowed_pids: list[int]) -> Any:
        """A HealthReport: `.verdict` in healthy/warn/unhealthy/no_gpu, `.summary()`,
        `.to_dict()`."""
        from runner.health import check_gpu_health

        return check_gpu_health(self.timeout_s, allowed_pids=allowed_pids)

    def process_memory(self, pid: int) -> int | None:
        from runner.health import process_gpu_memory

        return process_gpu_memory(pid)

    def wait_released(self, pids: list[int], timeout_s: float) -> Any:
        from runner.health import wait_gpu_memory_released

        return wait_gpu_memory_released(pids, timeout_s)


def worker_argv(run_dir: Path, distributed: Any = None) -> WorkerArgv:
    """The real worker: `python -m runner.train RUN_DIR/config.yaml --run-dir RUN_DIR --resume R
    [--lr-scale F]`, through torchrun when the config's `distributed` section asks for more than
    one process (torchrun never restarts on its own: the supervisor does)."""

    def build(resume: str, lr_scale: float) -> list[str]:
        argv = [
            sys.executable,
            "-m",
            "runner.train",
            str(run_dir / CONFIG_FILE),
            "--run-dir",
            str(run_dir),
            "--resume",
            resume,
        ]
        if lr_scale != 1.0:
            argv += ["--lr-scale", repr(lr_scale)]
        d = distributed
        if d is None or (d.nproc_per_node == 1 and d.nnodes == 1):
            return argv
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(d.nproc_per_node),
            "--max-restarts",
            "0",
        ]
        if d.nnodes == 1:
            launcher.append("--standalone")
        else:
            launcher += [
                "--nnodes",
                str(d.nnodes),
                "--node-rank",
                str(d.node_rank),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                d.rdzv_endpoint,
                "--rdzv-id",
                d.rdzv_id or Path(run_dir).absolute().name,
            ]
        # torchrun runs each rank as `python -m runner.supervisor rank <worker args>`, which
        # records the rank's exit code (torchrun itself exits 1 on any failure).
        return [*launcher, "-m", "runner.supervisor", "rank", *argv[3:]]

    return build


def _is_torchrun(argv: Sequence[str]) -> bool:
    return "torch.distributed.run" in argv[:3]


def _nproc(argv: Sequence[str]) -> int:
    if "--nproc-per-node" in argv:
        return int(argv[argv.index("--nproc-per-node") + 1])
    return 1


def _rank_main(argv: Sequence[str]) -> int:
    """One torchrun rank: run the worker in this process and record its exit code."""
    from runner.train import main as train_main

    code = train_main(list(argv))
    parsed = argparse.ArgumentParser(add_help=False)
    parsed.add_argument("--run-dir", type=Path)
    run_dir = parsed.parse_known_args(list(argv))[0].run_dir
    if run_dir is not None and run_dir.is_dir():
        rank = int(os.environ.get("LOCAL_RANK", "0"))
        atomic_write_json(
            run_dir / worker_exit_file(rank),
            {"code": code, "pid": os.getpid(), "time": time.time()},
        )
    return code


class Supervisor:
    """Supervise one run directory. `run()` returns the supervisor's exit code.

    `worker_argv(resume, lr_scale)` builds the worker command line; `gpu` (a GpuProbe) gates
    on GPU health before the first launch and every restart and reads per-process VRAM (None:
    no GPU checks); `smoke` is the preflight smoke test (None skips it). The lock and config
    freezing are `launch()`'s."""

    def __init__(
        self,
        run_dir: Path,
        settings: SupervisorSettings,
        worker_argv: WorkerArgv,
        *,
        resume: str = "latest",
        lr_scale: float = 1.0,
        console: bool = False,
        config_hash: str | None = None,
        gpu: GpuProbe | None = None,
        smoke: Smoke | None = None,
        env: dict[str, str] | None = None,
        handle_signals: bool = True,
    ):
        self.run_dir = Path(run_dir)
        self.s = settings
        self.worker_argv = worker_argv
        self.resume = resume
        self.lr_scale = lr_scale
        self.config_hash = config_hash
        self.gpu = gpu
        self._has_gpu = False  # set by the health gate: NVML polling only on a GPU host
        self.smoke = smoke
        self.env = dict(os.environ if env is None else env)
        self.handle_signals = handle_signals
        self.log = EventLog(self.run_dir, console)

        # Re-entrant: request_stop runs in signal handlers, and a second signal may arrive
        # while the first handler holds it.
        self._lock = threading.RLock()
        self._stop_kind: str | None = None  # "user" | "preempted"
        self._stop_detail = ""
        self._grace_used = settings.stop_grace_s
        self._force = False
        self._proc: subprocess.Popen | None = None
        self._attempt = 0
        self._spawn_wall = 0.0
        self._tail: _LogTail | None = None
        self._torchrun = False
        self._local_ranks = 1

        prev = read_json(self.run_dir / STATE_FILE) or {}
        self.state: dict[str, Any] = {
            "supervisor_pid": os.getpid(),
            "supervisor_create_time": _create_time(os.getpid()),
            "worker_pid": None,
            "worker_create_time": None,
            "worker_started_at": None,
            "phase": PREFLIGHT,
            "restarts": list(prev.get("restarts", [])),  # history across relaunches
            "last_exit": None,
            "reason": None,
            "config_hash": config_hash,
            "started_at": time.time(),
            "updated_at": time.time(),
            "last_checkpoint_step": None,
            "peak_vram_bytes": prev.get("peak_vram_bytes"),
            "heartbeat_timeout_s": settings.startup_timeout_s,
            "stop_grace_s": settings.stop_grace_s,
            "mirror_flush_s": settings.mirror_flush_s if settings.mirror_url else 0.0,
            "lr_scale": lr_scale,
            "resume": resume,
            "run_dir": str(self.run_dir),
        }
        self._prev_state = prev
        self._last_state_write = 0.0

        # Restart accounting (this supervisor's lifetime only).
        self._restart_times: list[float] = []
        self._restarts_since_progress = 0
        # Checkpoints: keys already known, checkpoints the worker must not resume from.
        self._known: set[tuple[int, int]] = set()
        self._reported_torn: set[tuple[int, int]] = set()
        self._stale: dict[int, int] = {}  # step -> meta mtime at the time it was marked stale
        self._base_resume = resume  # what "nothing newer is usable" falls back to
        self._initial_key: tuple[int, int] | None = None
        self._verifier: _CheckpointVerifier | None = None
        # Heartbeat calibration: the longest observed gap after a heartbeat of each phase.
        self._observed: dict[str, float] = {}
        self._last_hb: dict | None = None
        self._vram_capacity: int | None = None
        self._vram_warned = False
        self._watcher: Any = None
        self._uploader: Any = None  # runner.mirror.MirrorUploader when a mirror is configured
        # NaN rollbacks: the absolute LR scale the last exit 76 called for (None: no cut), and
        # the absolute scale of the running worker (its checkpoint's stored scale × --lr-scale).
        self._cut_abs: float | None = None
        self._launch_abs = 1.0

    # ----------------------------------------------------------------- public

    def request_stop(self, kind: str, detail: str) -> None:
        """Stop the run (kind "user") or save-and-exit for preemption ("preempted"). Safe to
        call from a signal handler or another thread. A second request kills the worker now."""
        with self._lock:
            if self._stop_kind is None:
                self._stop_kind, self._stop_detail = kind, detail
            elif kind == "user":
                self._force = True
            if kind == "preempted":  # a notice upgrades a user stop: the node is going away
                self._stop_kind, self._stop_detail = kind, detail

    def run(self) -> int:
        """Preflight, then supervise until the run ends. Returns the supervisor's exit code."""
        old_handlers = self._install_signal_handlers() if self.handle_signals else {}
        self._verifier = _CheckpointVerifier()
        try:
            self._write_state(force=True)
            self._reap_stale_worker()
            self.log.emit(
                "launch",
                reason=f"supervisor pid {os.getpid()} owns {self.run_dir}",
                resume=self.resume,
                lr_scale=self.lr_scale,
                config_hash=self.config_hash,
            )
            code = self._start_mirror()
            if code is not None:
                return code
            self._init_checkpoints()
            self._start_preemption_watcher()
            code = self._preflight()
            if code is None:
                code = self._supervise()
            return code
        except Exception as e:
            # A supervisor bug must not leave an unsupervised worker behind.
            if self._proc is not None and self._proc.poll() is None:
                _signal_group(self._proc.pid, signal.SIGKILL)
            return self._end(
                FAILED,
                EXIT_SOFTWARE,
                f"supervisor error {type(e).__name__}: {e}; the worker was killed. "
                "This is a bug in m3run: report it with supervisor.log",
                level="error",
            )
        finally:
            if self._watcher is not None:
                with contextlib.suppress(Exception):
                    self._watcher.stop()
            if self._uploader is not None:
                self._uploader.close()
            self._verifier.close()
            for sig, handler in old_handlers.items():
                signal.signal(sig, handler)
            self.log.close()

    # ----------------------------------------------------------------- signals & preemption

    def _install_signal_handlers(self) -> dict:
        if threading.current_thread() is not threading.main_thread():
            return {}

        def handler(signum: int, _frame: Any) -> None:
            self.request_stop("user", f"received {signal.Signals(signum).name}")

        old = {}
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            old[sig] = signal.signal(sig, handler)
        return old

    def _start_preemption_watcher(self) -> None:
        provider = self.s.preemption_provider
        if provider in (None, "none"):
            return
        from runner import preemption

        base_url = self.s.metadata_url
        if provider == "auto":
            urls = {p: base_url for p in preemption.PROVIDERS} if base_url else None
            found = preemption.detect_provider(base_urls=urls, timeout_s=0.5)
            if found is None:
                self.log.emit(
                    "preemption_watch",
                    provider=None,
                    reason="no cloud metadata service answered; preemption notices "
                    "are not watched (set supervisor.preemption_provider to force one)",
                )
                return
            provider = found

        def on_notice(notice: Any) -> None:
            left = notice.seconds_left() if hasattr(notice, "seconds_left") else None
            when = "deadline unknown" if left is None else f"{left:.0f}s left"
            action = getattr(notice, "action", "notice")
            self.request_stop("preempted", f"{provider} preemption notice ({action}, {when})")

        self._watcher = preemption.PreemptionWatcher(
            provider, base_url, self.s.preemption_poll_s, on_notice
        ).start()
        self.log.emit(
            "preemption_watch",
            provider=provider,
            base_url=self._watcher.base_url,
            reason=f"polling {provider} every {self.s.preemption_poll_s:g}s",
        )

    # ----------------------------------------------------------------- checkpoint mirror

    def _start_mirror(self) -> int | None:
        """With checkpoint.mirror_url: restore the newest remote checkpoint into a run dir that
        has no complete one (a new disk after preemption or a node swap), then keep the mirror
        up to date in the background. A mirror that cannot be read ends the launch (exit 78)
        rather than silently training from scratch."""
        if not self.s.mirror_url:
            return None
        from runner.mirror import Mirror, MirrorError, MirrorUploader

        try:
            mirror = Mirror(self.s.mirror_url)
            # Only `--resume latest` continues from the newest checkpoint wherever it is;
            # `none` starts over and an explicit STEP must be in the run dir already.
            restored = mirror.restore_latest(self.run_dir) if self.resume == "latest" else None
        except MirrorError as e:
            return self._end(FAILED, EXIT_CONFIG, f"checkpoint mirror: {e}", level="error")
        if restored is not None:
            self.log.emit(
                "mirror_restore",
                step=restored,
                url=self.s.mirror_url,
                reason=f"the run dir had no complete checkpoint; restored step "
                f"{restored} from the mirror",
            )

        def on_event(event: str, fields: dict) -> None:
            level = "warning" if event.endswith("error") else "info"
            self.log.emit(event, level=level, **fields)

        self._uploader = MirrorUploader(
            mirror,
            self.run_dir,
            self.s.mirror_keep_last,
            backoff_initial_s=self.s.backoff_initial_s,
            backoff_max_s=self.s.backoff_max_s,
            on_event=on_event,
        )
        self._uploader.start()
        return None

    def _flush_mirror(self) -> None:
        if self._uploader is None or self.s.mirror_flush_s <= 0:
            return
        t0 = time.monotonic()
        ok = self._uploader.flush(self.s.mirror_flush_s)
        waited = time.monotonic() - t0
        if ok:
            self.log.emit(
                "mirror_flush", reason=f"newest checkpoint is in the mirror (waited {waited:.1f}s)"
            )
        else:
            self.log.emit(
                "mirror_flush",
                level="warning",
                reason=f"the newest checkpoint did not reach {self.s.mirror_url} "
                f"within checkpoint.mirror_flush_s={self.s.mirror_flush_s:g}s; a "
                "relaunch on another disk would resume from an older one",
            )

    # ----------------------------------------------------------------- state

    def _write_state(self, force: bool = False, **changes: Any) -> None:
        self.state.update(changes)
        now = time.time()
        if not force and not changes and now - self._last_state_write < _STATE_REFRESH_S:
            return
        self.state["updated_at"] = now
        atomic_write_json(self.run_dir / STATE_FILE, self.state)
        self._last_state_write = now

    def _end(self, phase: str, code: int, reason: str, level: str = "info", **fields: Any) -> int:
        self._flush_mirror()  # before the final state: `m3run stop` waits for it
        self._write_state(
            force=True,
            phase=phase,
            reason=reason,
            worker_pid=None,
            worker_create_time=None,
            exit_code=code,
        )
        self.log.emit(phase, reason=reason, level=level, exit_code=code, **fields)
        return code

    def _reap_stale_worker(self) -> None:
        """A worker left by a supervisor that was SIGKILLed keeps training unsupervised; stop
        it (save, then kill after the grace) before starting another on the same run dir."""
        prev = self._prev_state
        pid = prev.get("worker_pid")
        if not runstate.process_matches(pid, prev.get("worker_create_time")):
            return
        self.log.emit(
            "stale_worker",
            level="warning",
            reason=f"worker pid {pid} of a previous supervisor is still running; "
            "stopping it before launching a new one",
            pid=pid,
        )
        _signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + self.s.stop_grace_s
        while time.monotonic() < deadline and runstate.process_matches(
            pid, prev.get("worker_create_time")
        ):
            time.sleep(0.1)
        _signal_group(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)

    # ----------------------------------------------------------------- preflight

    def _preflight(self) -> int | None:
        """GPU health gate, then the smoke test. An exit code ends the run; None goes on."""
        if self.gpu is not None:
            code = self._health_gate("preflight")
            if code is not None:
                return code
        if self._stop_kind:
            return self._stopped_without_worker()
        if self.smoke is not None:
            ok, message = self.smoke(self)
            if self._stop_kind:
                return self._stopped_without_worker()
            if not ok:
                return self._end(
                    FAILED, EXIT_CONFIG, f"preflight smoke test failed: {message}", level="error"
                )
            self.log.emit("smoke", reason=message)
        return None

    def _health_gate(self, when: str) -> int | None:
        try:
            report = self.gpu.check(self._gpu_pids())
        except Exception as e:  # the gate itself failing must not hide a broken GPU
            return self._end(
                FAILED,
                EXIT_UNAVAILABLE,
                f"GPU health check ({when}) raised {type(e).__name__}: {e}; "
                "check the driver with nvidia-smi, or replace the node",
                level="error",
            )
        verdict = getattr(report, "verdict", "healthy")
        summary = report.summary() if hasattr(report, "summary") else str(verdict)
        details = report.to_dict() if hasattr(report, "to_dict") else None
        if verdict == "unhealthy":
            return self._end(
                FAILED,
                EXIT_UNAVAILABLE,
                f"GPU unhealthy ({when}): {summary}; replace the node or fix the "
                "GPU, then relaunch",
                level="error",
                health=details,
            )
        self._has_gpu = verdict != "no_gpu"
        self.log.emit(
            "health",
            reason=summary,
            level="warning" if verdict == "warn" else "info",
            verdict=verdict,
            when=when,
            health=details,
        )
        if self._vram_capacity is None and isinstance(details, dict):
            self._vram_capacity = _capacity_from(details)
        return None

    def _gpu_pids(self) -> list[int]:
        """Processes allowed to hold GPU memory: ours (none, normally)."""
        return [os.getpid()]

    def _stopped_without_worker(self) -> int:
        if self._stop_kind == "preempted":
            return self._end(PREEMPTED, EXIT_STOPPED, f"{self._stop_detail}; no worker was running")
        return self._end(STOPPED, EXIT_OK, f"{self._stop_detail}; no worker was running")

    # ----------------------------------------------------------------- checkpoints

    def _init_checkpoints(self) -> None:
        infos = list_checkpoints(self.run_dir, verify=False)
        for info in infos:
            self._known.add(_ckpt_key(info))
            if not info.complete:
                self._reported_torn.add(_ckpt_key(info))
        complete = [i for i in infos if i.complete]
        if complete:
            self.state["last_checkpoint_step"] = complete[-1].step
            # Hash the newest one off the loop: a corrupt one is reported (the worker's
            # `--resume latest` skips it), and it is not progress.
            self._initial_key = _ckpt_key(complete[-1])
            self._verifier.submit(complete[-1].step, self._initial_key[1], complete[-1].path)
        # Resuming from an explicit step (or from nothing) while newer checkpoints exist:
        # those belong to another trajectory; a restart must not jump onto them.
        if self.resume != "latest":
            floor = -1 if self.resume == "none" else int(self.resume)
            self._mark_stale(infos, above=floor)

    def _mark_stale(self, infos: Sequence[CheckpointInfo], above: int) -> None:
        for info in infos:
            if info.step > above:
                self._stale[info.step] = _ckpt_key(info)[1]

    def _is_stale(self, info: CheckpointInfo) -> bool:
        return self._stale.get(info.step) == _ckpt_key(info)[1]

    def _scan_checkpoints(self) -> None:
        try:
            infos = list_checkpoints(self.run_dir, verify=False)
        except Exception as e:  # a transient listing error is retried on the next poll
            self.log.emit("checkpoint_scan_error", reason=str(e), level="warning")
            return
        for info in infos:
            key = _ckpt_key(info)
            if key in self._known:
                continue
            if info.complete:
                self._known.add(key)
                self._verifier.submit(info.step, key[1], info.path)
            elif key not in self._reported_torn and (info.path / "meta.json").exists():
                self._reported_torn.add(key)
                self.log.emit(
                    "checkpoint_incomplete",
                    level="warning",
                    step=info.step,
                    reason=f"{info.path}: {info.reason}; it will not be resumed from",
                )
        self._collect_verified()

    def _collect_verified(self) -> None:
        while True:
            try:
                step, _mtime, ok, reason = self._verifier.done.get_nowait()
            except queue.Empty:
                return
            if (step, _mtime) == self._initial_key:
                if not ok:
                    earlier = [
                        i.step
                        for i in list_checkpoints(self.run_dir, verify=False)
                        if i.complete and i.step < step
                    ]
                    self._write_state(last_checkpoint_step=earlier[-1] if earlier else None)
                    self.log.emit(
                        "checkpoint_incomplete",
                        level="warning",
                        step=step,
                        reason=f"the newest existing checkpoint, step {step}, failed "
                        f"verification: {reason}; the worker resumes from an earlier "
                        "complete one",
                    )
                continue
            if ok:
                self._restarts_since_progress = 0
                if self._uploader is not None:
                    self._uploader.notify()
                # The newest save of the current worker (after a rollback that is lower than
                # checkpoints left over from before it).
                self._write_state(last_checkpoint_step=step)
                self.log.emit("checkpoint", reason="verified complete (sha256)", step=step)
            else:
                self.log.emit(
                    "checkpoint_incomplete",
                    level="warning",
                    step=step,
                    reason=f"step {step} failed verification: {reason}; it will not "
                    "be resumed from",
                )

    def _usable_checkpoints(self) -> list[CheckpointInfo]:
        """Complete (sizes) checkpoints a restart may resume from, newest first."""
        infos = list_checkpoints(self.run_dir, verify=False)
        return [i for i in reversed(infos) if i.complete and not self._is_stale(i)]

    def _newest_verified(self, before_step: int | None = None) -> CheckpointInfo | None:
        for info in self._usable_checkpoints():
            if before_step is not None and info.step >= before_step:
                continue
            ok, _ = verify_checkpoint(info.path, full=True)
            if ok:
                return info
        return None

    def _resume_target(self) -> str:
        """--resume for a restart: "latest" unless some checkpoints must be skipped, then the
        newest verified one that may be used, else what the run started from."""
        if not self._stale:
            return "latest"
        info = self._newest_verified()
        return str(info.step) if info is not None else self._base_resume

    def _rollback_target(self) -> tuple[str, str]:
        """After exit 76: the checkpoint before the latest (the latest may already carry the
        excursion). Returns (--resume value, description)."""
        latest = self._newest_verified()
        if latest is None:
            return self._base_resume, "no complete checkpoint: restarting from the start"
        before = self._newest_verified(before_step=latest.step)
        target = before or latest
        self._mark_stale(list_checkpoints(self.run_dir, verify=False), above=target.step)
        self._base_resume = str(target.step)
        self.state["last_checkpoint_step"] = target.step
        if before is None:
            return str(target.step), f"only checkpoint {latest.step} exists: resuming from it"
        return str(target.step), (f"rolling back past checkpoint {latest.step} to {target.step}")

    def _stored_scale(self, resume: str) -> float:
        """The LR scale stored in the checkpoint a worker resuming from `resume` loads (1.0
        from scratch, or for a checkpoint that predates the field)."""
        if resume == "none":
            return 1.0
        infos = [i for i in list_checkpoints(self.run_dir, verify=False) if i.complete]
        if resume.isdigit():
            infos = [i for i in infos if i.step == int(resume)]
        if not infos:
            return 1.0
        stored = (infos[-1].meta or {}).get("lr_scale", 1.0)
        return float(stored) if isinstance(stored, (int, float)) and stored > 0 else 1.0

    def _lr_scale_for(self, resume: str) -> float:
        """--lr-scale for a worker resuming from `resume`. The worker multiplies the scale
        stored in the checkpoint it loads by this, and stores the product in its own
        checkpoints. After an exit 76 the worker must train at the cut scale: a checkpoint
        written before the cut gets the missing factor, one written after it already carries
        the cut (1.0), and the supervisor never raises the LR a checkpoint already has."""
        if self._cut_abs is None:
            return 1.0
        return min(1.0, self._cut_abs / self._stored_scale(resume))

    # ----------------------------------------------------------------- heartbeat

    def _allowance(self, hb: dict | None) -> float:
        """Seconds the current heartbeat may age before the worker counts as hung."""
        s = self.s
        phase = hb.get("phase") if hb else None
        if phase in _STARTUP_PHASES:
            return s.startup_timeout_s
        if phase in _FINAL_PHASES:  # done: it only has to exit
            return max(s.stop_grace_s, s.min_heartbeat_timeout_s)
        if s.heartbeat_timeout_s is not None:
            return s.heartbeat_timeout_s
        step_time = (
            hb.get("step_time_s") if isinstance(hb.get("step_time_s"), (int, float)) else None
        )
        observed = self._observed.get(phase)
        if phase == "training":
            if step_time is None and observed is None:
                return s.startup_timeout_s  # first step: compilation and autotuning
            base = max(step_time or 0.0, observed or 0.0, s.heartbeat_interval_s)
        elif phase in _SAVE_PHASES:
            ckpt = hb.get("checkpoint_time_s")
            if not isinstance(ckpt, (int, float)) and observed is None:
                return s.startup_timeout_s  # no save observed yet
            base = max((ckpt or 0.0) + (step_time or 0.0), observed or 0.0)
        else:  # eval and anything new: only what was observed for that phase
            if observed is None:
                return s.startup_timeout_s
            base = observed
        return max(s.min_heartbeat_timeout_s, s.heartbeat_safety_factor * base)

    def _observe(self, hb: dict) -> None:
        prev = self._last_hb
        if prev is not None and hb.get("ts") != prev.get("ts"):
            gap = hb["ts"] - prev["ts"]
            phase = prev.get("phase")
            # A step right after startup/compile belongs to the startup allowance.
            if phase not in _STARTUP_PHASES and gap >= 0:
                self._observed[phase] = max(self._observed.get(phase, 0.0), gap)
        self._last_hb = hb
        vram = hb.get("vram_bytes")
        if isinstance(vram, int):
            self._note_vram(vram, "heartbeat")

    def _read_fresh_heartbeat(self) -> dict | None:
        """The heartbeat of the current worker (a stale one from its predecessor is ignored)."""
        hb = read_json(self.run_dir / HEARTBEAT_FILE)
        if not hb or not isinstance(hb.get("ts"), (int, float)):
            return None
        if hb["ts"] < self._spawn_wall - 1.0:
            return None
        return hb

    # ----------------------------------------------------------------- VRAM

    def _note_vram(self, used: int, source: str) -> None:
        peak = self.state.get("peak_vram_bytes") or 0
        if used > peak:
            self.state["peak_vram_bytes"] = used
        cap = self._vram_capacity
        if cap and not self._vram_warned and used > self.s.vram_warn_fraction * cap:
            self._vram_warned = True
            self.log.emit(
                "vram_warn",
                level="warning",
                used_bytes=used,
                capacity_bytes=cap,
                reason=f"worker uses {used / 2**30:.1f} GiB of {cap / 2**30:.1f} GiB "
                f"({used / cap:.0%}, over supervisor.vram_warn_fraction="
                f"{self.s.vram_warn_fraction}); an OOM is near: lower "
                "train.micro_batch_size or enable train.activation_checkpointing",
                source=source,
            )

    def _poll_process_vram(self) -> None:
        if self.gpu is None or not self._has_gpu or self._proc is None:
            return
        used = self.gpu.process_memory(self._proc.pid)  # the worker and its descendants
        if used:
            self._note_vram(int(used), "nvml")

    # ----------------------------------------------------------------- worker lifecycle

    def _spawn(self, resume: str) -> None:
        self._attempt += 1
        self._launch_abs = self._stored_scale(resume) * self.lr_scale
        argv = self.worker_argv(resume, self.lr_scale)
        self._torchrun = _is_torchrun(argv)
        self._local_ranks = _nproc(argv)
        env = dict(self.env)
        env["PYTHONUNBUFFERED"] = "1"
        if self._attempt > 1 and env.get(FAULT_SCOPE_ENV) == "first":
            env.pop(FAULT_ENV, None)
        log_path = self.run_dir / WORKER_LOG
        with open(log_path, "ab") as log_file:
            log_file.write(
                f"--- m3run supervisor: worker attempt {self._attempt}: "
                f"{shlex.join(argv)}\n".encode()
            )
            log_file.flush()
            offset = log_file.tell()
            self._spawn_wall = time.time()
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                close_fds=True,
            )
        self._tail = _LogTail(log_path, offset)
        self._last_hb = None
        self._write_state(
            force=True,
            phase=RUNNING,
            worker_pid=self._proc.pid,
            worker_create_time=_create_time(self._proc.pid),
            worker_started_at=self._spawn_wall,
            resume=resume,
            lr_scale=self.lr_scale,
            reason=None,
            heartbeat_timeout_s=self.s.startup_timeout_s,
        )
        self.log.emit(
            "worker_start",
            reason=f"attempt {self._attempt}",
            pid=self._proc.pid,
            resume=resume,
            lr_scale=self.lr_scale,
            argv=argv,
        )

    def _terminate(self) -> None:
        """SIGTERM the worker: the whole process group, or under torchrun only the ranks (a
        SIGTERMed torchrun gives its ranks 30 s and then kills them, whatever the grace)."""
        proc = self._proc
        if not self._torchrun:
            _signal_group(proc.pid, signal.SIGTERM)
            return
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    child.send_signal(signal.SIGTERM)

    def _exit_code(self, code: int) -> int:
        """torchrun exits 1 whatever its ranks' codes were: take the protocol code the rank
        wrapper recorded for every rank of this attempt (78 or 76 on any rank wins; 75 or 0
        only when all ranks agree). A rank that died without a record keeps the crash."""
        if not self._torchrun or code == EXIT_OK:
            return code
        codes = []
        for path in self.run_dir.glob("worker_exit.local*.json"):  # protocol.worker_exit_file
            rec = read_json(path)
            if rec and rec.get("time", 0) >= self._spawn_wall - 1.0:
                codes.append(rec.get("code"))
        for wins in (EXIT_CONFIG, EXIT_NAN):
            if wins in codes:
                return wins
        if (
            codes
            and len(set(codes)) == 1
            and codes[0] in (EXIT_OK, EXIT_STOPPED)
            and len(codes) >= self._local_ranks
        ):
            return codes[0]
        return code

    def _echo(self, final: bool = False) -> None:
        if self._tail is not None:
            for line in self._tail.lines(final=final):
                self.log.echo(line)

    def _watch(self) -> _Outcome:
        """Poll the worker until it exits; handles stop requests and hangs on the way."""
        proc = self._proc
        assert proc is not None
        kill_at: float | None = None  # monotonic deadline for SIGKILL after a SIGTERM
        hang: str | None = None
        stop_sent = False
        next_scan = 0.0
        next_vram = 0.0
        while True:
            try:
                code = proc.wait(timeout=self.s.poll_s)
            except subprocess.TimeoutExpired:
                code = None
            self._echo()
            if code is not None:
                self._echo(final=True)
                # Leftovers of the group (ranks, loader workers) go with their leader.
                _signal_group(proc.pid, signal.SIGKILL)
                killed = kill_at is not None and time.monotonic() >= kill_at
                return _Outcome(self._exit_code(code), hang=hang, killed_after_grace=killed)
            now = time.monotonic()

            if self._stop_kind and not stop_sent:
                stop_sent = True
                grace = self._grace_used = self._stop_grace()
                self._write_state(force=True, phase=STOPPING, reason=self._stop_detail)
                self.log.emit(
                    "stop_requested", reason=self._stop_detail, kind=self._stop_kind, grace_s=grace
                )
                self._terminate()
                kill_at = min(kill_at, now + grace) if kill_at is not None else now + grace
            if self._force and kill_at is not None and kill_at > now:
                self.log.emit(
                    "force_kill",
                    reason="second stop request: killing the worker now",
                    level="warning",
                )
                kill_at = now
            if kill_at is not None and now >= kill_at:
                _signal_group(proc.pid, signal.SIGKILL)

            if now >= next_scan:
                next_scan = now + _CHECKPOINT_SCAN_S
                self._scan_checkpoints()
            if now >= next_vram and self._has_gpu:
                next_vram = now + 5.0
                with contextlib.suppress(Exception):  # NVML hiccups are not worth a restart
                    self._poll_process_vram()

            hb = self._read_fresh_heartbeat()
            last_ts = self._last_hb.get("ts") if self._last_hb else None
            if hb is not None and hb.get("ts") != last_ts:
                self._observe(hb)
            allowance = self._allowance(hb)
            if allowance != self.state.get("heartbeat_timeout_s"):
                self._write_state(heartbeat_timeout_s=allowance)
            else:
                self._write_state()  # refreshes updated_at every few seconds
            if stop_sent or hang is not None:
                continue
            hang = self._check_hang(hb, allowance)
            if hang is not None:
                self._write_state(force=True, phase=RESTARTING, reason=hang)
                self._terminate()
                kill_at = now + self.s.stop_grace_s

    def _check_hang(self, hb: dict | None, allowance: float) -> str | None:
        """The hang reason if local rank 0's heartbeat, or any other local rank's
        (heartbeat.local<r>.json, see protocol.heartbeat_file), is older than its allowance."""
        now = time.time()
        beats = [(HEARTBEAT_FILE, hb, allowance)]
        for path in sorted(self.run_dir.glob("heartbeat.local*.json")):
            other = read_json(path)
            if (
                other
                and isinstance(other.get("ts"), (int, float))
                and other["ts"] >= self._spawn_wall - 1.0
            ):
                beats.append((path.name, other, self._allowance(other)))
        for name, beat, allow in beats:
            age = now - (beat["ts"] if beat else self._spawn_wall)
            if age <= allow:
                continue
            phase = beat.get("phase") if beat else "no heartbeat yet"
            step = beat.get("step") if beat else None
            where = "" if name == HEARTBEAT_FILE else f" in {name}"
            reason = (
                f"hang: no heartbeat{where} for {age:.0f}s (allowance {allow:.0f}s, "
                f"worker phase {phase}, step {step})"
            )
            self.log.emit(
                "hang",
                reason=reason,
                level="warning",
                pid=self._proc.pid,
                heartbeat_age_s=round(age, 1),
                allowance_s=allow,
                file=name,
            )
            return reason
        return None

    def _stop_grace(self) -> float:
        """stop_grace_s, shortened by a recent `m3run stop --grace S` request."""
        grace = self.s.stop_grace_s
        req = read_json(self.run_dir / STOP_REQUEST_FILE)
        if (
            self._stop_kind == "user"
            and req
            and isinstance(req.get("grace_s"), (int, float))
            and time.time() - req.get("time", 0) < 60
        ):
            grace = min(grace, max(0.0, float(req["grace_s"])))
        return grace

    def _wait_gpu_released(self, pid: int) -> None:
        if self.gpu is None or not self._has_gpu:
            return
        t0 = time.monotonic()
        released = self.gpu.wait_released([pid], self.s.gpu_release_timeout_s)
        waited = time.monotonic() - t0
        if released is False:
            self.log.emit(
                "gpu_memory_wait",
                level="warning",
                pid=pid,
                reason=f"GPU memory of dead worker pid {pid} not released after "
                f"{waited:.0f}s; relaunching anyway (the health gate decides)",
            )
        elif waited > 1.0:
            self.log.emit(
                "gpu_memory_wait",
                reason=f"waited {waited:.1f}s for pid {pid}'s GPU memory to be released",
                pid=pid,
            )

    # ----------------------------------------------------------------- the loop

    def _supervise(self) -> int:
        resume = self.resume
        while True:
            if self._stop_kind:
                return self._stopped_without_worker()
            self._spawn(resume)
            out = self._watch()
            pid = self._proc.pid
            self._verifier.drain()
            self._scan_checkpoints()
            self._verifier.drain()
            self._collect_verified()
            final = (self._read_fresh_heartbeat() or {}).get("phase")
            if out.hang is not None and final in _FINAL_PHASES:
                # It had finished, stopped or failed and then hung on its way out: its work is
                # done, so take the code its last phase stands for.
                self.log.emit(
                    "hang_on_exit",
                    level="warning",
                    reason=f"{out.hang}; the worker "
                    f"had reached phase {final!r}, so this counts as its exit",
                )
                out = _Outcome(_FINAL_PHASES[final])
            code = out.exit_code
            self._write_state(
                force=True,
                last_exit={
                    "code": code,
                    "time": time.time(),
                    "pid": pid,
                    "hang": out.hang,
                    "description": _describe_exit(code),
                },
            )
            self.log.emit(
                "worker_exit", reason=out.hang or _describe_exit(code), exit_code=code, pid=pid
            )

            if self._stop_kind:
                return self._stop_outcome(out)
            if code == EXIT_OK and out.hang is None:
                return self._end(
                    FINISHED,
                    EXIT_OK,
                    "worker finished the run (exit 0)",
                    last_checkpoint_step=self.state.get("last_checkpoint_step"),
                )
            if code == EXIT_CONFIG and out.hang is None:
                return self._end(
                    FAILED,
                    EXIT_CONFIG,
                    "worker exit 78: bad config or data (never restarted); the "
                    f"error is at the end of {self.run_dir / WORKER_LOG}; fix it "
                    "and relaunch",
                    level="error",
                )

            if out.hang is not None:
                kind, reason = "hang", out.hang
                resume = self._resume_target()
            elif code == EXIT_NAN:
                kind = "nan"
                # Cut relative to the scale the failing worker ran at: consecutive exits 76
                # compound, and a resume from a checkpoint written under an earlier cut is
                # not cut twice.
                self._cut_abs = self._launch_abs * self.s.nan_lr_factor
                resume, how = self._rollback_target()
                reason = (
                    f"worker exit 76: NaN excursion the in-process rollback could not "
                    f"heal; {how}, learning rate cut to {self._cut_abs:g}× the schedule"
                )
            elif code == EXIT_STOPPED:
                kind = "unrequested_stop"
                reason = (
                    "worker exit 75 (saved and stopped) without a stop request from this "
                    "supervisor; resuming"
                )
                resume = self._resume_target()
            else:
                kind = "crash"
                reason = f"worker crashed ({_describe_exit(code)})"
                resume = self._resume_target()
            self.lr_scale = self._lr_scale_for(resume)

            code_or_none = self._restart_or_give_up(kind, reason, code, resume, pid)
            if code_or_none is not None:
                return code_or_none

    def _restart_or_give_up(
        self, kind: str, reason: str, exit_code: int, resume: str, dead_pid: int
    ) -> int | None:
        s = self.s
        now = time.time()
        recent = [t for t in self._restart_times if t > now - s.restart_window_s]
        if len(recent) >= s.max_restarts:
            return self._end(
                FAILED,
                EXIT_SOFTWARE,
                f"restart budget spent: {len(recent)} restarts in the last "
                f"{s.restart_window_s:g}s (supervisor.max_restarts={s.max_restarts}); last "
                f"failure: {reason}. Read {self.run_dir / WORKER_LOG}, fix the cause and "
                "relaunch, or raise supervisor.max_restarts",
                level="error",
            )
        if self._restarts_since_progress >= s.no_progress_restarts:
            return self._end(
                FAILED,
                EXIT_SOFTWARE,
                f"no progress: {self._restarts_since_progress} restarts in a row without a new "
                f"complete checkpoint (supervisor.no_progress_restarts="
                f"{s.no_progress_restarts}); last failure: {reason}. Read "
                f"{self.run_dir / WORKER_LOG}, fix the cause and relaunch",
                level="error",
            )

        delay = min(s.backoff_max_s, s.backoff_initial_s * 2**self._restarts_since_progress)
        self._restart_times.append(now)
        self._restarts_since_progress += 1
        resume_step = (
            int(resume)
            if resume.isdigit()
            else (self.state.get("last_checkpoint_step") if resume == "latest" else None)
        )
        record = {
            "time": now,
            "reason": reason,
            "kind": kind,
            "exit_code": exit_code,
            "resume": resume,
            "resume_step": resume_step,
            "lr_scale": self.lr_scale,
            "backoff_s": delay,
            "supervisor_pid": os.getpid(),
        }
        self.state["restarts"].append(record)
        self._write_state(
            force=True,
            phase=RESTARTING,
            reason=reason,
            worker_pid=None,
            worker_create_time=None,
            lr_scale=self.lr_scale,
        )
        self.log.emit(
            "rollback" if kind == "nan" else "restart",
            reason=reason,
            kind=kind,
            exit_code=exit_code,
            resume=resume,
            resume_step=resume_step,
            backoff_s=delay,
            restart=len(self.state["restarts"]),
            restarts_in_window=len(recent) + 1,
        )

        deadline = time.monotonic() + delay
        while time.monotonic() < deadline:
            if self._stop_kind:
                return self._stopped_without_worker()
            self._write_state()  # keeps updated_at fresh for the liveness check
            time.sleep(min(self.s.poll_s, max(0.0, deadline - time.monotonic())))
        self._wait_gpu_released(dead_pid)
        if self.gpu is not None:
            code = self._health_gate("before restart")
            if code is not None:
                return code
        if self._stop_kind:
            return self._stopped_without_worker()
        self.resume = resume
        return None

    def _stop_outcome(self, out: _Outcome) -> int:
        ckpt = self.state.get("last_checkpoint_step")
        finished = (self._read_fresh_heartbeat() or {}).get("phase") == "finished"
        if (out.exit_code == EXIT_OK and not out.killed_after_grace) or (
            finished and ckpt is not None and out.exit_code != EXIT_STOPPED
        ):
            # It trained to the end before the stop reached it (a SIGTERM during its exit
            # can still kill it: the run is finished all the same).
            return self._end(
                FINISHED,
                EXIT_OK,
                f"worker finished the run (exit 0) while stopping ({self._stop_detail})",
                last_checkpoint_step=ckpt,
            )
        if out.exit_code == EXIT_STOPPED:
            how = f"worker saved and exited 75; last complete checkpoint step {ckpt}"
        else:
            how = (
                f"worker did not exit 75 within the {self._grace_used:g}s stop grace "
                f"({_describe_exit(out.exit_code)}); last complete checkpoint step {ckpt}"
            )
        if self._stop_kind == "preempted":
            return self._end(
                PREEMPTED, EXIT_STOPPED, f"{self._stop_detail}; {how}", last_checkpoint_step=ckpt
            )
        return self._end(STOPPED, EXIT_OK, f"{self._stop_detail}; {how}", last_checkpoint_step=ckpt)


def _capacity_from(details: dict) -> int | None:
    """Memory (bytes) of the smallest GPU in a HealthReport.to_dict(), if it reports one."""
    totals = [d.get("mem_total_mib") for d in details.get("devices") or [] if isinstance(d, dict)]
    totals = [t for t in totals if isinstance(t, (int, float)) and t > 0]
    return int(min(totals) * 2**20) if totals else None


# --------------------------------------------------------------------------- launch


@dataclass
class LaunchOptions:
    """`m3run launch` arguments."""

    config: Path
    run_dir: Path
    overrides: list[str] = field(default_factory=list)
    resume: str = "latest"
    force: bool = False
    console: bool = True


def check_resume(value: str) -> str:
    """--resume: latest, none or a step number."""
    value = str(value).strip()
    if value in ("latest", "none") or (value.isdigit()):
        return value
    raise LaunchError(
        f"--resume must be latest, none or a step number, got {value!r} (fix: "
        "e.g. --resume latest, or --resume 4000 for checkpoints/step_00004000)",
        EXIT_CONFIG,
    )


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def freeze_config(opts: LaunchOptions) -> tuple[Any, str]:
    """Load CONFIG with --set overrides and freeze it as RUN_DIR/config.yaml. A relaunch with a
    different resolved config is refused unless --force. Returns (config, hash)."""
    from runner.config import ConfigError, config_hash, load_config

    try:
        cfg = load_config(opts.config, opts.overrides)
    except ConfigError as e:
        raise LaunchError(str(e), EXIT_CONFIG) from None
    new_hash = config_hash(cfg)
    frozen = opts.run_dir / CONFIG_FILE
    if frozen.exists():
        try:
            old = load_config(frozen)
        except ConfigError as e:
            if not opts.force:
                raise LaunchError(
                    f"the frozen config {frozen} no longer loads ({e}); pass --force to replace "
                    f"it with {opts.config}, or launch into another --run-dir",
                    EXIT_CONFIG,
                ) from None
            old = None
        old_hash = config_hash(old) if old is not None else None
        if old is not None and old_hash != new_hash:
            a, b = _flatten(yaml.safe_load(old.to_yaml())), _flatten(yaml.safe_load(cfg.to_yaml()))
            diff = [
                f"{k}: {a.get(k)!r} -> {b.get(k)!r}"
                for k in sorted(set(a) | set(b))
                if a.get(k) != b.get(k)
            ]
            shown = "; ".join(diff[:8]) + (f"; … {len(diff) - 8} more" if len(diff) > 8 else "")
            if not opts.force:
                raise LaunchError(
                    f"config changed for {opts.run_dir}: {opts.config} with the given --set "
                    f"resolves to a config different from the frozen {frozen} ({shown}). "
                    f"Relaunch with the frozen config (`m3run launch {frozen} --run-dir "
                    f"{opts.run_dir}`), launch into another --run-dir, or pass --force to "
                    "replace the frozen config",
                    EXIT_CONFIG,
                )
            append_jsonl(
                opts.run_dir / EVENTS_FILE,
                {
                    "time": time.time(),
                    "event": "config_replaced",
                    "old_hash": old_hash,
                    "new_hash": new_hash,
                    "reason": f"--force: {shown}",
                },
            )
    atomic_write_text(frozen, cfg.to_yaml())
    return cfg, new_hash


def _subprocess_smoke(config_path: Path) -> Smoke:
    """The preflight smoke test in a child process (it imports torch; the supervisor must
    not). Its output goes to worker.log (echoed in the foreground), its verdict to smoke.json."""

    def smoke(sup: Supervisor) -> tuple[bool, str]:
        run_dir = sup.run_dir
        (run_dir / SMOKE_FILE).unlink(missing_ok=True)
        argv = [
            sys.executable,
            "-m",
            "runner.supervisor",
            "smoke",
            str(config_path),
            "--run-dir",
            str(run_dir),
        ]
        log_path = run_dir / WORKER_LOG
        with open(log_path, "ab") as log_file:
            log_file.write(b"--- m3run supervisor: preflight smoke test\n")
            log_file.flush()
            sup._tail = _LogTail(log_path, log_file.tell())
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**sup.env, "PYTHONUNBUFFERED": "1"},
            )
        deadline = time.monotonic() + sup.s.startup_timeout_s
        while proc.poll() is None:
            sup._echo()
            sup._write_state()  # keeps updated_at fresh for the liveness check
            if sup._stop_kind or time.monotonic() > deadline:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
                if sup._stop_kind:
                    return False, "stopped"
                return False, (
                    f"did not finish within supervisor.startup_timeout_s="
                    f"{sup.s.startup_timeout_s:g}s; raise it or set "
                    "supervisor.smoke=false"
                )
            time.sleep(sup.s.poll_s)
        sup._echo(final=True)
        result = read_json(run_dir / SMOKE_FILE)
        if result is None:
            return False, (
                f"the smoke process exited {proc.returncode} without a verdict; see "
                f"the end of {log_path}"
            )
        return bool(result.get("ok")), str(result.get("message"))

    return smoke


def _smoke_main(config_path: Path, run_dir: Path) -> int:
    """Child side of the preflight smoke test: run it, write smoke.json."""
    from runner.config import load_config
    from runner.smoke import run_smoke

    result = run_smoke(load_config(config_path), run_dir)
    checks = [c.to_dict() for c in result.checks]
    ran = sum(c["status"] == "ok" for c in checks)
    skipped = sum(c["status"] == "skipped" for c in checks)
    message = (
        f"{ran} checks passed, {skipped} skipped" if result.ok else str(result.failed_check_message)
    )
    atomic_write_json(run_dir / SMOKE_FILE, {"ok": result.ok, "message": message, "checks": checks})
    print(f"smoke: {'ok' if result.ok else 'FAILED'}: {message}", flush=True)
    return EXIT_OK if result.ok else EXIT_CONFIG


def launch(opts: LaunchOptions) -> int:
    """Take the run dir's lock, freeze the config and supervise the run in this process.
    Returns the supervisor's exit code; refusals print their reason to stderr."""
    try:
        resume = check_resume(opts.resume)
        opts.run_dir.mkdir(parents=True, exist_ok=True)
        lock = RunLock(opts.run_dir)
        lock.acquire()
    except LaunchError as e:
        print(f"m3run launch: {e}", file=sys.stderr)
        return e.exit_code
    try:
        try:
            cfg, chash = freeze_config(opts)
        except LaunchError as e:
            print(f"m3run launch: {e}", file=sys.stderr)
            return e.exit_code
        for warning in cfg.warnings():
            print(f"m3run launch: warning: {warning}", file=sys.stderr)
        settings = SupervisorSettings.from_config(cfg)
        # No --lr-scale on a relaunch: a NaN rollback's LR cut lives in the checkpoints the
        # worker wrote after it.
        sup = Supervisor(
            opts.run_dir,
            settings,
            worker_argv(opts.run_dir, cfg.distributed),
            resume=resume,
            console=opts.console,
            config_hash=chash,
            gpu=GpuProbe(settings.health_timeout_s),
            smoke=_subprocess_smoke(opts.run_dir / CONFIG_FILE) if settings.smoke else None,
        )
        return sup.run()
    finally:
        lock.release()


def launch_detached(opts: LaunchOptions, wait_s: float = 60.0) -> int:
    """Start the supervisor as a daemon (its own session, output to supervisor.log) and return
    once it has written state.json with its pid. Returns 0, or the daemon's exit code if it
    refused to start."""
    opts.run_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable,
        "-m",
        "runner.supervisor",
        "run",
        str(Path(opts.config).absolute()),
        "--run-dir",
        str(opts.run_dir.absolute()),
        "--resume",
        opts.resume,
    ]
    for kv in opts.overrides:
        argv += ["--set", kv]
    if opts.force:
        argv.append("--force")
    log_path = opts.run_dir / SUPERVISOR_LOG
    with open(log_path, "ab") as log_file:
        offset = log_file.tell()
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
    deadline = time.monotonic() + wait_s
    while True:
        state = read_json(opts.run_dir / STATE_FILE)
        if state and state.get("supervisor_pid") == proc.pid:
            print(
                f"m3run launch: supervisor pid {proc.pid} is running {opts.run_dir} in the "
                f"background; follow it with `m3run status {opts.run_dir} --watch` or "
                f"`m3run logs {opts.run_dir} -f`, stop it with `m3run stop {opts.run_dir}`"
            )
            return EXIT_OK
        code = proc.poll()
        if code is not None:
            with open(log_path, "rb") as f:
                f.seek(offset)
                tail = f.read().decode(errors="replace").strip()
            print(
                tail
                or f"m3run launch: the supervisor exited {code} before starting; see {log_path}",
                file=sys.stderr,
            )
            return code if code != EXIT_OK else EXIT_REFUSED
        if time.monotonic() > deadline:
            print(
                f"m3run launch: supervisor pid {proc.pid} did not write {STATE_FILE} within "
                f"{wait_s:g}s; it may still be starting: check `m3run logs {opts.run_dir} "
                "--supervisor`",
                file=sys.stderr,
            )
            return EXIT_REFUSED
        time.sleep(0.05)


# --------------------------------------------------------------------------- entry point


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m runner.supervisor run|smoke ...`: the detached supervisor and the smoke child.
    Users run `m3run launch`."""
    parser = argparse.ArgumentParser(prog="python -m runner.supervisor")
    sub = parser.add_subparsers(dest="cmd", required=True)
    run_p = sub.add_parser("run", help="supervise a run (what `m3run launch --detach` starts)")
    run_p.add_argument("config", type=Path)
    run_p.add_argument("--run-dir", type=Path, required=True)
    run_p.add_argument("--set", dest="overrides", action="append", default=[])
    run_p.add_argument("--resume", default="latest")
    run_p.add_argument("--force", action="store_true")
    run_p.add_argument(
        "--console", action="store_true", help="echo events and worker output on stdout"
    )
    smoke_p = sub.add_parser("smoke", help="run the preflight smoke test, write smoke.json")
    smoke_p.add_argument("config", type=Path)
    smoke_p.add_argument("--run-dir", type=Path, required=True)
    sub.add_parser("rank", help="(torchrun) run one worker rank, record its exit code")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["rank"]:  # torchrun's entry for each rank (argparse would eat its flags)
        return _rank_main(argv[1:])
    args = parser.parse_args(argv)
    if args.cmd == "smoke":
        return _smoke_main(args.config, args.run_dir)
    return launch(
        LaunchOptions(
            config=args.config,
            run_dir=args.run_dir,
            overrides=args.overrides,
            resume=args.resume,
            force=args.force,
            console=args.console,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
