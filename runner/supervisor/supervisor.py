"""The supervision loop: keeps one training worker alive until the run finishes, stops or is
preempted.

One supervisor owns a run directory (the lock and the frozen config are runner.supervisor.launch's).
It gates on GPU health and a preflight smoke test (preflight), then starts the worker as a child
in its own process group (worker) and watches it:

* exit code (runner.protocol): 0 finished · 75 stopped after a save · 76 NaN not healed ·
  78 bad config/data · anything else a crash;
* heartbeat age against an allowance calibrated from what the run has shown (hang); a stale
  worker is SIGTERMed, SIGKILLed after ``stop_grace_s`` and restarted;
* VRAM (heartbeat ``vram_bytes`` and NVML per process): the peak is recorded, a warning logged
  near capacity (hang.VramWatch);
* every new checkpoint is verified complete (sha256) in a background thread (checkpoints).

Restart policy (restarts; its record and wait: relaunch): the first restart (of the launch, or
since a new complete checkpoint) is immediate, each further one in a row waits
``backoff_initial_s`` doubling up to ``backoff_max_s``, counted from the worker's exit; at most
``max_restarts`` restarts per ``restart_window_s``; ``no_progress_restarts`` restarts in a row
without a new complete checkpoint end the run (exit 70). Exit 76 restarts from the checkpoint
before the latest one with the learning rate scaled by ``nan_lr_factor`` (squared, cubed, … for
consecutive exits 76); exit 78 is never restarted.
Before a relaunch the dead worker's GPU memory must be released and the GPU healthy. On a GPU
host (``warm_spare``) the next worker waits started and imported while one trains, and a
restart hands it the worker's arguments (spare); a launch that runs the smoke test starts its
first worker that way beside the test.

SIGTERM/SIGINT to the supervisor and cloud preemption notices are forwarded to the worker as
SIGTERM (it saves at the next step boundary and exits 75); ``stop_grace_s`` later it is
SIGKILLed. A repeated SIGTERM waits for that save; a second Ctrl-C (SIGINT) kills it at once.
SIGHUP (a closed terminal) is no stop: the run goes on without its console (events.EventLog).
A supervisor error stops the worker the same way, SIGTERM first, before the run fails.

Stop timeouts. ``stop_grace_s`` (default 120 s: a 435M checkpoint with optimizer state is ~5 GB)
must fit inside the container runtime's own stop timeout, or the runtime SIGKILLs everything
mid-save. Docker waits 10 s by default and Kubernetes 30 s: configure them above the grace plus
a few seconds for the supervisor, e.g. ``docker run --stop-timeout 150`` / compose
``stop_grace_period: 150s`` / ``terminationGracePeriodSeconds: 150``. A spot notice gives less
time than that (GCP about 30 s, Azure at least 30 s, AWS 2 min); the save has to fit in it
whatever the grace is, so keep checkpoints frequent on spot capacity. After the preflight the
launch says whether a save fits in the notice watched, or in the grace (save_budget).

Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

from m3run.runner.console import Console
from m3run.runner.files import PidLock, RunDirWriteError, describe_os_error, lock_holder, read_json
from m3run.runner.procs import describe_exit
from m3run.runner.protocol import (
    EXIT_CONFIG,
    EXIT_OK,
    EXIT_SOFTWARE,
    FINAL_WORKER_PHASES,
    LOG_FORMAT_ENV,
    STATE_FILE,
    WORKER_LOG,
    LogFormat,
    RunState,
    SupervisorPhase,
    WorkerPhase,
)
from m3run.runner.supervisor.checkpoints import CheckpointTracker, LrCut
from m3run.runner.supervisor.events import EventLog
from m3run.runner.supervisor.hang import HangDetector, VramWatch
from m3run.runner.supervisor.preflight import GpuProbe, GpuWatch, Preflight, PreflightEnd, SmokeTest
from m3run.runner.supervisor.relaunch import Relaunch
from m3run.runner.supervisor.restarts import diagnose
from m3run.runner.supervisor.save_budget import say_stop_save
from m3run.runner.supervisor.settings import SupervisorSettings
from m3run.runner.supervisor.spare import SparePolicy
from m3run.runner.supervisor.state import StateFile, end_unwritable
from m3run.runner.supervisor.stops import PREEMPTED, USER, StopControl, StopDelivery
from m3run.runner.supervisor.worker import (
    Outcome,
    WorkerArgv,
    WorkerProcess,
    reap_stale_worker,
    worker_env,
)

_CHECKPOINT_SCAN_S = 1.0


class Supervisor:
    """Supervise one run directory. `run()` returns the supervisor's exit code.

    `worker_argv(resume, lr_scale)` builds the worker command line; `gpu` (a GpuProbe) gates
    on GPU health before the first launch and every restart and reads per-process VRAM (None:
    no GPU checks); `smoke` is the preflight smoke test (None skips it)."""

    def __init__(
        self,
        run_dir: Path,
        settings: SupervisorSettings,
        worker_argv: WorkerArgv,
        *,
        resume: str = "latest",
        lr_scale: float = 1.0,
        console: bool = False,
        log_format: LogFormat | str = LogFormat.TEXT,
        config_hash: str | None = None,
        gpu: GpuProbe | None = None,
        smoke: SmokeTest | None = None,
        env: dict[str, str] | None = None,
        handle_signals: bool = True,
        run_lock: PidLock | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.s = settings
        self.worker_argv = worker_argv
        self.resume = resume
        self.lr_scale = lr_scale
        self.config_hash = config_hash
        self.env = dict(os.environ if env is None else env)
        # The worker and the smoke test print their records in the console's format.
        self.env[LOG_FORMAT_ENV] = LogFormat(log_format).value
        self.handle_signals = handle_signals
        self.run_lock = run_lock  # supervisor.lock, kept held at its path (_keep_lock)
        self._lock_lost = False
        self.log = EventLog(self.run_dir, console, log_format)
        self.console = Console(log_format, source="supervisor", prefix="m3run supervisor")

        self.stops = StopControl(self.run_dir, settings.stop_grace_s)
        self.worker: WorkerProcess | None = None
        self._attempt = 0

        prev = RunState.from_dict(read_json(self.run_dir / STATE_FILE))
        self.hang = HangDetector(self.run_dir, settings, prev.longest_startup_s if prev else None)
        self.vram = VramWatch(settings, self.log, prev.peak_vram_bytes if prev else None)
        self.gpu = GpuWatch(gpu, settings, self.log, self.vram) if gpu is not None else None
        self.spares = SparePolicy(
            self.run_dir,
            settings.warm_spare,
            lambda: self.gpu is not None and self.gpu.has_gpu,
            lambda attempt: worker_env(self.env, attempt),
            self.log.emit,
        )
        self.preflight = Preflight(
            self.gpu, smoke, settings, self.log, lambda: self.stops.requested
        )
        self.checkpoints = CheckpointTracker(self.run_dir, self.log, resume)
        self.lr_cut = LrCut(self.checkpoints, settings.nan_lr_factor)
        self._watcher: Any = None  # runner.supervisor.preemption.PreemptionWatcher
        self._mirror: Any = None  # runner.supervisor.mirror_sync.MirrorSync
        self.state_file = StateFile(
            self.run_dir, prev, settings, config_hash=config_hash, lr_scale=lr_scale, resume=resume
        )
        self.state = self.state_file.state
        self.relaunch = Relaunch(
            settings,
            self.run_dir / WORKER_LOG,
            self.state_file,
            self._write_state,
            self.log,
            self.preflight,
            self.gpu,
            lambda: self.stops.requested,
        )

    # ----------------------------------------------------------------- public

    def request_stop(self, kind: str, detail: str) -> None:
        """Stop the run (kind "user") or save-and-exit for preemption ("preempted"). Safe to
        call from a signal handler or another thread. A repeated request waits for the save the
        first one started (runner.supervisor.stops)."""
        self.stops.request(kind, detail)

    def run(self) -> int:
        """Preflight, then supervise until the run ends. Returns the supervisor's exit code."""
        old_handlers = self._install_signal_handlers() if self.handle_signals else {}
        try:
            self._write_state(force=True)
            reap_stale_worker(self.run_dir, self.s.stop_grace_s, self.log)
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
            self.checkpoints.start(self.resume)
            self.state.last_checkpoint_step = self.checkpoints.last_step
            self._start_preemption_watcher()
            code = self._preflight()
            if code is None:
                provider = self._watcher.provider if self._watcher is not None else None
                say_stop_save(self.preflight.stop_save, provider, self.s, self.log.emit)
                code = self._supervise()
            return code
        except RunDirWriteError as e:
            return self._end_unwritable(e)
        except Exception as e:
            # A supervisor bug must not leave an unsupervised worker behind, nor cost the
            # worker the progress it can still save.
            stopped = self._stop_worker()
            try:
                return self._end(
                    SupervisorPhase.FAILED,
                    EXIT_SOFTWARE,
                    f"supervisor error {type(e).__name__}: {e}; {stopped}. This is a bug in "
                    "m3run: report it with supervisor.log, then relaunch to resume from the "
                    "last complete checkpoint",
                    level="error",
                )
            except RunDirWriteError as unwritable:
                return self._end_unwritable(unwritable)
        finally:
            if self._watcher is not None:
                with contextlib.suppress(Exception):
                    self._watcher.stop()
            if self._mirror is not None:
                self._mirror.close()
            self.checkpoints.close()
            self.spares.spare.discard()
            for sig, handler in old_handlers.items():
                signal.signal(sig, handler)
            self.log.close()

    # ----------------------------------------------------------------- signals & preemption

    def _install_signal_handlers(self) -> dict:
        """The stop signals (stops.StopControl), and SIGHUP: a closed terminal takes only the
        console away, never the run."""
        handlers = self.stops.install_signal_handlers()
        if handlers:  # main thread only

            def hangup(_signum: int, _frame: Any) -> None:
                self.log.lose_console("received SIGHUP")

            handlers[signal.SIGHUP] = signal.signal(signal.SIGHUP, hangup)
        return handlers

    def _start_preemption_watcher(self) -> None:
        from m3run.runner.supervisor.preemption import start_watcher

        def on_stop(detail: str) -> None:
            self.request_stop(PREEMPTED, detail)

        s = self.s
        self._watcher = start_watcher(
            s.preemption_provider, s.metadata_url, s.preemption_poll_s, on_stop, self.log.emit
        )

    def _start_mirror(self) -> int | None:
        """A mirror that cannot be read ends the launch (exit 78) rather than silently
        training from scratch."""
        if not self.s.mirror_url:
            return None
        from m3run.runner.supervisor.mirror import MirrorError
        from m3run.runner.supervisor.mirror_sync import MirrorSync

        self._mirror = MirrorSync(self.s, self.run_dir, self.log)
        try:
            self._mirror.start(self.resume)
        except MirrorError as e:
            return self._end(
                SupervisorPhase.FAILED, EXIT_CONFIG, f"checkpoint mirror: {e}", level="error"
            )
        return None

    # ----------------------------------------------------------------- state

    def _write_state(self, force: bool = False, **changes: Any) -> None:
        self.state.peak_vram_bytes = self.vram.peak
        self.state.longest_startup_s = self.hang.longest_startup_s
        self.state_file.write(force, **changes)

    def _end(
        self, phase: SupervisorPhase, code: int, reason: str, level: str = "info", **fields: Any
    ) -> int:
        if self._mirror is not None:
            self._mirror.flush()  # before the final state: `m3run stop` waits for it
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

    def _end_unwritable(self, err: RunDirWriteError) -> int:
        """The run dir cannot be written: stop the worker, which cannot save either, then end
        the run as state.end_unwritable records it."""
        self._stop_worker()
        return end_unwritable(self.state_file, self.log.emit, err, self.console)

    def _stop_worker(self) -> str:
        """SIGTERM a running worker (it saves at its next step boundary and exits 75) and
        SIGKILL it only once the stop grace is spent. Returns what became of it."""
        worker = self.worker
        if worker is None or not worker.alive():
            return "no worker was running"
        worker.terminate()
        code = worker.wait(self.s.stop_grace_s)
        if code is None:
            worker.kill()
            return (
                f"worker pid {worker.pid} did not exit within the {self.s.stop_grace_s:g}s "
                "stop grace and was killed"
            )
        return f"worker pid {worker.pid} was asked to save and stop: {describe_exit(code)}"

    def _scanned(self, progressed: bool) -> None:
        """After a checkpoint scan: a new verified checkpoint is progress (restart accounting,
        the mirror), and state.json follows the newest usable step."""
        if progressed:
            self.relaunch.policy.progress()
            if self._mirror is not None:
                self._mirror.notify()
        if self.checkpoints.last_step != self.state.last_checkpoint_step:
            self._write_state(last_checkpoint_step=self.checkpoints.last_step)

    # ----------------------------------------------------------------- preflight

    def _preflight(self) -> int | None:
        """The health gate and the smoke test (preflight.Preflight). An exit code ends the
        run; None goes on."""
        return self._ended(
            self.preflight.run(
                self.run_dir,
                self.env,
                passed=self.state.smoke_passed,
                config_hash=self.config_hash,
                on_smoke_run=lambda: self.spares.before_smoke_test(
                    self.worker_argv(self.resume, self.lr_scale), self._attempt + 1
                ),
                write_state=self._write_state,
            )
        )

    def _ended(self, end: PreflightEnd | None) -> int | None:
        if end is None:
            return None
        if end.stopped:
            return self._stopped_without_worker()
        extra = {"health": end.details} if end.details is not None else {}
        return self._end(SupervisorPhase.FAILED, end.code, end.reason, level="error", **extra)

    def _stopped_without_worker(self) -> int:
        return self._end(*self.stops.without_worker())

    # ----------------------------------------------------------------- one worker

    def _spawn(self, resume: str) -> WorkerProcess:
        self._attempt += 1
        self.lr_cut.launched(resume, self.lr_scale)
        argv = self.worker_argv(resume, self.lr_scale)
        env = worker_env(self.env, self._attempt)
        worker = self.worker = WorkerProcess(
            self.run_dir, argv, env, self._attempt, spare=self.spares.spare
        )
        self.spares.worker_started(self.state_file.resume_step(resume))
        self.hang.new_worker(worker.spawn_wall)
        self._write_state(
            force=True,
            phase=SupervisorPhase.RUNNING,
            worker_pid=worker.pid,
            worker_create_time=worker.create_time,
            worker_started_at=worker.spawn_wall,
            resume=resume,
            lr_scale=self.lr_scale,
            reason=None,
            heartbeat_timeout_s=self.s.startup_timeout_s,
        )
        self.log.emit(
            "worker_start",
            reason=f"attempt {self._attempt}",
            pid=worker.pid,
            resume=resume,
            lr_scale=self.lr_scale,
            argv=argv,
            warm_spare=worker.from_spare,
        )
        return worker

    def _echo(self, worker: WorkerProcess, final: bool = False) -> None:
        for line in worker.lines(final=final):
            self.log.echo(line)

    def _record_stopping(self) -> None:
        self._write_state(force=True, phase=SupervisorPhase.STOPPING, reason=self.stops.detail)

    def _keep_lock(self) -> None:
        """supervisor.lock deleted or replaced while the run trains (a "stale lock" cleanup)
        leaves the path free for a second supervisor. Taking it again at once closes that door
        without disturbing the run; a lock another process already holds there means a second
        writer got in, and only stopping this run (its worker saves) leaves one writer."""
        lock = self.run_lock
        if lock is None or self._lock_lost or lock.held_at_path():
            return
        try:
            holder = lock.retake()
        except OSError as e:
            self._lose_lock(f"it cannot be taken again ({describe_os_error(e, lock.path)})")
            return
        if holder is None:
            self.log.emit(
                "lock_retaken",
                reason=f"{lock.path} was deleted or replaced while the run held it; supervisor "
                f"pid {os.getpid()} holds it again. Never delete the lock files of a live run",
                level="warning",
            )
            return
        pid = lock_holder(lock.path)
        if pid is None:
            return  # a reader's probe (`m3run status`, `stop`) had it for a moment: next poll
        self._lose_lock(f"pid {pid} now holds it", holder=pid)

    def _lose_lock(self, what: str, **fields: Any) -> None:
        self._lock_lost = True
        self.log.emit(
            "lock_lost",
            reason=f"{self.run_lock.path} was deleted or replaced while the run held it and "
            f"{what}: a second writer may be in {self.run_dir}. Stopping this run (the worker "
            "saves a checkpoint); fix: stop the other process, then relaunch once",
            level="error",
            **fields,
        )
        self.request_stop(USER, f"lost {self.run_lock.path}: {what}")

    def _watch(self, worker: WorkerProcess) -> Outcome:
        """Poll the worker until it exits; handles stop requests and hangs on the way."""
        stop = StopDelivery(self.stops, self.log)
        hang: str | None = None
        next_scan = 0.0
        while True:
            code = worker.wait(self.s.poll_s)
            self._echo(worker)
            self.log.record_console_loss()
            if code is not None:
                self._echo(worker, final=True)
                last = self.hang.read()
                if last is not None:
                    self.hang.observe(last)  # a worker that ended between two polls
                worker.kill()  # leftovers of the group (ranks, loader workers) go with it
                killed = stop.deadline_passed()
                # A SIGKILL this supervisor did not send (after a hang or the stop grace) is
                # named from the evidence: most often it is the out-of-memory killer's.
                ours = killed or hang is not None or code != -signal.SIGKILL
                how = None if ours else worker.witness.describe(code)
                worker.witness.close()
                return Outcome(
                    worker.protocol_code(code), hang=hang, killed_after_grace=killed, how=how
                )
            now = time.monotonic()
            self._keep_lock()
            stop.poll(worker, now, on_sent=self._record_stopping)
            if now >= next_scan:
                next_scan = now + _CHECKPOINT_SCAN_S
                self._scanned(self.checkpoints.scan())
            if self.gpu is not None:
                self.gpu.poll_vram(worker.pid)

            hb = self.hang.read()
            if hb is not None and self.hang.observe(hb) and hb.vram_bytes is not None:
                self.vram.note(hb.vram_bytes, "heartbeat")
            budget = self._watcher.save_budget if self._watcher is not None else None
            why = budget.check(hb) if budget is not None else None
            if why is not None:
                self.log.emit("preemption_budget", reason=why, level="warning")
            if not stop.sent:
                self.spares.heartbeat(worker.argv, hb, self._attempt + 1)
            allowance = self.hang.allowance(hb)
            if allowance != self.state.heartbeat_timeout_s:
                self._write_state(heartbeat_timeout_s=allowance)
            else:
                self._write_state()  # refreshes updated_at every few seconds
            if stop.sent or hang is not None:
                continue
            found = self.hang.check(hb, allowance)
            if found is not None:
                hang = found.reason
                self.log.emit(
                    "hang",
                    reason=found.reason,
                    level="warning",
                    pid=worker.pid,
                    heartbeat_age_s=round(found.age_s, 1),
                    allowance_s=found.allowance_s,
                    file=found.file,
                )
                self._write_state(force=True, phase=SupervisorPhase.RESTARTING, reason=hang)
                worker.terminate()
                stop.kill_at = now + self.s.stop_grace_s

    # ----------------------------------------------------------------- the loop

    def _supervise(self) -> int:
        resume = self.resume
        while True:
            if self.stops.requested:
                return self._stopped_without_worker()
            worker = self._spawn(resume)
            out = self._watch(worker)
            seen = time.monotonic()
            self._scanned(self.checkpoints.settle())  # waits for the hash of what it left
            settle_s = time.monotonic() - seen
            final = getattr(self.hang.read(), "phase", None)
            if out.hang is not None and final in FINAL_WORKER_PHASES:
                # It had finished, stopped or failed and then hung on its way out: its work is
                # done, so take the code its last phase stands for.
                self.log.emit(
                    "hang_on_exit",
                    level="warning",
                    reason=f"{out.hang}; the worker "
                    f"had reached phase {final.value!r}, so this counts as its exit",
                )
                out = Outcome(FINAL_WORKER_PHASES[final])
            code = out.exit_code
            self._write_state(
                force=True,
                last_exit={
                    "code": code,
                    "time": time.time(),
                    "pid": worker.pid,
                    "hang": out.hang,
                    "description": out.description(),
                },
            )
            self.log.emit(
                "worker_exit",
                reason=out.hang or out.description(),
                exit_code=code,
                pid=worker.pid,
                settle_s=round(settle_s, 3),
            )

            if self.stops.requested:
                return self._stop_outcome(out)
            if code == EXIT_OK and out.hang is None:
                return self._end(
                    SupervisorPhase.FINISHED,
                    EXIT_OK,
                    "worker finished the run (exit 0)",
                    last_checkpoint_step=self.state.last_checkpoint_step,
                )
            if code == EXIT_CONFIG and out.hang is None:
                return self._end(
                    SupervisorPhase.FAILED,
                    EXIT_CONFIG,
                    "worker exit 78: bad config or data (never restarted); the "
                    f"error is at the end of {self.run_dir / WORKER_LOG}; fix it "
                    "and relaunch",
                    level="error",
                )
            kind, reason, resume = diagnose(out, self.checkpoints, self.lr_cut)
            self.lr_scale = self.lr_cut.lr_scale_for(resume)
            end = self.relaunch.prepare(
                kind, reason, resume, self.lr_scale, exit_code=code, pid=worker.pid, exited=seen
            )
            if end is not None:
                return self._ended(end)
            self.resume = resume

    def _stop_outcome(self, out: Outcome) -> int:
        ckpt = self.state.last_checkpoint_step
        finished = getattr(self.hang.read(), "phase", None) == WorkerPhase.FINISHED
        ending = self.stops.after_worker(out.exit_code, out.killed_after_grace, finished, ckpt)
        return self._end(*ending, last_checkpoint_step=ckpt)
