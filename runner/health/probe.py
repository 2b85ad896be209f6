"""The NVML probe: the short-lived child that reads NVML, and the parent side that runs it.

NVML can hang on a sick GPU (a wedged driver blocks the calling thread in the kernel), so the
supervisor never talks to NVML itself. Every question goes to a short-lived child,
``python -m m3run.runner.health --probe-json``, which prints one JSON document of raw readings
(:func:`probe`); :func:`run_probe` starts it, and a child that outlives its timeout is killed
and reported as :class:`ProbeError` ``hung``.

The child gets its NVML implementation from :func:`load_nvml`: the real ``pynvml`` (package
nvidia-ml-py), or, when ``M3RUN_FAKE_NVML=<file.json>`` is set, ``FakeNVML`` (imported only then).
The probe code is identical for both, so CPU tests exercise it for real. Torch-free.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import m3run
from m3run.runner.health.nvml import (
    FAKE_NVML_ENV,
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_TIMEOUT,
    NVML_EVENT_TYPE_XID_CRITICAL,
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
    NVML_TEMPERATURE_GPU,
    NVML_TEMPERATURE_THRESHOLD_SLOWDOWN,
    NVML_VOLATILE_ECC,
)
from m3run.runner.procs import signal_group

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "PROBE_MODES",
    "XID_WAIT_MS",
    "ProbeError",
    "load_nvml",
    "probe",
    "probe_main",
    "run_probe",
]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 20.0
# Only XIDs raised while the probe listens are visible through NVML events; older ones live in
# the kernel log. The wait is short because it is paid on every launch and restart.
XID_WAIT_MS = 200

# The directory holding the m3run package (a checkout's root, or site-packages): the probe
# child's working directory, so that it imports this very code.
_PACKAGE_ROOT = Path(m3run.__file__).resolve().parents[1]
PROBE_MODES = ("health", "snapshot", "processes")
_STDERR_TAIL_CHARS = 2000
_REAP_S = 2.0


def load_nvml() -> Any:
    """The NVML implementation the probe uses: :class:`FakeNVML` when ``M3RUN_FAKE_NVML`` names a
    JSON file, otherwise the real ``pynvml`` module (ImportError if nvidia-ml-py is missing)."""
    fake = os.environ.get(FAKE_NVML_ENV)
    if fake:
        from m3run.runner.health.fake_nvml import FakeNVML

        return FakeNVML.from_file(fake)
    import pynvml

    return pynvml


def _error_reading(nvml: Any, err: BaseException) -> dict[str, Any]:
    return {"error": str(err), "code": getattr(err, "value", None)}


def _read(nvml: Any, fn_name: str, *args: Any, convert: Any = None) -> dict[str, Any]:
    """One NVML call as a reading: ``{"value": ...}`` or ``{"error": str, "code": int}``."""
    fn = getattr(nvml, fn_name, None)
    if fn is None:
        return {
            "error": f"{fn_name} is not in this NVML binding",
            "code": NVML_ERROR_FUNCTION_NOT_FOUND,
        }
    try:
        value = fn(*args)
    except nvml.NVMLError as err:
        return _error_reading(nvml, err)
    return {"value": convert(value) if convert else value}


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _process_label(pid: int) -> str | None:
    import psutil

    try:
        proc = psutil.Process(pid)
        cmd = " ".join(proc.cmdline()) or proc.name()
    except (psutil.Error, OSError):
        return None  # another PID namespace (containers), or already gone
    return cmd if len(cmd) <= 80 else cmd[:77] + "..."


def _processes(procs: Iterable[Any]) -> list[dict[str, Any]]:
    return [
        {"pid": int(p.pid), "used_bytes": p.usedGpuMemory, "label": _process_label(int(p.pid))}
        for p in procs
    ]


def _throttle_reading(nvml: Any, handle: Any) -> dict[str, Any]:
    # NVML 12.x renamed "throttle reasons" to "clock event reasons"; try the new name first.
    if hasattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons"):
        reading = _read(nvml, "nvmlDeviceGetCurrentClocksEventReasons", handle, convert=int)
        if reading.get("code") != NVML_ERROR_FUNCTION_NOT_FOUND:
            return reading
    return _read(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", handle, convert=int)


def _remapped_rows(value: Sequence[int]) -> dict[str, int]:
    corr, unc, pending, failure = value
    return {
        "correctable": int(corr),
        "uncorrectable": int(unc),
        "pending": int(pending),
        "failure": int(failure),
    }


def _probe_device(nvml: Any, handle: Any, mode: str) -> dict[str, Any]:
    dev: dict[str, Any] = {}
    if mode == "processes":
        dev["processes"] = _read(
            nvml, "nvmlDeviceGetComputeRunningProcesses", handle, convert=_processes
        )
        return dev
    dev["name"] = _read(nvml, "nvmlDeviceGetName", handle, convert=_text)
    dev["uuid"] = _read(nvml, "nvmlDeviceGetUUID", handle, convert=_text)
    dev["memory"] = _read(
        nvml,
        "nvmlDeviceGetMemoryInfo",
        handle,
        convert=lambda m: {"total": int(m.total), "free": int(m.free), "used": int(m.used)},
    )
    dev["utilization"] = _read(
        nvml,
        "nvmlDeviceGetUtilizationRates",
        handle,
        convert=lambda u: {"gpu": int(u.gpu), "memory": int(u.memory)},
    )
    dev["temperature_c"] = _read(
        nvml, "nvmlDeviceGetTemperature", handle, NVML_TEMPERATURE_GPU, convert=int
    )
    if mode == "snapshot":
        return dev
    dev["slowdown_temp_c"] = _read(
        nvml,
        "nvmlDeviceGetTemperatureThreshold",
        handle,
        NVML_TEMPERATURE_THRESHOLD_SLOWDOWN,
        convert=int,
    )
    dev["ecc_uncorrected"] = _read(
        nvml,
        "nvmlDeviceGetTotalEccErrors",
        handle,
        NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
        NVML_VOLATILE_ECC,
        convert=int,
    )
    dev["retired_pages_pending"] = _read(
        nvml, "nvmlDeviceGetRetiredPagesPendingStatus", handle, convert=int
    )
    dev["remapped_rows"] = _read(nvml, "nvmlDeviceGetRemappedRows", handle, convert=_remapped_rows)
    dev["throttle_reasons"] = _throttle_reading(nvml, handle)
    dev["processes"] = _read(
        nvml, "nvmlDeviceGetComputeRunningProcesses", handle, convert=_processes
    )
    return dev


def _event_device_index(nvml: Any, event: Any) -> int | None:
    try:
        return int(nvml.nvmlDeviceGetIndex(event.device))
    except nvml.NVMLError:
        return None


def _probe_xids(nvml: Any, handles: dict[int, Any], devices: dict[int, dict[str, Any]]) -> None:
    """Listen for critical-XID events for XID_WAIT_MS; store each device's ``xid_events``."""
    created = _read(nvml, "nvmlEventSetCreate")
    if "error" in created:
        for dev in devices.values():
            dev["xid_events"] = created
        return
    event_set = created["value"]
    seen: dict[int | None, list[int]] = {}
    try:
        for index, handle in handles.items():
            reg = _read(
                nvml, "nvmlDeviceRegisterEvents", handle, NVML_EVENT_TYPE_XID_CRITICAL, event_set
            )
            if "error" in reg:
                devices[index]["xid_events"] = reg
            else:
                seen[index] = []
        deadline = time.monotonic() + XID_WAIT_MS / 1000
        while seen and (left_ms := int((deadline - time.monotonic()) * 1000)) > 0:
            try:
                event = nvml.nvmlEventSetWait(event_set, left_ms)
            except nvml.NVMLError as err:
                if getattr(err, "value", None) != NVML_ERROR_TIMEOUT:
                    for index in [i for i in seen if i is not None]:
                        devices[index]["xid_events"] = _error_reading(nvml, err)
                        del seen[index]
                break
            if int(event.eventType) & NVML_EVENT_TYPE_XID_CRITICAL:
                index = _event_device_index(nvml, event)
                seen.setdefault(index if index in seen else None, []).append(int(event.eventData))
    finally:
        _read(nvml, "nvmlEventSetFree", event_set)
    unattributed = seen.pop(None, [])
    for index, xids in seen.items():
        devices[index]["xid_events"] = {"value": xids + unattributed}


def _device_nodes(nvml: Any) -> list[str]:
    nodes = getattr(nvml, "device_nodes", None)  # the fake says what it pretends to have
    if nodes is not None:
        return list(nodes)
    return sorted(glob.glob("/dev/nvidia[0-9]*"))


def probe(mode: str = "health", nvml: Any = None) -> dict[str, Any]:
    """Read NVML and return the raw readings as a JSON-ready dict (the child's whole job).

    ``mode``: ``health`` (everything the gate judges, plus a short XID listen), ``snapshot``
    (name, memory, utilisation, temperature) or ``processes`` (compute processes only).
    """
    if mode not in PROBE_MODES:
        raise ValueError(f"probe mode {mode!r} is unknown; use one of {PROBE_MODES}")
    start = time.monotonic()
    doc: dict[str, Any] = {
        "schema": 1,
        "mode": mode,
        "backend": None,
        "import_error": None,
        "init_error": None,
        "device_nodes": [],
        "driver_version": None,
        "count_error": None,
        "devices": [],
    }
    if nvml is None:
        try:
            nvml = load_nvml()
        except ImportError as err:
            doc["import_error"] = f"{err} (install nvidia-ml-py)"
            doc["device_nodes"] = _device_nodes(None)
            doc["elapsed_s"] = round(time.monotonic() - start, 3)
            return doc
    # The real binding is the pynvml module itself; the only other backend is a FakeNVML,
    # recognised without importing it.
    doc["backend"] = "pynvml" if isinstance(nvml, ModuleType) else f"fake:{nvml.source}"
    doc["device_nodes"] = _device_nodes(nvml)
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as err:
        doc["init_error"] = _error_reading(nvml, err)
        doc["elapsed_s"] = round(time.monotonic() - start, 3)
        return doc
    try:
        driver = _read(nvml, "nvmlSystemGetDriverVersion", convert=_text)
        doc["driver_version"] = driver.get("value")
        count = _read(nvml, "nvmlDeviceGetCount", convert=int)
        if "error" in count:
            doc["count_error"] = count
            return doc
        handles: dict[int, Any] = {}
        devices: dict[int, dict[str, Any]] = {}
        for index in range(count["value"]):
            got = _read(nvml, "nvmlDeviceGetHandleByIndex", index)
            if "error" in got:
                devices[index] = {"index": index, "handle_error": got}
                continue
            handles[index] = got["value"]
            devices[index] = {"index": index, **_probe_device(nvml, got["value"], mode)}
        if mode == "health" and handles:
            _probe_xids(nvml, handles, devices)
        doc["devices"] = [devices[i] for i in sorted(devices)]
    finally:
        _read(nvml, "nvmlShutdown")
        doc["elapsed_s"] = round(time.monotonic() - start, 3)
    return doc


def probe_main(mode: str) -> int:
    # Only the JSON document may reach stdout; anything a library prints goes to stderr.
    out = sys.stdout
    sys.stdout = sys.stderr
    doc = probe(mode)
    out.write(json.dumps(doc) + "\n")
    out.flush()
    return 0


class ProbeError(RuntimeError):
    """The probe child hung, crashed or printed something that is not its JSON document."""

    def __init__(self, kind: Literal["hung", "crashed", "bad_output"], message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _tail(text: str) -> str:
    text = text.strip()
    return text if len(text) <= _STDERR_TAIL_CHARS else "..." + text[-_STDERR_TAIL_CHARS:]


def _resolve_fake(fake: str | os.PathLike[str] | None) -> str | None:
    """Validate the fake description up front: a broken fake is a usage error, not a sick GPU."""
    path = fake if fake is not None else os.environ.get(FAKE_NVML_ENV)
    if not path:
        return None
    from m3run.runner.health.fake_nvml import FakeNVML

    resolved = str(Path(path).resolve())
    FakeNVML.from_file(resolved)
    return resolved


def run_probe(
    mode: str = "health",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    fake: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Run ``python -m m3run.runner.health --probe-json`` and return its document.

    Raises :class:`ProbeError` when the child outlives ``timeout_s`` (it is killed), exits
    non-zero or prints no JSON; ``ValueError`` for a bad ``mode``/``timeout_s``/fake file.
    """
    if mode not in PROBE_MODES:
        raise ValueError(f"probe mode {mode!r} is unknown; use one of {PROBE_MODES}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s!r} must be a positive number of seconds, e.g. 20")
    env = dict(os.environ)
    fake_path = _resolve_fake(fake)
    if fake_path:
        env[FAKE_NVML_ENV] = fake_path
    cmd = [sys.executable, "-m", "m3run.runner.health", "--probe-json", "--mode", mode]
    # cwd = the directory holding the `m3run` package, so the child imports this very code.
    proc = subprocess.Popen(
        cmd,
        cwd=_PACKAGE_ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        signal_group(proc.pid, signal.SIGKILL)  # the probe leads its own session
        try:
            _, err = proc.communicate(timeout=_REAP_S)
        except subprocess.TimeoutExpired:
            err = ""
            log.warning(
                "NVML probe pid %d ignores SIGKILL (stuck in the driver); abandoning it", proc.pid
            )
        stderr = f" Its stderr: {_tail(err)}" if err.strip() else ""
        raise ProbeError(
            "hung",
            f"NVML probe hung for {timeout_s:g} s and was killed: the NVIDIA driver is not "
            f"answering, which usually means a wedged GPU. Fix: drain this node and reset or "
            f"reboot it (`nvidia-smi`, `dmesg | grep -i xid`); if the host is only overloaded, "
            f"raise the health timeout (timeout_s={timeout_s:g}).{stderr}",
        ) from None
    if proc.returncode != 0:
        rc = proc.returncode
        how = f"exit code {rc}"
        if rc < 0:
            try:
                how = f"killed by {signal.Signals(-rc).name}"
            except ValueError:
                how = f"killed by signal {-rc}"
        raise ProbeError(
            "crashed",
            f"NVML probe crashed ({how}). stderr tail:\n{_tail(err) or '(empty)'}\n"
            f"Fix: run `nvidia-smi` and read the kernel log (`dmesg | grep -i xid`) on this "
            f"node; a driver that crashes its callers means the node needs a reset or a "
            f"replacement.",
        )
    try:
        doc = json.loads(out)
        if not isinstance(doc, dict) or doc.get("schema") != 1:
            raise ValueError("not a schema-1 probe document")
    except ValueError as exc:
        raise ProbeError(
            "bad_output",
            f"NVML probe printed no valid JSON document ({exc}); stdout began {out[:200]!r}, "
            f"stderr tail:\n{_tail(err) or '(empty)'}\nFix: run `python -m m3run.runner.health "
            f"--probe-json` by hand on this node to see what else writes to stdout.",
        ) from None
    return doc
