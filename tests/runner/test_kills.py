"""A SIGKILL named from the evidence (runner.kills.ExitWitness), on real processes: the
out-of-memory killer in a memory-limited cgroup, a SIGKILL sent by another process, and, where
neither the kernel's log nor the cgroup can be read, the likeliest cause with the peak RSS. The
smoke test reports its child's SIGKILL so."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from m3run.runner.kills import CGROUP_ROOT, ExitWitness
from m3run.runner.supervisor.preflight import SmokeTest

# The child holds this much resident memory, then says so on its stdout.
HOLD_MIB = 96
HOLDER = (
    f"b = bytearray({HOLD_MIB} << 20)\n"
    "b[::4096] = b'x' * len(b[::4096])\n"
    "print('held', flush=True)\n"
    "import sys; sys.stdin.read()\n"
)


def _holder() -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", HOLDER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _kill_when_held(child: subprocess.Popen, witness: ExitWitness) -> int:
    assert child.stdout.readline() == "held\n"
    witness.sample()
    child.send_signal(signal.SIGKILL)
    return child.wait()


def test_an_unexplained_sigkill_is_named_as_the_likeliest_oom_with_its_peak_rss(tmp_path):
    child = _holder()
    # Neither the kernel's log nor a memory cgroup can be read here: the fallback.
    witness = ExitWitness(child.pid, cgroup_root=tmp_path, kmsg=tmp_path / "no-kmsg")
    code = _kill_when_held(child, witness)
    how = witness.describe(code)
    prefix = "killed by SIGKILL: most often the out-of-memory killer; peak RSS at least "
    assert how.startswith(prefix), how
    assert int(how.removeprefix(prefix).split(" MiB")[0]) >= HOLD_MIB
    assert "this machine's memory" in how and "Fix: a smaller train.micro_batch_size" in how


def test_other_exits_are_described_as_before(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    witness = ExitWitness(child.pid, cgroup_root=tmp_path, kmsg=tmp_path / "no-kmsg")
    assert witness.describe(child.wait()) == "exit 3"


def _memory_cgroup_dir() -> Path | None:
    """This process's cgroup v1 memory folder when it can hold a child cgroup (root), else None."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            folder = CGROUP_ROOT / "memory" / path.lstrip("/")
            if (folder / "memory.oom_control").is_file() and os.access(folder, os.W_OK):
                return folder
    return None


def test_a_sigkill_sent_by_another_process_is_not_blamed_on_memory():
    folder = _memory_cgroup_dir()
    if folder is None:
        pytest.skip("no readable cgroup v1 memory controller for this process")
    child = _holder()
    witness = ExitWitness(child.pid)
    how = witness.describe(_kill_when_held(child, witness))
    assert how.startswith("killed by SIGKILL, not by the out-of-memory killer"), how
    assert "another process sent it; peak RSS at least" in how and "Fix" not in how


def test_the_oom_killer_is_named_when_a_cgroup_limit_kills_the_child(tmp_path):
    parent = _memory_cgroup_dir()
    if parent is None:
        pytest.skip("needs root and a cgroup v1 memory controller to make a limited cgroup")
    group = parent / f"m3run-test-{os.getpid()}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(48 << 20))
        procs = group / "cgroup.procs"
        results = []
        for kmsg in (Path("/dev/kmsg"), tmp_path / "no-kmsg"):
            child = subprocess.Popen(
                [sys.executable, "-c", HOLDER],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                # Joins the limited cgroup before it runs Python: its allocation meets the limit.
                preexec_fn=lambda: procs.write_text(str(os.getpid())),
            )
            witness = ExitWitness(child.pid, kmsg=kmsg)
            code = child.wait()
            assert code == -signal.SIGKILL, code
            results.append(witness.describe(code))
        kernel, counted = results
        assert counted.startswith("killed by the out-of-memory killer (SIGKILL; the memory "), (
            counted
        )
        assert "oom_kill count rose" in counted and "(the memory cgroup's limit)" in counted
        # The kernel's record names the process where /dev/kmsg is readable.
        if os.access("/dev/kmsg", os.R_OK):
            assert kernel.startswith("killed by the out-of-memory killer (SIGKILL; the kernel"), (
                kernel
            )
            assert "Killed process" in kernel
    finally:
        group.rmdir()


def test_the_smoke_test_names_a_sigkill_instead_of_a_bare_exit_code(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    killed = []

    def kill_the_smoke_process(**_state) -> None:  # tick: the state to record (ignored)
        # The first poll while the child lives: it is still importing torch.
        if killed:
            return
        for proc in psutil.Process().children(recursive=True):
            if "m3run.runner.worker.smoke" in proc.cmdline():
                proc.send_signal(signal.SIGKILL)
                killed.append(proc.pid)

    verdict = SmokeTest(tmp_path / "config.yaml").run(
        run_dir,
        dict(os.environ),
        timeout_s=300,
        poll_s=0.05,
        echo=lambda line: None,
        tick=kill_the_smoke_process,
        stop_requested=lambda: False,
    )
    assert killed and not verdict.ok
    message = verdict.message
    assert message.startswith("the smoke process ended without a verdict (killed by SIGKILL"), (
        message
    )
    assert "out-of-memory killer" in message and "peak RSS" in message
