"""The GPU health gate the supervisor runs before a launch and before every restart.

NVML can hang on a sick GPU (a wedged driver blocks the calling thread in the kernel), so the
supervisor never talks to NVML itself. Every question goes to a short-lived child,
``python -m runner.health --probe-json``, which prints one JSON document of raw readings; the
parent turns the readings into :class:`Finding`\\ s and a verdict. A child that outlives its
timeout is killed, and "the probe hung" is a verdict of its own.

The child gets its NVML implementation from :func:`load_nvml`: the real ``pynvml`` (package
nvidia-ml-py), or, when ``M3RUN_FAKE_NVML=<file.json>`` is set, :class:`FakeNVML`, which answers the
same function names from a JSON description of devices (faults, NotSupported errors, hangs and
crashes included). The probe code is identical for both, so CPU tests exercise it for real.

Verdicts: ``healthy`` · ``warn`` (run, but look: hot, throttled, a non-critical XID) ·
``unhealthy`` (do not run here: exit :data:`HEALTH_EXIT_CODE`, replace the node) · ``no_gpu``
(no NVIDIA driver or no devices: the run proceeds on CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

log = logging.getLogger(__name__)

HEALTH_EXIT_CODE = 69  # sysexits EX_UNAVAILABLE: the supervisor's "GPU unhealthy, replace the node"
FAKE_NVML_ENV = "M3RUN_FAKE_NVML"
DEFAULT_TIMEOUT_S = 20.0
DEFAULT_MIN_FREE_MEM_MIB = 2048
DEFAULT_TEMP_LIMIT_C = 90
# Only XIDs raised while the probe listens are visible through NVML events; older ones live in
# the kernel log. The wait is short because it is paid on every launch and restart.
XID_WAIT_MS = 200

# XIDs that mean the hardware (not the program) is at fault; from NVIDIA's "XID Errors" catalogue.
CRITICAL_XIDS: dict[int, str] = {
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapping failed",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}

Verdict = Literal["healthy", "warn", "unhealthy", "no_gpu"]
Status = Literal["ok", "info", "warn", "unhealthy"]

# NVML ABI values from nvml.h; the probe passes them to whichever backend load_nvml() returned.
_NVML_TEMPERATURE_GPU = 0
_NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 1
_NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
_NVML_VOLATILE_ECC = 0
_NVML_EVENT_TYPE_XID_CRITICAL = 0x8
_NVML_ERROR_NOT_SUPPORTED = 3
_NVML_ERROR_NO_PERMISSION = 4
_NVML_ERROR_TIMEOUT = 10
_NVML_ERROR_FUNCTION_NOT_FOUND = 13
_NVML_ERROR_GPU_IS_LOST = 15
_NVML_ERROR_RESET_REQUIRED = 16
_NVML_ERROR_GPU_NOT_FOUND = 28

# Clock event ("throttle") reason bits, nvmlClocksEventReason*.
THROTTLE_REASONS: dict[str, int] = {
    "gpu_idle": 0x1,
    "applications_clocks": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal": 0x20,
    "hw_thermal": 0x40,
    "hw_power_brake": 0x80,
    "display_clock": 0x100,
}
# The ones that mean heat or a power fault; sw_power_cap and gpu_idle are routine under load.
_THROTTLE_WARN = ("hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake")

_MIB = 1024 * 1024
_PACKAGE_ROOT = Path(__file__).resolve().parent.parent
_PROBE_MODES = ("health", "snapshot", "processes")
_STDERR_TAIL_CHARS = 2000
_REAP_S = 2.0


# --------------------------------------------------------------------------------------------
# The NVML seam
# --------------------------------------------------------------------------------------------


def load_nvml() -> Any:
    """The NVML implementation the probe uses: :class:`FakeNVML` when ``M3RUN_FAKE_NVML`` names a
    JSON file, otherwise the real ``pynvml`` module (ImportError if nvidia-ml-py is missing)."""
    fake = os.environ.get(FAKE_NVML_ENV)
    if fake:
        return FakeNVML.from_file(fake)
    import pynvml

    return pynvml


_FAKE_TOP_KEYS = {"devices", "driver_version", "device_nodes", "hang", "crash", "errors"}
_FAKE_DEVICE_DEFAULTS: dict[str, Any] = {
    "name": "Fake NVIDIA H200",
    "uuid": None,  # GPU-fake-<index>
    "memory_total_mib": 143771,
    "memory_used_mib": None,  # the sum of the processes' used_mib
    "utilization_gpu": 0,
    "utilization_memory": 0,
    "temperature_c": 35,
    "slowdown_temp_c": 92,
    "ecc_uncorrected": 0,
    "retired_pages_pending": False,
    "remapped_rows": {"correctable": 0, "uncorrectable": 0, "pending": False, "failure": False},
    "throttle_reasons": [],
    "xid_events": [],
    "processes": [],
    "errors": {},
}


@dataclass(frozen=True)
class _FakeHandle:
    index: int


class FakeNVML:
    """An NVML stand-in driven by a JSON description, answering pynvml's function names.

    The description (every key optional; a device ``{}`` is a healthy idle GPU)::

        {
          "driver_version": "550.54.15",
          "device_nodes": ["/dev/nvidia0"],      what the probe "finds" under /dev (default none)
          "hang": true | "<nvml function>",      sleep forever in nvmlInit or in that function
          "crash": true | "<nvml function>",     die by SIGSEGV there, as a broken driver would
          "errors": {"nvmlInit": "LIBRARY_NOT_FOUND"},   host-level functions that raise
          "devices": [{
            "name": "...", "uuid": "...", "memory_total_mib": 143771, "memory_used_mib": 0,
            "utilization_gpu": 0, "utilization_memory": 0,
            "temperature_c": 35, "slowdown_temp_c": 92, "ecc_uncorrected": 0,
            "retired_pages_pending": false,
            "remapped_rows": {"correctable": 0, "uncorrectable": 0, "pending": false,
                              "failure": false},
            "throttle_reasons": ["hw_slowdown", "hw_thermal"],      names or an int bitmask
            "xid_events": [79],                  delivered once the probe registers for events
            "processes": [{"pid": 4242, "used_mib": 1000}],   used_mib null = NVML can't tell
            "errors": {"nvmlDeviceGetRemappedRows": "NOT_SUPPORTED"}   per-device raises
          }]
        }

    Error names are NVML's without the prefix (``NOT_SUPPORTED``, ``GPU_IS_LOST``, ...); they are
    raised as pynvml's own ``NVMLError`` subclasses, so the probe's ``except`` clauses are the
    production ones.
    """

    def __init__(self, spec: dict[str, Any], source: str = "<dict>") -> None:
        import pynvml  # the fake raises pynvml's real exception classes

        self._pynvml = pynvml
        self.NVMLError = pynvml.NVMLError
        self.source = source
        self._spec = _validate_fake_spec(spec, source, pynvml)
        self._devices = [{**_FAKE_DEVICE_DEFAULTS, **dev} for dev in self._spec.get("devices", [])]
        self._pending_xids = [list(dev["xid_events"]) for dev in self._devices]
        self.device_nodes = list(self._spec.get("device_nodes", []))

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> FakeNVML:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(
                f"fake NVML description {str(p)!r} does not exist; fix {FAKE_NVML_ENV} (or the "
                f"fake= argument) to name a JSON file describing the fake devices"
            )
        try:
            spec = json.loads(p.read_text())
        except ValueError as err:
            raise ValueError(
                f"fake NVML description {str(p)!r} is not valid JSON ({err}); fix the file"
            ) from err
        return cls(spec, source=str(p))

    # -- fault injection ----------------------------------------------------------------------

    def _enter(self, fn: str, handle: _FakeHandle | None = None) -> dict[str, Any] | None:
        spec = self._spec
        if (spec.get("hang") is True and fn == "nvmlInit") or spec.get("hang") == fn:
            while True:  # a wedged driver: the parent's timeout is the only way out
                time.sleep(3600)
        if (spec.get("crash") is True and fn == "nvmlInit") or spec.get("crash") == fn:
            _simulate_segfault(f"fake NVML: simulated driver crash in {fn}")
        errors = spec.get("errors", {})
        dev = None
        if handle is not None:
            dev = self._devices[handle.index]
            errors = {**errors, **dev["errors"]}
        if fn in errors:
            raise self._error(errors[fn])
        return dev

    def _error(self, name: str) -> Exception:
        return self.NVMLError(getattr(self._pynvml, f"NVML_ERROR_{name}"))

    # -- host ---------------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self._enter("nvmlInit")

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return str(self._spec.get("driver_version", "550.54.15"))

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self._devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _FakeHandle:
        if not 0 <= index < len(self._devices):
            raise self._error("INVALID_ARGUMENT")
        handle = _FakeHandle(index)
        self._enter("nvmlDeviceGetHandleByIndex", handle)
        return handle

    # -- per device ---------------------------------------------------------------------------

    def nvmlDeviceGetIndex(self, handle: _FakeHandle) -> int:
        self._enter("nvmlDeviceGetIndex", handle)
        return handle.index

    def nvmlDeviceGetName(self, handle: _FakeHandle) -> str:
        return str(self._enter("nvmlDeviceGetName", handle)["name"])

    def nvmlDeviceGetUUID(self, handle: _FakeHandle) -> str:
        dev = self._enter("nvmlDeviceGetUUID", handle)
        return str(dev["uuid"] or f"GPU-fake-{handle.index}")

    def nvmlDeviceGetMemoryInfo(self, handle: _FakeHandle, version: Any = None) -> Any:
        dev = self._enter("nvmlDeviceGetMemoryInfo", handle)
        total = int(dev["memory_total_mib"]) * _MIB
        used_mib = dev["memory_used_mib"]
        if used_mib is None:
            used_mib = sum(p.get("used_mib") or 0 for p in dev["processes"])
        used = min(int(used_mib * _MIB), total)
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetUtilizationRates(self, handle: _FakeHandle) -> Any:
        dev = self._enter("nvmlDeviceGetUtilizationRates", handle)
        return SimpleNamespace(gpu=dev["utilization_gpu"], memory=dev["utilization_memory"])

    def nvmlDeviceGetTemperature(self, handle: _FakeHandle, sensor: int) -> int:
        return int(self._enter("nvmlDeviceGetTemperature", handle)["temperature_c"])

    def nvmlDeviceGetTemperatureThreshold(self, handle: _FakeHandle, threshold: int) -> int:
        dev = self._enter("nvmlDeviceGetTemperatureThreshold", handle)
        if threshold != _NVML_TEMPERATURE_THRESHOLD_SLOWDOWN or dev["slowdown_temp_c"] is None:
            raise self._error("NOT_SUPPORTED")
        return int(dev["slowdown_temp_c"])

    def nvmlDeviceGetTotalEccErrors(
        self, handle: _FakeHandle, error_type: int, counter_type: int
    ) -> int:
        return int(self._enter("nvmlDeviceGetTotalEccErrors", handle)["ecc_uncorrected"])

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: _FakeHandle) -> int:
        dev = self._enter("nvmlDeviceGetRetiredPagesPendingStatus", handle)
        return int(bool(dev["retired_pages_pending"]))

    def nvmlDeviceGetRemappedRows(self, handle: _FakeHandle) -> tuple[int, int, int, int]:
        rows = self._enter("nvmlDeviceGetRemappedRows", handle)["remapped_rows"]
        return (
            int(rows.get("correctable", 0)),
            int(rows.get("uncorrectable", 0)),
            int(bool(rows.get("pending", False))),
            int(bool(rows.get("failure", False))),
        )

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: _FakeHandle) -> int:
        reasons = self._enter("nvmlDeviceGetCurrentClocksEventReasons", handle)
        return _throttle_mask(reasons["throttle_reasons"])

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: _FakeHandle) -> int:
        reasons = self._enter("nvmlDeviceGetCurrentClocksThrottleReasons", handle)
        return _throttle_mask(reasons["throttle_reasons"])

    def nvmlDeviceGetComputeRunningProcesses(self, handle: _FakeHandle) -> list[Any]:
        dev = self._enter("nvmlDeviceGetComputeRunningProcesses", handle)
        return [
            SimpleNamespace(
                pid=int(p["pid"]),
                usedGpuMemory=None if p.get("used_mib") is None else int(p["used_mib"] * _MIB),
            )
            for p in dev["processes"]
        ]

    # -- events -------------------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> list[int]:
        self._enter("nvmlEventSetCreate")
        return []  # the registered device indices

    def nvmlDeviceRegisterEvents(
        self, handle: _FakeHandle, event_types: int, event_set: list[int]
    ) -> None:
        self._enter("nvmlDeviceRegisterEvents", handle)
        if event_types & _NVML_EVENT_TYPE_XID_CRITICAL:
            event_set.append(handle.index)

    def nvmlEventSetWait(self, event_set: list[int], timeout_ms: int) -> Any:
        self._enter("nvmlEventSetWait")
        for index in event_set:
            if self._pending_xids[index]:
                xid = self._pending_xids[index].pop(0)
                return SimpleNamespace(
                    device=_FakeHandle(index),
                    eventType=_NVML_EVENT_TYPE_XID_CRITICAL,
                    eventData=int(xid),
                )
        raise self._error("TIMEOUT")

    def nvmlEventSetFree(self, event_set: list[int]) -> None:
        self._enter("nvmlEventSetFree")


def _validate_fake_spec(spec: Any, source: str, pynvml: Any) -> dict[str, Any]:
    def bad(problem: str) -> ValueError:
        return ValueError(f"fake NVML description {source}: {problem}")

    if not isinstance(spec, dict):
        raise bad(f"the top level must be a JSON object, got {type(spec).__name__}")
    unknown = set(spec) - _FAKE_TOP_KEYS
    if unknown:
        raise bad(f"unknown key(s) {sorted(unknown)}; allowed: {sorted(_FAKE_TOP_KEYS)}")
    devices = spec.get("devices", [])
    if not isinstance(devices, list) or not all(isinstance(d, dict) for d in devices):
        raise bad("'devices' must be a list of objects (one per GPU)")
    error_maps = [spec.get("errors", {})]
    for i, dev in enumerate(devices):
        unknown = set(dev) - set(_FAKE_DEVICE_DEFAULTS)
        if unknown:
            raise bad(
                f"device {i} has unknown key(s) {sorted(unknown)}; "
                f"allowed: {sorted(_FAKE_DEVICE_DEFAULTS)}"
            )
        reasons = dev.get("throttle_reasons", [])
        if isinstance(reasons, list):
            wrong = [r for r in reasons if r not in THROTTLE_REASONS]
            if wrong:
                raise bad(
                    f"device {i} has unknown throttle reason(s) {wrong}; "
                    f"allowed: {sorted(THROTTLE_REASONS)}"
                )
        error_maps.append(dev.get("errors", {}))
    for errors in error_maps:
        for fn, name in errors.items():
            if not hasattr(pynvml, f"NVML_ERROR_{name}"):
                raise bad(
                    f"error {name!r} for {fn} is not an NVML error name; use one like "
                    f"'NOT_SUPPORTED', 'GPU_IS_LOST', 'UNKNOWN' (pynvml's NVML_ERROR_* without "
                    f"the prefix)"
                )
    return spec


def _throttle_mask(reasons: int | list[str]) -> int:
    if isinstance(reasons, int):
        return reasons
    mask = 0
    for name in reasons:
        mask |= THROTTLE_REASONS[name]
    return mask


def _simulate_segfault(message: str) -> None:
    import resource

    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file in the test's directory
    os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(10)  # the signal is delivered asynchronously; never fall through


# --------------------------------------------------------------------------------------------
# The probe (runs in the child)
# --------------------------------------------------------------------------------------------


def _error_reading(nvml: Any, err: BaseException) -> dict[str, Any]:
    return {"error": str(err), "code": getattr(err, "value", None)}


def _read(nvml: Any, fn_name: str, *args: Any, convert: Any = None) -> dict[str, Any]:
    """One NVML call as a reading: ``{"value": ...}`` or ``{"error": str, "code": int}``."""
    fn = getattr(nvml, fn_name, None)
    if fn is None:
        return {
            "error": f"{fn_name} is not in this NVML binding",
            "code": _NVML_ERROR_FUNCTION_NOT_FOUND,
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
        if reading.get("code") != _NVML_ERROR_FUNCTION_NOT_FOUND:
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
        nvml, "nvmlDeviceGetTemperature", handle, _NVML_TEMPERATURE_GPU, convert=int
    )
    if mode == "snapshot":
        return dev
    dev["slowdown_temp_c"] = _read(
        nvml,
        "nvmlDeviceGetTemperatureThreshold",
        handle,
        _NVML_TEMPERATURE_THRESHOLD_SLOWDOWN,
        convert=int,
    )
    dev["ecc_uncorrected"] = _read(
        nvml,
        "nvmlDeviceGetTotalEccErrors",
        handle,
        _NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
        _NVML_VOLATILE_ECC,
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
                nvml, "nvmlDeviceRegisterEvents", handle, _NVML_EVENT_TYPE_XID_CRITICAL, event_set
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
                if getattr(err, "value", None) != _NVML_ERROR_TIMEOUT:
                    for index in [i for i in seen if i is not None]:
                        devices[index]["xid_events"] = _error_reading(nvml, err)
                        del seen[index]
                break
            if int(event.eventType) & _NVML_EVENT_TYPE_XID_CRITICAL:
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
    if mode not in _PROBE_MODES:
        raise ValueError(f"probe mode {mode!r} is unknown; use one of {_PROBE_MODES}")
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
    doc["backend"] = f"fake:{nvml.source}" if isinstance(nvml, FakeNVML) else "pynvml"
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


def _probe_main(mode: str) -> int:
    # Only the JSON document may reach stdout; anything a library prints goes to stderr.
    out = sys.stdout
    sys.stdout = sys.stderr
    doc = probe(mode)
    out.write(json.dumps(doc) + "\n")
    out.flush()
    return 0


# --------------------------------------------------------------------------------------------
# Running the probe (the parent)
# --------------------------------------------------------------------------------------------


class ProbeError(RuntimeError):
    """The probe child hung, crashed or printed something that is not its JSON document."""

    def __init__(self, kind: Literal["hung", "crashed", "bad_output"], message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _tail(text: str) -> str:
    text = text.strip()
    return text if len(text) <= _STDERR_TAIL_CHARS else "..." + text[-_STDERR_TAIL_CHARS:]


def _kill_group(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # the probe leads its own session


def _resolve_fake(fake: str | os.PathLike[str] | None) -> str | None:
    """Validate the fake description up front: a broken fake is a usage error, not a sick GPU."""
    path = fake if fake is not None else os.environ.get(FAKE_NVML_ENV)
    if not path:
        return None
    resolved = str(Path(path).resolve())
    FakeNVML.from_file(resolved)
    return resolved


def run_probe(
    mode: str = "health",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    fake: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Run ``python -m runner.health --probe-json`` and return its document.

    Raises :class:`ProbeError` when the child outlives ``timeout_s`` (it is killed), exits
    non-zero or prints no JSON; ``ValueError`` for a bad ``mode``/``timeout_s``/fake file.
    """
    if mode not in _PROBE_MODES:
        raise ValueError(f"probe mode {mode!r} is unknown; use one of {_PROBE_MODES}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s!r} must be a positive number of seconds, e.g. 20")
    env = dict(os.environ)
    fake_path = _resolve_fake(fake)
    if fake_path:
        env[FAKE_NVML_ENV] = fake_path
    cmd = [sys.executable, "-m", "runner.health", "--probe-json", "--mode", mode]
    # cwd = the directory holding the `runner` package, so the child imports this very code.
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
        _kill_group(proc)
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
            f"stderr tail:\n{_tail(err) or '(empty)'}\nFix: run `python -m runner.health "
            f"--probe-json` by hand on this node to see what else writes to stdout.",
        ) from None
    return doc


# --------------------------------------------------------------------------------------------
# Judging the readings (the parent)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    """One check's outcome. ``device`` is the NVML index, or None for host-level findings."""

    device: int | None
    check: str
    status: Status
    message: str


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

    @property
    def ok(self) -> bool:
        """True when the run may proceed (healthy, warn or no_gpu)."""
        return self.verdict != "unhealthy"

    @property
    def exit_code(self) -> int:
        """The supervisor's exit code for this verdict: HEALTH_EXIT_CODE or 0."""
        return HEALTH_EXIT_CODE if self.verdict == "unhealthy" else 0

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
            "verdict": self.verdict,
            "findings": [asdict(f) for f in self.findings],
            "devices": [asdict(d) for d in self.devices],
            "driver_version": self.driver_version,
            "backend": self.backend,
            "elapsed_s": self.elapsed_s,
        }


def _verdict(findings: Sequence[Finding], no_gpu: bool) -> Verdict:
    worst = max((_STATUS_RANK[f.status] for f in findings), default=0)
    if worst == 2:
        return "unhealthy"
    if worst == 1:
        return "warn"
    return "no_gpu" if no_gpu else "healthy"


def _reading_problem(reading: dict[str, Any], device: int, check: str, what: str) -> Finding | None:
    """A Finding for a failed reading, or None when the reading holds a value."""
    if "error" not in reading:
        return None
    code, err = reading.get("code"), reading["error"]
    if code in (_NVML_ERROR_NOT_SUPPORTED, _NVML_ERROR_FUNCTION_NOT_FOUND):
        return Finding(device, check, "info", f"{what} not supported on this GPU/driver ({err})")
    if code == _NVML_ERROR_NO_PERMISSION:
        return Finding(
            device,
            check,
            "info",
            f"{what} not readable without more privileges ({err}); not checked",
        )
    if code in (_NVML_ERROR_GPU_IS_LOST, _NVML_ERROR_GPU_NOT_FOUND, _NVML_ERROR_RESET_REQUIRED):
        return Finding(
            device,
            check,
            "unhealthy",
            f"reading {what} failed with '{err}' (NVML error {code}): the GPU is gone or needs "
            f"a reset. Fix: drain this node and reset the GPU (`nvidia-smi -r`) or reboot it.",
        )
    return Finding(
        device,
        check,
        "warn",
        f"reading {what} failed with '{err}' (NVML error {code}); not checked. Fix: run "
        f"`nvidia-smi -q` on this node to see whether the driver is healthy.",
    )


def _mib(n_bytes: int | None) -> int | None:
    return None if n_bytes is None else int(n_bytes // _MIB)


def _snapshot(dev: dict[str, Any]) -> DeviceSnapshot:
    mem = dev.get("memory", {}).get("value") or {}
    util = dev.get("utilization", {}).get("value") or {}
    return DeviceSnapshot(
        index=dev["index"],
        name=dev.get("name", {}).get("value"),
        uuid=dev.get("uuid", {}).get("value"),
        util_gpu_pct=util.get("gpu"),
        mem_used_mib=_mib(mem.get("used")),
        mem_total_mib=_mib(mem.get("total")),
        temp_c=dev.get("temperature_c", {}).get("value"),
    )


def _nvml_unavailable(doc: dict[str, Any]) -> Finding:
    nodes = doc.get("device_nodes") or []
    if doc.get("import_error"):
        problem = f"the NVML binding cannot be imported: {doc['import_error']}"
        if nodes:
            # A packaging problem: replacing the node would not fix it, so do not exit 69.
            return Finding(
                None,
                "nvml",
                "warn",
                f"{problem}, yet NVIDIA device nodes exist ({', '.join(nodes)}); the GPU is "
                f"not health-checked. Fix: `pip install nvidia-ml-py`.",
            )
        return Finding(None, "nvml", "info", f"no GPU: {problem}; the run proceeds on CPU")
    err = doc["init_error"]
    if nodes:
        return Finding(
            None,
            "nvml",
            "unhealthy",
            f"NVIDIA device nodes exist ({', '.join(nodes)}) but NVML failed to initialise: "
            f"'{err['error']}' (NVML error {err['code']}); the driver is unusable. Fix: check "
            f"`nvidia-smi` and `dmesg` on this node, reload the driver or replace the node.",
        )
    return Finding(
        None,
        "nvml",
        "info",
        f"no GPU: NVML is unavailable ('{err['error']}'); the run proceeds on CPU",
    )


def _check_temperature(dev: dict[str, Any], index: int, temp_limit_c: float) -> Finding:
    reading = dev["temperature_c"]
    problem = _reading_problem(reading, index, "temperature", "the temperature")
    if problem:
        return problem
    temp = reading["value"]
    limit, source = temp_limit_c, f"temp_limit_c={temp_limit_c:g}"
    slowdown = dev.get("slowdown_temp_c", {}).get("value")
    if slowdown is not None and slowdown < limit:
        limit, source = slowdown, "the GPU's slowdown threshold"
    if temp >= limit:
        return Finding(
            index,
            "temperature",
            "warn",
            f"{temp} °C is at or above {limit:g} °C ({source}); the clocks throttle and "
            f"throughput drops. Fix: check the node's cooling and airflow; raise temp_limit_c "
            f"if this temperature is normal for the card.",
        )
    return Finding(index, "temperature", "ok", f"{temp} °C (limit {limit:g} °C, {source})")


def _check_throttle(dev: dict[str, Any], index: int) -> Finding:
    reading = dev["throttle_reasons"]
    problem = _reading_problem(reading, index, "throttle", "the clock throttle reasons")
    if problem:
        return problem
    mask = reading["value"]
    names = [name for name, bit in THROTTLE_REASONS.items() if mask & bit]
    bad = [name for name in names if name in _THROTTLE_WARN]
    if bad:
        return Finding(
            index,
            "throttle",
            "warn",
            f"clocks throttled by {', '.join(bad)} (reasons 0x{mask:x}): the GPU is too hot or "
            f"its power supply is braking. Fix: check cooling, power cables and the PSU; the "
            f"run continues slower.",
        )
    detail = ", ".join(names) if names else "none"
    return Finding(index, "throttle", "ok", f"throttle reasons: {detail}")


def _check_xids(dev: dict[str, Any], index: int) -> Finding:
    reading = dev.get("xid_events", {"value": []})
    if "error" in reading:
        problem = _reading_problem(reading, index, "xid", "XID events")
        assert problem is not None
        if problem.status == "info":
            return Finding(
                index,
                "xid",
                "info",
                f"XID events are not available here ({reading['error']}); XIDs are not "
                f"checked (see `dmesg | grep -i xid`)",
            )
        return problem
    xids = reading["value"]
    critical = [x for x in xids if x in CRITICAL_XIDS]
    if critical:
        what = "; ".join(f"XID {x} ({CRITICAL_XIDS[x]})" for x in critical)
        others = [x for x in xids if x not in CRITICAL_XIDS]
        also = f" (also XID {others})" if others else ""
        return Finding(
            index,
            "xid",
            "unhealthy",
            f"critical XID event(s): {what}{also}. Fix: drain this node and reset the GPU, or "
            f"replace the node if it recurs.",
        )
    if xids:
        return Finding(
            index,
            "xid",
            "warn",
            f"XID event(s) {xids} (not on the hardware-fault list; often a program fault). "
            f"Fix: look them up in NVIDIA's XID catalogue and check `dmesg`.",
        )
    return Finding(index, "xid", "ok", f"no XID events while listening for {XID_WAIT_MS} ms")


def _describe_procs(procs: Sequence[dict[str, Any]]) -> str:
    parts = []
    for p in procs:
        used = _mib(p.get("used_bytes"))
        mem = "memory n/a" if used is None else f"{used} MiB"
        label = f"{p['label']}, " if p.get("label") else ""
        parts.append(f"pid {p['pid']} ({label}{mem})")
    return ", ".join(parts)


def _check_processes(
    dev: dict[str, Any], index: int, allowed: set[int], allow_foreign: bool
) -> Finding:
    reading = dev["processes"]
    problem = _reading_problem(reading, index, "processes", "the compute processes")
    if problem:
        return problem
    procs = reading["value"]
    foreign = [p for p in procs if p["pid"] not in allowed]
    mine = [p for p in procs if p["pid"] in allowed]
    if foreign and not allow_foreign:
        pids = " ".join(str(p["pid"]) for p in foreign)
        return Finding(
            index,
            "processes",
            "unhealthy",
            f"{len(foreign)} foreign compute process(es) hold the GPU: {_describe_procs(foreign)}."
            f" Fix: stop them (`kill {pids}`) or wait for the previous worker to exit; pass "
            f"allow_foreign_processes=True to share the GPU on purpose.",
        )
    if foreign:
        return Finding(
            index,
            "processes",
            "info",
            f"sharing the GPU with foreign process(es) (allowed): {_describe_procs(foreign)}",
        )
    if mine:
        return Finding(
            index, "processes", "ok", f"held only by allowed process(es): {_describe_procs(mine)}"
        )
    return Finding(index, "processes", "ok", "no compute processes")


def _check_memory(dev: dict[str, Any], index: int, min_free_mem_mib: int) -> Finding:
    reading = dev["memory"]
    problem = _reading_problem(reading, index, "memory", "the memory info")
    if problem:
        return problem
    total, free = _mib(reading["value"]["total"]), _mib(reading["value"]["free"])
    if free < min_free_mem_mib:
        return Finding(
            index,
            "memory",
            "unhealthy",
            f"only {free} MiB free of {total} MiB, below min_free_mem_mib={min_free_mem_mib}. "
            f"Fix: stop whatever holds the memory (see the processes check and `nvidia-smi`), "
            f"or lower min_free_mem_mib.",
        )
    return Finding(index, "memory", "ok", f"{free} MiB free of {total} MiB")


def _check_ecc(dev: dict[str, Any], index: int) -> Finding:
    reading = dev["ecc_uncorrected"]
    problem = _reading_problem(reading, index, "ecc", "the uncorrected ECC count")
    if problem:
        return problem
    count = reading["value"]
    if count > 0:
        return Finding(
            index,
            "ecc",
            "unhealthy",
            f"{count} uncorrected ECC error(s) since the driver loaded (volatile aggregate); "
            f"results computed on this GPU cannot be trusted. Fix: drain this node and reset "
            f"the GPU (`nvidia-smi -r`); replace it if the errors return.",
        )
    return Finding(index, "ecc", "ok", "0 uncorrected ECC errors")


def _check_memory_repair(dev: dict[str, Any], index: int) -> list[Finding]:
    """Retired pages (pre-Ampere) and remapped rows (Ampere+): either API may be NotSupported."""
    findings = []
    pages = dev["retired_pages_pending"]
    problem = _reading_problem(pages, index, "retired_pages", "the retired-pages status")
    if problem:
        findings.append(problem)
    elif pages["value"]:
        findings.append(
            Finding(
                index,
                "retired_pages",
                "unhealthy",
                "memory pages are pending retirement; they take effect only after a GPU reset. "
                "Fix: drain this node and reset the GPU (`nvidia-smi -r`) or reboot it.",
            )
        )
    else:
        findings.append(Finding(index, "retired_pages", "ok", "no retired pages pending"))
    rows = dev["remapped_rows"]
    problem = _reading_problem(rows, index, "remapped_rows", "the remapped-rows status")
    if problem:
        findings.append(problem)
    elif rows["value"]["failure"]:
        findings.append(
            Finding(
                index,
                "remapped_rows",
                "unhealthy",
                f"row remapping failed (uncorrectable remapped rows: "
                f"{rows['value']['uncorrectable']}): the memory has run out of spare rows. "
                f"Fix: replace this GPU.",
            )
        )
    elif rows["value"]["pending"]:
        findings.append(
            Finding(
                index,
                "remapped_rows",
                "unhealthy",
                "a memory row remap is pending; it takes effect only after a GPU reset. "
                "Fix: drain this node and reset the GPU (`nvidia-smi -r`) or reboot it.",
            )
        )
    else:
        v = rows["value"]
        findings.append(
            Finding(
                index,
                "remapped_rows",
                "ok",
                f"no remap pending ({v['correctable']} correctable, "
                f"{v['uncorrectable']} uncorrectable rows remapped)",
            )
        )
    return findings


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
        verdict="healthy",
        driver_version=doc.get("driver_version"),
        backend=doc.get("backend"),
        elapsed_s=doc.get("elapsed_s"),
    )
    findings = report.findings
    if doc.get("import_error") or doc.get("init_error"):
        findings.append(_nvml_unavailable(doc))
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
        findings.append(_check_ecc(dev, index))
        findings.extend(_check_memory_repair(dev, index))
        findings.append(_check_temperature(dev, index, temp_limit_c))
        findings.append(_check_throttle(dev, index))
        findings.append(_check_xids(dev, index))
        findings.append(_check_processes(dev, index, allowed, allow_foreign_processes))
        findings.append(_check_memory(dev, index, min_free_mem_mib))
    report.verdict = _verdict(findings, no_gpu=False)
    return report


# --------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------


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

    Unhealthy (exit :data:`HEALTH_EXIT_CODE`): the probe hung past ``timeout_s`` or crashed;
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
            verdict="unhealthy", findings=[Finding(None, "probe", "unhealthy", str(err))]
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


# --------------------------------------------------------------------------------------------
# Command line: the probe child, and a human check (`python -m runner.health`)
# --------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m runner.health",
        description="Check the GPUs; exit 69 when a GPU is unhealthy.",
    )
    parser.add_argument("--probe-json", action="store_true", help="(internal) the probe child")
    parser.add_argument("--mode", choices=_PROBE_MODES, default="health", help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S")
    parser.add_argument("--min-free-mib", type=int, default=DEFAULT_MIN_FREE_MEM_MIB)
    parser.add_argument("--temp-limit", type=float, default=DEFAULT_TEMP_LIMIT_C, metavar="C")
    parser.add_argument("--allow-pid", type=int, action="append", default=[], metavar="PID")
    parser.add_argument("--allow-foreign-processes", action="store_true")
    parser.add_argument("--fake", metavar="JSON", help="a FakeNVML description instead of NVML")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if args.probe_json:
        return _probe_main(args.mode)
    report = check_gpu_health(
        timeout_s=args.timeout,
        min_free_mem_mib=args.min_free_mib,
        allowed_pids=args.allow_pid,
        allow_foreign_processes=args.allow_foreign_processes,
        temp_limit_c=args.temp_limit,
        fake=args.fake,
    )
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.summary())
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
