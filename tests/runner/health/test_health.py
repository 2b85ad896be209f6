"""The GPU health gate, end to end: every check runs the real probe child
(`python -m m3run.runner.health --probe-json`), against the FakeNVML description each test writes,
or against the real pynvml of this machine."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from m3run.runner.health.checks import (
    HealthReport,
    check_gpu_health,
    gpu_snapshot,
    process_gpu_memory,
    wait_gpu_memory_released,
)
from m3run.runner.health.nvml import FAKE_NVML_ENV
from m3run.runner.health.probe import ProbeError
from m3run.runner.protocol import EXIT_UNAVAILABLE

MIB = 1024 * 1024
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def _no_inherited_fake(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAKE_NVML_ENV, raising=False)


@pytest.fixture
def fake(tmp_path: Path):
    """fake(spec) -> path of a FakeNVML description; rewriting is atomic (the child may read)."""
    path = tmp_path / "nvml.json"

    def write(spec: dict[str, Any]) -> Path:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(spec))
        os.replace(tmp, path)
        return path

    return write


def check(path: Path, **kwargs: Any) -> HealthReport:
    report = check_gpu_health(fake=path, **kwargs)
    json.dumps(report.to_dict())  # always serialisable, whatever the verdict
    return report


def by_check(report: HealthReport, name: str, device: int | None = 0):
    found = [f for f in report.findings if f.check == name and f.device == device]
    assert len(found) == 1, report.summary(verbose=True)
    return found[0]


def test_healthy_gpus(fake) -> None:
    report = check(fake({"driver_version": "560.35.03", "devices": [{}, {"temperature_c": 41}]}))
    assert report.verdict == "healthy", report.summary(verbose=True)
    assert report.ok and report.exit_code == 0
    assert [d.index for d in report.devices] == [0, 1]
    assert report.devices[1].temp_c == 41
    assert report.driver_version == "560.35.03"
    checks = {f.check for f in report.findings if f.device == 1}
    assert checks == {
        "ecc",
        "retired_pages",
        "remapped_rows",
        "temperature",
        "throttle",
        "xid",
        "processes",
        "memory",
    }
    assert all(f.status == "ok" for f in report.findings)
    text = report.summary()
    assert text.startswith("GPU health: healthy - 2 GPU(s), driver 560.35.03")
    assert "GPU 1 Fake NVIDIA H200: ok (41 °C" in text


def test_zero_devices_is_no_gpu(fake) -> None:
    report = check(fake({"devices": []}))
    assert report.verdict == "no_gpu"
    assert report.ok and report.exit_code == 0
    assert "0 devices" in report.summary()


def test_missing_nvml_library_is_no_gpu_but_a_broken_driver_is_not(fake) -> None:
    missing = check(fake({"errors": {"nvmlInit": "LIBRARY_NOT_FOUND"}}))
    assert missing.verdict == "no_gpu"
    assert "no GPU: NVML is unavailable" in by_check(missing, "nvml", None).message

    broken = check(
        fake({"errors": {"nvmlInit": "DRIVER_NOT_LOADED"}, "device_nodes": ["/dev/nvidia0"]})
    )
    assert broken.verdict == "unhealthy"
    msg = by_check(broken, "nvml", None).message
    assert "/dev/nvidia0" in msg and "Driver Not Loaded" in msg and "Fix:" in msg


def test_real_nvml_on_this_machine_never_crashes_the_gate() -> None:
    report = check_gpu_health(timeout_s=20)
    assert not [f for f in report.findings if f.check == "probe"], report.summary()
    if not glob.glob("/dev/nvidia[0-9]*"):
        assert report.verdict == "no_gpu", report.summary()
        assert report.exit_code == 0


def test_uncorrected_ecc_is_unhealthy(fake) -> None:
    report = check(fake({"devices": [{}, {"ecc_uncorrected": 3}]}))
    assert report.verdict == "unhealthy"
    assert report.exit_code == EXIT_UNAVAILABLE
    finding = by_check(report, "ecc", 1)
    assert finding.status == "unhealthy"
    assert "3 uncorrected ECC error(s)" in finding.message and "Fix:" in finding.message
    assert by_check(report, "ecc", 0).status == "ok"


def test_retired_pages_pending_is_unhealthy(fake) -> None:
    report = check(fake({"devices": [{"retired_pages_pending": True}]}))
    assert report.verdict == "unhealthy"
    assert "pending retirement" in by_check(report, "retired_pages").message


@pytest.mark.parametrize(
    ("rows", "words"),
    [
        ({"uncorrectable": 9, "failure": True}, "row remapping failed"),
        ({"uncorrectable": 1, "pending": True}, "row remap is pending"),
    ],
    ids=["failure", "pending"],
)
def test_remapped_rows_failure_or_pending_is_unhealthy(fake, rows, words) -> None:
    report = check(fake({"devices": [{"remapped_rows": rows}]}))
    assert report.verdict == "unhealthy"
    finding = by_check(report, "remapped_rows")
    assert finding.status == "unhealthy" and words in finding.message


def test_not_supported_memory_repair_apis_are_notes_not_failures(fake) -> None:
    errors = {
        "nvmlDeviceGetRetiredPagesPendingStatus": "NOT_SUPPORTED",
        "nvmlDeviceGetRemappedRows": "NOT_SUPPORTED",
        "nvmlDeviceGetTotalEccErrors": "NOT_SUPPORTED",
    }
    report = check(fake({"devices": [{"errors": errors}]}))
    assert report.verdict == "healthy", report.summary(verbose=True)
    for name in ("retired_pages", "remapped_rows", "ecc"):
        finding = by_check(report, name)
        assert finding.status == "info" and "not supported" in finding.message


def test_hot_and_throttled_is_a_warning_naming_the_reasons(fake) -> None:
    spec = {"temperature_c": 93, "throttle_reasons": ["hw_slowdown", "hw_thermal", "sw_power_cap"]}
    report = check(fake({"devices": [spec]}))
    assert report.verdict == "warn"
    assert report.ok and report.exit_code == 0
    temp = by_check(report, "temperature")
    assert temp.status == "warn" and "93 °C" in temp.message and "90 °C" in temp.message
    throttle = by_check(report, "throttle")
    assert throttle.status == "warn"
    assert "hw_slowdown, hw_thermal" in throttle.message
    assert "sw_power_cap" not in throttle.message


def test_nvml_slowdown_threshold_below_the_limit_is_used(fake) -> None:
    report = check(fake({"devices": [{"temperature_c": 85, "slowdown_temp_c": 84}]}))
    assert report.verdict == "warn"
    assert "slowdown threshold" in by_check(report, "temperature").message
    cool = check(fake({"devices": [{"temperature_c": 85}]}), temp_limit_c=86)
    assert cool.verdict == "healthy"


def test_power_capping_alone_is_fine(fake) -> None:
    report = check(fake({"devices": [{"throttle_reasons": ["sw_power_cap", "gpu_idle"]}]}))
    assert report.verdict == "healthy"


def test_critical_xid_is_unhealthy(fake) -> None:
    report = check(fake({"devices": [{}, {"xid_events": [13, 79]}]}))
    assert report.verdict == "unhealthy"
    finding = by_check(report, "xid", 1)
    assert "XID 79 (GPU has fallen off the bus)" in finding.message
    assert "13" in finding.message
    assert by_check(report, "xid", 0).status == "ok"


def test_non_critical_xid_warns_and_unsupported_events_are_a_note(fake) -> None:
    assert check(fake({"devices": [{"xid_events": [13]}]})).verdict == "warn"
    report = check(fake({"devices": [{"errors": {"nvmlDeviceRegisterEvents": "NOT_SUPPORTED"}}]}))
    assert report.verdict == "healthy"
    assert by_check(report, "xid").status == "info"


def test_foreign_process_is_unhealthy_and_named(fake) -> None:
    path = fake({"devices": [{"processes": [{"pid": 4242, "used_mib": 1234}]}]})
    report = check(path)
    assert report.verdict == "unhealthy"
    finding = by_check(report, "processes")
    assert "pid 4242" in finding.message and "1234 MiB" in finding.message
    assert "kill 4242" in finding.message

    assert check(path, allowed_pids=[4242]).verdict == "healthy"
    shared = check(path, allow_foreign_processes=True)
    assert shared.verdict == "healthy"
    assert by_check(shared, "processes").status == "info"


def test_only_the_foreign_pid_is_named(fake) -> None:
    procs = [{"pid": 111, "used_mib": 10}, {"pid": 222, "used_mib": None}]
    report = check(fake({"devices": [{"processes": procs}]}), allowed_pids=(111,))
    message = by_check(report, "processes").message
    assert report.verdict == "unhealthy"
    assert "pid 222" in message and "memory n/a" in message and "pid 111" not in message


def test_low_free_memory_is_unhealthy(fake) -> None:
    path = fake({"devices": [{"memory_total_mib": 81920, "memory_used_mib": 80000}]})
    report = check(path, min_free_mem_mib=4096)
    assert report.verdict == "unhealthy"
    finding = by_check(report, "memory")
    assert "1920 MiB free of 81920 MiB" in finding.message
    assert "min_free_mem_mib=4096" in finding.message
    assert check(path, min_free_mem_mib=1024).verdict == "healthy"


def test_lost_gpu_and_missing_gpus_are_unhealthy(fake) -> None:
    lost = check(fake({"devices": [{}, {"errors": {"nvmlDeviceGetHandleByIndex": "GPU_IS_LOST"}}]}))
    assert lost.verdict == "unhealthy"
    assert "GPU is lost" in by_check(lost, "device", 1).message

    path = fake({"devices": [{}]})
    short = check(path, expected_count=2)
    assert short.verdict == "unhealthy"
    assert "expected_count=2" in by_check(short, "count", None).message
    assert check(path, devices=[3]).verdict == "unhealthy"
    assert check(path, devices=[0], expected_count=1).verdict == "healthy"


@pytest.mark.parametrize("hang", [True, "nvmlDeviceGetRemappedRows"], ids=["init", "mid-probe"])
def test_hanging_nvml_is_unhealthy_within_the_timeout(fake, hang) -> None:
    path = fake({"hang": hang, "devices": [{}]})
    start = time.monotonic()
    report = check_gpu_health(timeout_s=2, fake=path)
    elapsed = time.monotonic() - start
    assert 2 <= elapsed < 4.5
    assert report.verdict == "unhealthy"
    assert report.exit_code == EXIT_UNAVAILABLE
    assert "NVML probe hung for 2 s" in by_check(report, "probe", None).message


def test_crashing_probe_is_unhealthy_with_the_stderr_tail(fake) -> None:
    report = check(fake({"crash": "nvmlDeviceGetCount", "devices": [{}]}))
    assert report.verdict == "unhealthy"
    message = by_check(report, "probe", None).message
    assert "killed by SIGSEGV" in message
    assert "simulated driver crash in nvmlDeviceGetCount" in message


def test_a_broken_fake_description_is_a_usage_error_naming_the_key(fake, tmp_path) -> None:
    with pytest.raises(ValueError, match=r"device 0 has unknown key\(s\) \['temp'\]"):
        check_gpu_health(fake=fake({"devices": [{"temp": 95}]}))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_gpu_health(fake=tmp_path / "nope.json")
    with pytest.raises(ValueError, match="timeout_s=0 must be a positive"):
        check_gpu_health(timeout_s=0, fake=fake({}))


def test_fake_is_inherited_through_the_environment(fake, monkeypatch) -> None:
    monkeypatch.setenv(FAKE_NVML_ENV, str(fake({"devices": [{"ecc_uncorrected": 1}]})))
    assert check_gpu_health().verdict == "unhealthy"


def test_command_line_exit_code_and_json(fake) -> None:
    path = fake({"devices": [{"retired_pages_pending": True}]})
    cmd = [sys.executable, "-m", "m3run.runner.health", "--fake", str(path), "--json"]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=30)
    assert run.returncode == EXIT_UNAVAILABLE, run.stderr
    assert json.loads(run.stdout)["verdict"] == "unhealthy"


def test_gpu_snapshot(fake) -> None:
    spec = {
        "memory_total_mib": 81920,
        "memory_used_mib": 20480,
        "utilization_gpu": 97,
        "temperature_c": 71,
    }
    [snap] = gpu_snapshot(fake=fake({"devices": [spec]}))
    assert (snap.index, snap.util_gpu_pct, snap.temp_c) == (0, 97, 71)
    assert (snap.mem_used_mib, snap.mem_total_mib) == (20480, 81920)
    assert gpu_snapshot(fake=fake({"devices": []})) == []
    with pytest.raises(ProbeError, match="hung for 1 s"):
        gpu_snapshot(timeout_s=1, fake=fake({"hang": True}))


def test_process_gpu_memory_counts_the_pid_and_its_children(fake) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        me = os.getpid()
        procs = [
            {"pid": me, "used_mib": 1000},
            {"pid": child.pid, "used_mib": 500},
            {"pid": 999_999, "used_mib": 7},
        ]
        path = fake(
            {"devices": [{"processes": procs}, {"processes": [{"pid": me, "used_mib": 24}]}]}
        )
        assert process_gpu_memory(me, include_children=True, fake=path) == 1524 * MIB
        assert process_gpu_memory(me, fake=path) == 1024 * MIB
        assert process_gpu_memory(child.pid, fake=path) == 500 * MIB
    finally:
        child.kill()
        child.wait()
    unknown = fake({"devices": [{"processes": [{"pid": 77, "used_mib": None}]}]})
    assert process_gpu_memory(77, fake=unknown) is None
    assert process_gpu_memory(78, fake=unknown) == 0
    assert process_gpu_memory(77, fake=fake({"devices": []})) is None
    no_list = {"errors": {"nvmlDeviceGetComputeRunningProcesses": "NOT_SUPPORTED"}}
    assert process_gpu_memory(77, fake=fake({"devices": [no_list]})) is None


def test_wait_gpu_memory_released(fake) -> None:
    held = {"devices": [{"processes": [{"pid": 4242, "used_mib": 100}]}]}
    path = fake(held)
    start = time.monotonic()
    assert wait_gpu_memory_released([4242], timeout_s=1.0, poll_s=0.2, fake=path) is False
    assert time.monotonic() - start < 2.5

    releaser = threading.Timer(0.5, fake, args=({"devices": [{}]},))
    releaser.start()
    try:
        assert wait_gpu_memory_released([4242], timeout_s=10, poll_s=0.1, fake=path) is True
    finally:
        releaser.cancel()
    assert wait_gpu_memory_released([4242], timeout_s=5, fake=fake({"devices": []})) is True
