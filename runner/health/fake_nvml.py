"""FakeNVML: an NVML stand-in driven by a JSON description, for tests and demos. Torch-free.

Imported only when a fake is asked for (``M3RUN_FAKE_NVML`` or a ``fake=`` path): it answers the
same function names as ``pynvml`` from a description of devices (faults, NotSupported errors,
hangs and crashes included), so the probe code CPU tests run is the production code.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from m3run.runner.health.nvml import (
    FAKE_NVML_ENV,
    MIB,
    NVML_EVENT_TYPE_XID_CRITICAL,
    NVML_TEMPERATURE_THRESHOLD_SLOWDOWN,
    THROTTLE_REASONS,
)

__all__ = ["FakeNVML"]

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
        total = int(dev["memory_total_mib"]) * MIB
        used_mib = dev["memory_used_mib"]
        if used_mib is None:
            used_mib = sum(p.get("used_mib") or 0 for p in dev["processes"])
        used = min(int(used_mib * MIB), total)
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetUtilizationRates(self, handle: _FakeHandle) -> Any:
        dev = self._enter("nvmlDeviceGetUtilizationRates", handle)
        return SimpleNamespace(gpu=dev["utilization_gpu"], memory=dev["utilization_memory"])

    def nvmlDeviceGetTemperature(self, handle: _FakeHandle, sensor: int) -> int:
        return int(self._enter("nvmlDeviceGetTemperature", handle)["temperature_c"])

    def nvmlDeviceGetTemperatureThreshold(self, handle: _FakeHandle, threshold: int) -> int:
        dev = self._enter("nvmlDeviceGetTemperatureThreshold", handle)
        if threshold != NVML_TEMPERATURE_THRESHOLD_SLOWDOWN or dev["slowdown_temp_c"] is None:
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
                usedGpuMemory=None if p.get("used_mib") is None else int(p["used_mib"] * MIB),
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
        if event_types & NVML_EVENT_TYPE_XID_CRITICAL:
            event_set.append(handle.index)

    def nvmlEventSetWait(self, event_set: list[int], timeout_ms: int) -> Any:
        self._enter("nvmlEventSetWait")
        for index in event_set:
            if self._pending_xids[index]:
                xid = self._pending_xids[index].pop(0)
                return SimpleNamespace(
                    device=_FakeHandle(index),
                    eventType=NVML_EVENT_TYPE_XID_CRITICAL,
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
