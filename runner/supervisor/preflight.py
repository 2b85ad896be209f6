"""Before a worker runs: the GPU health gate (NVML through runner.health, no torch, no CUDA
context) and the preflight smoke test, which imports torch and so runs as a child process
(`python -m m3run.runner.worker.smoke`) whose verdict comes back in smoke.json. `Preflight` runs the
two in order at a launch and says how the run ends if one fails."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from m3run.runner.config import ConfigError, load_config
from m3run.runner.data.manifest import fingerprint
from m3run.runner.files import read_json
from m3run.runner.health.checks import Verdict
from m3run.runner.kills import ExitWitness
from m3run.runner.procs import LogTail, signal_group, spawn_logged
from m3run.runner.protocol import (
    EXIT_CONFIG,
    EXIT_UNAVAILABLE,
    SMOKE_FILE,
    SMOKE_PROGRESS_FILE,
    WORKER_LOG,
    SmokeProgress,
    SmokeVerdict,
    StopSaveFigures,
)
from m3run.runner.supervisor.events import EventLog
from m3run.runner.supervisor.hang import VramWatch
from m3run.runner.supervisor.settings import SupervisorSettings

_VRAM_POLL_S = 5.0


class HealthReport(Protocol):
    """What the gate reads of runner.health's HealthReport."""

    verdict: str

    def summary(self) -> str: ...

    def to_dict(self) -> dict[str, Any]: ...


class GpuProbe(Protocol):
    """The supervisor's view of the GPUs."""

    def check(self, allowed_pids: list[int]) -> HealthReport: ...

    def process_memory(self, pid: int) -> int | None: ...

    def wait_released(self, pids: list[int], timeout_s: float) -> bool | None: ...


class NvmlProbe:
    """The real GpuProbe: runner.health's NVML probe child."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s

    def check(self, allowed_pids: list[int]) -> HealthReport:
        from m3run.runner.health.checks import check_gpu_health

        return check_gpu_health(self.timeout_s, allowed_pids=allowed_pids)

    def process_memory(self, pid: int) -> int | None:
        from m3run.runner.health.checks import process_gpu_memory

        return process_gpu_memory(pid)

    def wait_released(self, pids: list[int], timeout_s: float) -> bool | None:
        from m3run.runner.health.checks import wait_gpu_memory_released

        return wait_gpu_memory_released(pids, timeout_s)


@dataclass(frozen=True)
class GateResult:
    """The gate's reading: `failure` (the reason, exit 69) or a verdict to log."""

    failure: str | None
    verdict: Verdict | None = None
    summary: str = ""
    details: dict[str, Any] | None = None

    @property
    def has_gpu(self) -> bool:
        return self.verdict not in (None, Verdict.NO_GPU)

    def capacity_bytes(self) -> int | None:
        """Memory of the smallest GPU the report lists, if it lists one."""
        devices = (self.details or {}).get("devices") or []
        totals = [d.get("mem_total_mib") for d in devices if isinstance(d, dict)]
        totals = [t for t in totals if isinstance(t, (int, float)) and t > 0]
        return int(min(totals) * 2**20) if totals else None


def health_gate(gpu: GpuProbe, allowed_pids: list[int], when: str) -> GateResult:
    """Ask the probe; a report that is missing a field or names an unknown verdict fails the
    gate like a sick GPU would (it must never pass as healthy)."""
    try:
        report = gpu.check(allowed_pids)
        verdict = Verdict(report.verdict)
        summary, details = report.summary(), report.to_dict()
    except Exception as e:  # the gate itself failing must not hide a broken GPU
        return GateResult(
            failure=f"GPU health check ({when}) raised {type(e).__name__}: {e}; "
            "check the driver with nvidia-smi, or replace the node"
        )
    if verdict == Verdict.UNHEALTHY:
        return GateResult(
            failure=f"GPU unhealthy ({when}): {summary}; replace the node or fix the "
            "GPU, then relaunch",
            verdict=verdict,
            summary=summary,
            details=details,
        )
    return GateResult(failure=None, verdict=verdict, summary=summary, details=details)


class GpuWatch:
    """The GPU side of supervision: the health gate before every launch, per-process VRAM
    polling while a worker runs (on a GPU host only), and the wait for a dead worker's memory
    to be released before the next one starts."""

    def __init__(
        self, probe: GpuProbe, settings: SupervisorSettings, log: EventLog, vram: VramWatch
    ):
        self.probe = probe
        self.s = settings
        self.log = log
        self.vram = vram
        self.has_gpu = False
        # What the smoke test passed on: the GPUs' UUIDs, or on a host without one its name.
        self.device_key: str | None = None
        self._next_poll = 0.0

    def gate(self, when: str) -> GateResult:
        """Run the health gate; a passing verdict is logged and its GPU capacity noted."""
        gate = health_gate(self.probe, [os.getpid()], when)
        if gate.failure is not None:
            return gate
        self.has_gpu = gate.has_gpu
        uuids = sorted(
            str(d.get("uuid")) for d in (gate.details or {}).get("devices") or [] if d.get("uuid")
        )
        self.device_key = ",".join(uuids) if uuids else f"host:{socket.gethostname()}"
        reason, level = gate.summary, "warning" if gate.verdict == Verdict.WARN else "info"
        if gate.verdict == Verdict.NO_GPU:
            reason, level = _without_gpu(gate.summary, self.s.train_device)
        self.log.emit(
            "health",
            reason=reason,
            level=level,
            verdict=gate.verdict,
            when=when,
            health=gate.details,
        )
        if self.vram.capacity is None:
            self.vram.capacity = gate.capacity_bytes()
        return gate

    def poll_vram(self, pid: int) -> None:
        """Every few seconds: the memory NVML sees for `pid` and its descendants."""
        now = time.monotonic()
        if not self.has_gpu or now < self._next_poll:
            return
        self._next_poll = now + _VRAM_POLL_S
        with contextlib.suppress(Exception):  # NVML hiccups are not worth a restart
            used = self.probe.process_memory(pid)
            if used:
                self.vram.note(int(used), "nvml")

    def wait_released(self, pid: int) -> None:
        if not self.has_gpu:
            return
        t0 = time.monotonic()
        released = self.probe.wait_released([pid], self.s.gpu_release_timeout_s)
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


def _without_gpu(summary: str, device: str) -> tuple[str, str]:
    """The gate's line and level on a host without a GPU, for the device the run asks for."""
    if device == "cuda":
        return (
            f"{summary}\n  train.device=cuda asks for a CUDA GPU, so the run cannot train here "
            "(fix: give the host or container a GPU, e.g. `docker run --gpus all`, or set "
            "train.device=cpu or auto)",
            "warning",
        )
    return f"{summary}\n  the run trains on CPU (train.device={device})", "info"


@dataclass(frozen=True)
class SmokeResult:
    """What the preflight smoke test said: `passed` is the record to keep when it ran and
    passed (config_hash, device, data, time, stop_save), None when it was skipped or failed;
    `stop_save`: what it measured of a save (on a skip, what the passing test it relies on
    measured)."""

    ok: bool
    message: str
    passed: dict | None = None
    stop_save: StopSaveFigures | None = None


class SmokeTest:
    """The preflight smoke test in a child process. Its output goes to worker.log (echoed in
    the foreground through `echo`), its verdict to smoke.json.

    It runs at a run dir's first launch, after a config change and on another device (a new
    spot machine: other GPU UUIDs, or on CPU another host); a relaunch of an unchanged config on
    the same device skips it, unless `always` (`m3run launch --smoke`)."""

    def __init__(self, config_path: Path, always: bool = False):
        self.config_path = config_path
        self.always = always

    def data_fingerprint(self) -> str | None:
        """What the config's prepared splits hold (their manifests), so that data prepared
        again under the same paths is checked again; None when the config cannot be read (the
        smoke test itself then says why)."""
        try:
            cfg = load_config(self.config_path)
        except (ConfigError, OSError):
            return None
        return fingerprint(cfg.data.split_paths())

    def reason_to_run(
        self,
        passed: dict | None,
        config_hash: str | None,
        device: str | None,
        data: str | None = None,
    ) -> str | None:
        """Why this launch runs it, or None to skip it. `passed`: what the last passing smoke
        test of this run dir recorded (config_hash, device, data, time); `data`: the data's
        fingerprint now."""
        if self.always:
            return "--smoke was given"
        if not passed:
            return "first launch of this run dir"
        if passed.get("config_hash") != config_hash:
            return "the config changed since the last smoke test"
        if data is None or passed.get("data") != data:
            return "the training or validation data changed since the last smoke test"
        if device is None or passed.get("device") != device:
            return (
                f"another device ({device}; the last smoke test passed on {passed.get('device')})"
            )
        return None

    def check(
        self,
        run_dir: Path,
        env: dict[str, str],
        *,
        passed: dict | None,
        config_hash: str | None,
        device: str | None,
        before_run: Callable[[], None] = lambda: None,
        **run_args: Any,
    ) -> SmokeResult:
        """Run it (`run_args` as for `run`, `before_run` first) unless `reason_to_run` says it
        need not."""
        data = self.data_fingerprint()
        why = self.reason_to_run(passed, config_hash, device, data)
        if why is None:
            return SmokeResult(
                True,
                f"skipped: it passed for this config on {device} "
                "(`m3run launch --smoke` runs it again)",
                stop_save=StopSaveFigures.from_dict((passed or {}).get("stop_save")),
            )
        before_run()
        verdict = self.run(run_dir, env, **run_args)
        if not verdict.ok:
            return SmokeResult(False, verdict.message)
        record = {"config_hash": config_hash, "device": device, "data": data, "time": time.time()}
        if verdict.stop_save is not None:
            record["stop_save"] = verdict.stop_save.to_dict()
        return SmokeResult(True, f"{verdict.message} (ran: {why})", record, verdict.stop_save)

    def run(
        self,
        run_dir: Path,
        env: dict[str, str],
        timeout_s: float,
        poll_s: float,
        echo: Callable[[str], None],
        tick: Callable[..., None],
        stop_requested: Callable[[], bool],
    ) -> SmokeVerdict:
        """Its verdict, or a failed one that says why there is none. `tick` runs every poll
        (state.json stays fresh for the liveness check), given `preflight_check=` the check the
        child runs whenever that changes (None once it is done); a stop request or the timeout
        kills the child."""
        (run_dir / SMOKE_FILE).unlink(missing_ok=True)
        try:
            return self._run(run_dir, env, timeout_s, poll_s, echo, tick, stop_requested)
        finally:
            (run_dir / SMOKE_PROGRESS_FILE).unlink(missing_ok=True)
            tick(preflight_check=None)

    def _run(
        self,
        run_dir: Path,
        env: dict[str, str],
        timeout_s: float,
        poll_s: float,
        echo: Callable[[str], None],
        tick: Callable[..., None],
        stop_requested: Callable[[], bool],
    ) -> SmokeVerdict:
        (run_dir / SMOKE_PROGRESS_FILE).unlink(missing_ok=True)
        argv = [
            sys.executable,
            "-m",
            "m3run.runner.worker.smoke",
            str(self.config_path),
            "--run-dir",
            str(run_dir),
        ]
        log_path = run_dir / WORKER_LOG
        proc, offset = spawn_logged(
            argv,
            log_path,
            env={**env, "PYTHONUNBUFFERED": "1"},
            header="m3run supervisor: preflight smoke test",
        )
        witness = ExitWitness(proc.pid)
        tail = LogTail(log_path, offset)
        deadline = time.monotonic() + timeout_s
        shown: SmokeProgress | None = None
        while proc.poll() is None:
            witness.sample()
            for line in tail.lines():
                echo(line)
            progress = SmokeProgress.from_dict(read_json(run_dir / SMOKE_PROGRESS_FILE))
            if progress is not None and progress != shown:
                shown = progress
                tick(preflight_check=progress.to_dict())
            else:
                tick()
            if stop_requested() or time.monotonic() > deadline:
                witness.close()
                signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
                if stop_requested():
                    return SmokeVerdict(False, "stopped")
                return SmokeVerdict(
                    False,
                    f"did not finish within supervisor.startup_timeout_s={timeout_s:g}s; "
                    "raise it or set supervisor.smoke=false",
                )
            time.sleep(poll_s)
        for line in tail.lines(final=True):
            echo(line)
        how = witness.describe(proc.returncode)
        verdict = SmokeVerdict.from_dict(read_json(run_dir / SMOKE_FILE))
        if verdict is None:
            return SmokeVerdict(
                False,
                f"the smoke process ended without a verdict ({how}); see the end of {log_path}",
            )
        return verdict


@dataclass(frozen=True)
class PreflightEnd:
    """How a check ends the run before a worker starts: the exit code, the reason and the
    health report's details; or `stopped` when a stop request came first."""

    code: int = EXIT_UNAVAILABLE
    reason: str = ""
    details: dict[str, Any] | None = None
    stopped: bool = False


class Preflight:
    """A launch's checks before its first worker: the GPU health gate, then the smoke test
    unless this config passed it on this device. `on_smoke_run` runs just before a smoke test
    that runs (the supervisor starts the first worker as a warm spare there, so that its imports
    overlap the test); `write_state` keeps state.json fresh while it runs and records a pass.
    After `run`, `stop_save` holds what the smoke test measured of a save (None: nothing)."""

    def __init__(
        self,
        gpu: GpuWatch | None,
        smoke: SmokeTest | None,
        settings: SupervisorSettings,
        log: EventLog,
        stop_requested: Callable[[], bool],
    ):
        self.gpu = gpu
        self.smoke = smoke
        self.s = settings
        self.log = log
        self.stop_requested = stop_requested
        self.stop_save: StopSaveFigures | None = None

    def gate(self, when: str) -> PreflightEnd | None:
        """The health gate (before the first worker and every restart); None passes."""
        if self.gpu is None:
            return None
        result = self.gpu.gate(when)
        if result.failure is None:
            return None
        return PreflightEnd(EXIT_UNAVAILABLE, result.failure, result.details)

    def run(
        self,
        run_dir: Path,
        env: dict[str, str],
        *,
        passed: dict | None,
        config_hash: str | None,
        on_smoke_run: Callable[[], None],
        write_state: Callable[..., None],
    ) -> PreflightEnd | None:
        """Gate, then smoke test (`passed`: what the last passing one recorded). None goes on
        to the first worker."""
        end = self.gate("preflight")
        if end is not None:
            return end
        if self.stop_requested():
            return PreflightEnd(stopped=True)
        if self.smoke is None:
            return None
        result = self.smoke.check(
            run_dir,
            env,
            passed=passed,
            config_hash=config_hash,
            device=self.gpu.device_key if self.gpu is not None else None,
            before_run=on_smoke_run,
            timeout_s=self.s.startup_timeout_s,
            poll_s=self.s.poll_s,
            echo=self.log.echo,
            tick=write_state,
            stop_requested=self.stop_requested,
        )
        if self.stop_requested():
            return PreflightEnd(stopped=True)
        if not result.ok:
            return PreflightEnd(EXIT_CONFIG, f"preflight smoke test failed: {result.message}")
        if result.passed is not None:
            write_state(smoke_passed=result.passed)
        self.stop_save = result.stop_save
        self.log.emit("smoke", reason=result.message)
        return None
