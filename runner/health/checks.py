"""The GPU health gate the supervisor runs before a launch and before every restart.

The probe child (`m3run.runner.health.probe`) reads NVML; this module turns its readings into
:class:`Finding`\\ s and a :class:`Verdict`: ``healthy`` · ``warn`` (run, but look: hot,
throttled, a non-critical XID) · ``unhealthy`` (do not run here: exit
:data:`m3run.runner.protocol.EXIT_UNAVAILABLE`, replace the node) · ``no_gpu`` (no NVIDIA
driver or no devices: the run proceeds on CPU). It also answers which processes hold GPU
memory, for the supervisor's wait before a restart. Torch-free.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from m3run.runner.health.findings import Finding, device_findings, nvml_unavailable
from m3run.runner.health.nvml import mib
from m3run.runner.health.probe import DEFAULT_TIMEOUT_S, ProbeError, run_probe
from m3run.runner.protocol import EXIT_UNAVAILABLE

__all__ = [
    "DEFAULT_MIN_FREE_MEM_MIB",
    "DEFAULT_TEMP_LIMIT_C",
    "DeviceSnapshot",
    "HealthReport",
    "Verdict",
    "check_gpu_health",
    "evaluate",
    "gpu_snapshot",
    "process_gpu_memory",
    "wait_gpu_memory_released",
]

log = logging.getLogger(__name__)

DEFAULT_MIN_FREE_MEM_MIB = 2048
DEFAULT_TEMP_LIMIT_C = 90


class Verdict(StrEnum):
    """The gate's answer; the supervisor refuses to run only on UNHEALTHY."""

    HEALTHY = "healthy"
    WARN = "warn"  # run, but look: hot, throttled, a non-critical XID
    UNHEALTHY = "unhealthy"  # do not run here: exit EXIT_UNAVAILABLE, replace the node
    NO_GPU = "no_gpu"  # no NVIDIA driver or no devices: a run here trains on CPU, if it may


@dataclass(frozen=True)
class DeviceSnapshot:
    """Cheap per-device numbers (for `m3run status` and the report header)."""

    index: int
    name: str | None
    uuid: str | None
    util_gpu_pct: int | None
    mem_used_mib: int | None
    mem_total_mib: int | None
    temp_c: int | None


_STATUS_RANK = {"ok": 0, "info": 0, "warn": 1, "unhealthy": 2}


@dataclass
class HealthReport:
    """The gate's answer: a verdict and the findings behind it."""

    verdict: Verdict
    findings: list[Finding] = field(default_factory=list)
    devices: list[DeviceSnapshot] = field(default_factory=list)
    driver_version: str | None = None
    backend: str | None = None
    elapsed_s: float | None = None

    def __post_init__(self) -> None:
        self.verdict = Verdict(self.verdict)

    @property
    def ok(self) -> bool:
        """True when the run may proceed (healthy, warn or no_gpu)."""
        return self.verdict != Verdict.UNHEALTHY

    @property
    def exit_code(self) -> int:
        """The supervisor's exit code for this verdict: EXIT_UNAVAILABLE or 0."""
        return EXIT_UNAVAILABLE if self.verdict == Verdict.UNHEALTHY else 0

    def problems(self) -> list[Finding]:
        return [f for f in self.findings if f.status in ("warn", "unhealthy")]

    def summary(self, verbose: bool = False) -> str:
        """Human text: the verdict, then one line per problem (and per healthy device)."""
        head = f"GPU health: {self.verdict}"
        if self.devices:
            head += f" - {len(self.devices)} GPU(s)"
        if self.driver_version:
            head += f", driver {self.driver_version}"
        lines = [head]
        shown = self.findings if verbose else [f for f in self.findings if f.status != "ok"]
        if not verbose:
            shown = [f for f in shown if f.status != "info" or f.device is None]
        troubled = {f.device for f in self.problems()}
        for dev in self.devices:
            if dev.index not in troubled:
                detail = []
                if dev.temp_c is not None:
                    detail.append(f"{dev.temp_c} °C")
                if dev.mem_total_mib is not None and dev.mem_used_mib is not None:
                    free = dev.mem_total_mib - dev.mem_used_mib
                    detail.append(f"{free}/{dev.mem_total_mib} MiB free")
                lines.append(f"  GPU {dev.index} {dev.name or ''}: ok ({', '.join(detail)})")
        for f in shown:
            where = "host" if f.device is None else f"GPU {f.device}"
            lines.append(f"  [{f.status}] {where} {f.check}: {f.message}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict.value,
            "findings": [asdict(f) for f in self.findings],
            "devices": [asdict(d) for d in self.devices],
            "driver_version": self.driver_version,
            "backend": self.backend,
            "elapsed_s": self.elapsed_s,
        }


def _verdict(findings: Sequence[Finding], no_gpu: bool) -> Verdict:
    worst = max((_STATUS_RANK[f.status] for f in findings), default=0)
    if worst == 2:
        return Verdict.UNHEALTHY
    if worst == 1:
        return Verdict.WARN
    return Verdict.NO_GPU if no_gpu else Verdict.HEALTHY


def _snapshot(dev: dict[str, Any]) -> DeviceSnapshot:
    mem = dev.get("memory", {}).get("value") or {}
    util = dev.get("utilization", {}).get("value") or {}
    return DeviceSnapshot(
        index=dev["index"],
        name=dev.get("name", {}).get("value"),
        uuid=dev.get("uuid", {}).get("value"),
        util_gpu_pct=util.get("gpu"),
        mem_used_mib=mib(mem.get("used")),
        mem_total_mib=mib(mem.get("total")),
        temp_c=dev.get("temperature_c", {}).get("value"),
    )


def evaluate(
    doc: dict[str, Any],
    *,
    min_free_mem_mib: int = DEFAULT_MIN_FREE_MEM_MIB,
    allowed_pids: Iterable[int] = (),
    allow_foreign_processes: bool = False,
    temp_limit_c: float = DEFAULT_TEMP_LIMIT_C,
    devices: Sequence[int] | None = None,
    expected_count: int | None = None,
) -> HealthReport:
    """Judge a ``health``-mode probe document (see :func:`check_gpu_health` for the rules)."""
    report = HealthReport(
        verdict=Verdict.HEALTHY,
        driver_version=doc.get("driver_version"),
        backend=doc.get("backend"),
        elapsed_s=doc.get("elapsed_s"),
    )
    findings = report.findings
    if doc.get("import_error") or doc.get("init_error"):
        findings.append(nvml_unavailable(doc))
        report.verdict = _verdict(findings, no_gpu=True)
        return report
    if doc.get("count_error"):
        err = doc["count_error"]
        findings.append(
            Finding(
                None,
                "count",
                "unhealthy",
                f"NVML initialised but could not count the GPUs: '{err['error']}' (NVML error "
                f"{err['code']}). Fix: check `nvidia-smi` on this node; reset or replace it.",
            )
        )
        report.verdict = _verdict(findings, no_gpu=False)
        return report
    present = {dev["index"]: dev for dev in doc["devices"]}
    wanted = sorted(present) if devices is None else list(devices)
    missing = [i for i in wanted if i not in present]
    if expected_count is not None and len(present) < expected_count:
        findings.append(
            Finding(
                None,
                "count",
                "unhealthy",
                f"{len(present)} GPU(s) visible, expected_count={expected_count}; a GPU has "
                f"fallen off the bus or is not bound to the driver. Fix: check `nvidia-smi -L` "
                f"and `dmesg`; reboot or replace the node.",
            )
        )
    if missing:
        findings.append(
            Finding(
                None,
                "count",
                "unhealthy",
                f"GPU index(es) {missing} requested but only {sorted(present)} are present. "
                f"Fix: choose devices among {sorted(present)}, or check `nvidia-smi -L` for a "
                f"GPU that disappeared.",
            )
        )
    if not present:
        if expected_count or devices:
            report.verdict = _verdict(findings, no_gpu=False)
        else:
            findings.append(
                Finding(None, "count", "info", "no GPU: NVML reports 0 devices; running on CPU")
            )
            report.verdict = _verdict(findings, no_gpu=True)
        return report
    allowed = {int(p) for p in allowed_pids}
    for index in wanted:
        dev = present.get(index)
        if dev is None:
            continue
        if "handle_error" in dev:
            err = dev["handle_error"]
            findings.append(
                Finding(
                    index,
                    "device",
                    "unhealthy",
                    f"NVML cannot open the device: '{err['error']}' (NVML error {err['code']}). "
                    f"Fix: drain this node and reset the GPU (`nvidia-smi -r`) or reboot it.",
                )
            )
            continue
        report.devices.append(_snapshot(dev))
        findings.extend(
            device_findings(
                dev,
                index,
                allowed_pids=allowed,
                allow_foreign_processes=allow_foreign_processes,
                temp_limit_c=temp_limit_c,
                min_free_mem_mib=min_free_mem_mib,
            )
        )
    report.verdict = _verdict(findings, no_gpu=False)
    return report


def check_gpu_health(
    timeout_s: float = DEFAULT_TIMEOUT_S,
    min_free_mem_mib: int = DEFAULT_MIN_FREE_MEM_MIB,
    allowed_pids: Iterable[int] = (),
    allow_foreign_processes: bool = False,
    temp_limit_c: float = DEFAULT_TEMP_LIMIT_C,
    fake: str | os.PathLike[str] | None = None,
    *,
    devices: Sequence[int] | None = None,
    expected_count: int | None = None,
) -> HealthReport:
    """Probe the GPUs in a child process and judge them.

    Unhealthy (exit :data:`EXIT_UNAVAILABLE`): the probe hung past ``timeout_s`` or crashed;
    device nodes exist but NVML cannot start; a device cannot be opened or is lost; uncorrected
    volatile ECC errors; retired pages pending; a row remap pending or failed; a critical XID
    (:data:`CRITICAL_XIDS`); compute processes whose pids are not in ``allowed_pids`` (unless
    ``allow_foreign_processes``); free memory below ``min_free_mem_mib``; fewer GPUs than
    ``expected_count`` or a requested index in ``devices`` missing.
    Warn: temperature at or above ``min(temp_limit_c, the GPU's slowdown threshold)``;
    throttling by HW slowdown, SW/HW thermal or power brake; a non-critical XID; a reading that
    failed with an unexpected NVML error. NotSupported readings are notes (status "info").
    no_gpu: nvidia-ml-py or the NVML library missing, or zero devices, with no device nodes.

    ``fake`` names a :class:`FakeNVML` JSON description for the child (tests, demos); without it
    the child inherits ``M3RUN_FAKE_NVML`` from this process's environment, if set.
    """
    try:
        doc = run_probe("health", timeout_s, fake)
    except ProbeError as err:
        return HealthReport(
            verdict=Verdict.UNHEALTHY, findings=[Finding(None, "probe", "unhealthy", str(err))]
        )
    return evaluate(
        doc,
        min_free_mem_mib=min_free_mem_mib,
        allowed_pids=allowed_pids,
        allow_foreign_processes=allow_foreign_processes,
        temp_limit_c=temp_limit_c,
        devices=devices,
        expected_count=expected_count,
    )


def gpu_snapshot(
    timeout_s: float = 5.0, fake: str | os.PathLike[str] | None = None
) -> list[DeviceSnapshot]:
    """Utilisation, memory and temperature per GPU, via the probe child.

    Returns ``[]`` without a GPU; raises :class:`ProbeError` when the probe hangs or crashes.
    """
    doc = run_probe("snapshot", timeout_s, fake)
    return [_snapshot(dev) for dev in doc["devices"] if "handle_error" not in dev]


def _gpu_processes(
    timeout_s: float, fake: str | os.PathLike[str] | None
) -> tuple[dict[int, int | None], bool] | None:
    """pid -> used bytes (None = unknown) over all GPUs, and whether every GPU answered.

    None when there is no GPU."""
    doc = run_probe("processes", timeout_s, fake)
    if doc.get("import_error") or doc.get("init_error") or doc.get("count_error"):
        return None
    if not doc["devices"]:
        return None
    usage: dict[int, int | None] = {}
    complete = True
    for dev in doc["devices"]:
        reading = dev.get("processes", {"error": "device not opened"})
        if "error" in reading:
            complete = False
            continue
        for p in reading["value"]:
            pid, used = p["pid"], p["used_bytes"]
            before = usage.get(pid, 0)
            usage[pid] = None if used is None or before is None else before + used
    return usage, complete


def process_gpu_memory(
    pid: int,
    *,
    include_children: bool = False,
    timeout_s: float = 5.0,
    fake: str | os.PathLike[str] | None = None,
) -> int | None:
    """GPU memory in bytes held by ``pid`` over all GPUs; with ``include_children`` also by
    its descendants (a torchrun tree in one probe, instead of one probe per pid).

    ``0`` when it holds none; ``None`` when it cannot be told: no GPU, NVML lacks per-process
    memory, or the probe failed. In a container without the host's PID namespace NVML reports
    host pids, which match nothing here (the result is then 0).
    """
    pids = {pid}
    if include_children:
        import psutil

        with contextlib.suppress(psutil.Error):
            pids.update(c.pid for c in psutil.Process(pid).children(recursive=True))
    try:
        got = _gpu_processes(timeout_s, fake)
    except ProbeError as err:
        log.warning("GPU memory of pid %d unknown: %s", pid, err)
        return None
    if got is None:
        return None
    usage, complete = got
    mine = [usage[p] for p in pids if p in usage]
    if any(u is None for u in mine) or (not mine and not complete):
        return None
    return sum(u for u in mine if u is not None)


def wait_gpu_memory_released(
    pids: Iterable[int],
    timeout_s: float,
    *,
    poll_s: float = 0.5,
    fake: str | os.PathLike[str] | None = None,
) -> bool:
    """Wait until no GPU lists any of ``pids`` as a compute process; False after ``timeout_s``.

    True at once without a GPU. Where NVML cannot list processes, waits for the pids to exit.
    """
    import psutil

    wanted = {int(p) for p in pids}
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            got = _gpu_processes(min(left, DEFAULT_TIMEOUT_S), fake)
        except ProbeError as err:
            log.warning("GPU release check failed, retrying: %s", err)
            got = ({p: None for p in wanted}, True)  # unknown: treat as still held
        if got is None:
            return True
        usage, complete = got
        held = wanted & set(usage)
        if not complete:
            held |= {p for p in wanted if psutil.pid_exists(p)}
        if not held:
            return True
        time.sleep(max(0.0, min(poll_s, deadline - time.monotonic())))
