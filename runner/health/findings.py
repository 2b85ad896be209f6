"""One function per check: a device's probe readings in, a :class:`Finding` out. Torch-free.

`m3run.runner.health.checks.evaluate` runs them over every wanted device and folds their
statuses into the verdict.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from m3run.runner.health.nvml import (
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_GPU_NOT_FOUND,
    NVML_ERROR_NO_PERMISSION,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_RESET_REQUIRED,
    THROTTLE_REASONS,
    mib,
)
from m3run.runner.health.probe import XID_WAIT_MS

__all__ = ["CRITICAL_XIDS", "Finding", "Status", "device_findings", "nvml_unavailable"]

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

Status = Literal["ok", "info", "warn", "unhealthy"]

# The ones that mean heat or a power fault; sw_power_cap and gpu_idle are routine under load.
_THROTTLE_WARN = ("hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake")


@dataclass(frozen=True)
class Finding:
    """One check's outcome. ``device`` is the NVML index, or None for host-level findings."""

    device: int | None
    check: str
    status: Status
    message: str


def _reading_problem(reading: dict[str, Any], device: int, check: str, what: str) -> Finding | None:
    """A Finding for a failed reading, or None when the reading holds a value."""
    if "error" not in reading:
        return None
    code, err = reading.get("code"), reading["error"]
    if code in (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND):
        return Finding(device, check, "info", f"{what} not supported on this GPU/driver ({err})")
    if code == NVML_ERROR_NO_PERMISSION:
        return Finding(
            device,
            check,
            "info",
            f"{what} not readable without more privileges ({err}); not checked",
        )
    if code in (NVML_ERROR_GPU_IS_LOST, NVML_ERROR_GPU_NOT_FOUND, NVML_ERROR_RESET_REQUIRED):
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


def nvml_unavailable(doc: dict[str, Any]) -> Finding:
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
        return Finding(None, "nvml", "info", f"no GPU: {problem}")
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
        f"no GPU: NVML is unavailable ('{err['error']}')",
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
        used = mib(p.get("used_bytes"))
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
    total, free = mib(reading["value"]["total"]), mib(reading["value"]["free"])
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


def device_findings(
    dev: dict[str, Any],
    index: int,
    *,
    allowed_pids: set[int],
    allow_foreign_processes: bool,
    temp_limit_c: float,
    min_free_mem_mib: int,
) -> list[Finding]:
    """Every check of one opened device, in the order the report lists them."""
    return [
        _check_ecc(dev, index),
        *_check_memory_repair(dev, index),
        _check_temperature(dev, index, temp_limit_c),
        _check_throttle(dev, index),
        _check_xids(dev, index),
        _check_processes(dev, index, allowed_pids, allow_foreign_processes),
        _check_memory(dev, index, min_free_mem_mib),
    ]
