"""NVML's ABI values and names, shared by the probe child, its fake and the checks. Torch-free.

The probe passes these to whichever backend `m3run.runner.health.probe.load_nvml` returned: the real
``pynvml`` or, when ``M3RUN_FAKE_NVML`` names a JSON file, `m3run.runner.health.fake_nvml.FakeNVML`.
"""

from __future__ import annotations

FAKE_NVML_ENV = "M3RUN_FAKE_NVML"

# NVML ABI values from nvml.h; the probe passes them to whichever backend load_nvml() returned.
NVML_TEMPERATURE_GPU = 0
NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 1
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_EVENT_TYPE_XID_CRITICAL = 0x8
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_GPU_NOT_FOUND = 28

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

MIB = 1024 * 1024


def mib(n_bytes: int | None) -> int | None:
    """Bytes as whole MiB (rounded down); None stays None."""
    return None if n_bytes is None else int(n_bytes // MIB)
