"""Process mechanics: spawn a child in its own session with its output in a log, signal its
group, terminate-then-kill, tell a live pid from a reused one, follow a log, and a child's quick
exit. Torch-free.

Every child m3run starts (the worker, torchrun, the smoke test, the NVML probe, a detached
supervisor) leads its own session, so one killpg reaches it and everything it started (ranks,
data-loader processes) and nothing else.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import psutil

from m3run.runner.files import lock_holder, open_append

# psutil's create time is the clock ticks since boot plus the boot time of /proc/stat, whole
# seconds that the kernel derives from the wall clock: when the clock is adjusted (NTP), two
# processes reading it can see boot times a second apart, so the same process's create time
# differs by a second. A reused pid matching within this tolerance would have to be born
# within it of the process it replaces.
_CREATE_TIME_TOLERANCE_S = 1.5


def create_time(pid: int) -> float | None:
    """The process's start time (seconds since the epoch), None if it is gone or hidden."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def process_matches(pid: Any, recorded_create_time: Any) -> bool:
    """True if `pid` is alive and is the process that recorded `recorded_create_time` (not a
    reused pid)."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        actual = proc.create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    if not isinstance(recorded_create_time, (int, float)):
        return True  # nothing recorded to compare against: alive is the best we know
    return abs(actual - recorded_create_time) <= _CREATE_TIME_TOLERANCE_S


def born_as_recorded(pid: Any, recorded_create_time: Any) -> bool:
    """True only if `pid` is alive and was born at `recorded_create_time`, which must be
    recorded: a pid read from a file without its create time proves nothing."""
    if not isinstance(recorded_create_time, (int, float)) or isinstance(recorded_create_time, bool):
        return False
    return process_matches(pid, recorded_create_time)


def owns_lock(pid: Any, recorded_create_time: Any, lock_path: Path) -> bool:
    """True only if `pid` is alive, was born at `recorded_create_time` (which must be
    recorded), and holds the flock on `lock_path` (m3run's supervisor.lock or worker.lock of
    that run dir). A pid read from a file is signalled only when this holds: a forged or stale
    state.json never gets an unrelated process killed."""
    return born_as_recorded(pid, recorded_create_time) and lock_holder(lock_path) == pid


def runs_m3run(pid: int) -> bool:
    """True if the process's command line is m3run's: the `m3run` script, or a module of the
    m3run package (`-m m3run.runner.cli`, the supervisor's, the worker's, torchrun's rank
    module). What names a run's process when its lock file is gone and cannot."""
    try:
        argv = psutil.Process(pid).cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    return any(a.startswith("m3run.") or os.path.basename(a) == "m3run" for a in argv)


def signal_group_of(pid: int, sig: int) -> None:
    """Signal the process group `pid` belongs to (the session its supervisor started it in),
    or `pid` alone if that group is this process's own."""
    try:
        pgid = os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return
    if pgid == os.getpgrp():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
        return
    signal_group(pgid, sig)


def signal_group(pid: int, sig: int) -> None:
    """Signal the process group `pid` leads; a group already gone is not an error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def terminate_then_kill(
    pid: int, grace_s: float, alive: Callable[[], bool], poll_s: float = 0.1
) -> bool:
    """SIGTERM the group `pid` belongs to, wait up to `grace_s` while `alive()`, then SIGKILL
    it if it is still alive. Returns True if it exited within the grace."""
    signal_group_of(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and alive():
        time.sleep(poll_s)
    if not alive():
        return True
    signal_group_of(pid, signal.SIGKILL)
    return False


def append_header(log_path: Path, header: str) -> int:
    """Append a `--- header` line to `log_path`; returns the offset after it, where the output
    it introduces starts."""
    with open_append(log_path, binary=True) as log_file:
        log_file.write(f"--- {header}\n".encode())
        return log_file.tell()


def spawn_logged(
    argv: Sequence[str],
    log_path: Path,
    env: dict[str, str] | None = None,
    header: str | None = None,
    stdin: int = subprocess.DEVNULL,
    pass_fds: Sequence[int] = (),
) -> tuple[subprocess.Popen, int]:
    """Start `argv` in a new session, stdin closed (or `subprocess.PIPE`), stdout and stderr
    appended to `log_path` (after a `--- header` line when given), no descriptor of ours open in
    it but `pass_fds`. Returns the process and the log offset at which its output starts."""
    if header is not None:
        append_header(log_path, header)
    with open_append(log_path, binary=True) as log_file:
        offset = log_file.tell()
        proc = subprocess.Popen(
            list(argv),
            stdin=stdin,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            close_fds=True,
            pass_fds=tuple(pass_fds),
        )
    return proc, offset


def exit_now(code: int) -> NoReturn:
    """End this process with `code` once its output is flushed, skipping the interpreter's
    teardown. For the children the supervisor waits on (the worker, a torchrun rank, the smoke
    test), called when everything they owe is on disk: the teardown frees the model's GPU memory
    tensor by tensor and joins inductor's compile workers, which the supervisor would wait out
    before a restart, or before it mirrors the last checkpoint of a preempted VM. Without the
    teardown what is left is the driver releasing the CUDA context (docs/benchmarks.md times a
    stopped worker's exit). Inductor's workers end on their
    own once their parent is gone, and the supervisor kills what is left of the child's group
    after its exit."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def command_line(argv: Sequence[str]) -> str:
    return shlex.join(argv)


def describe_exit(code: int) -> str:
    """`exit 1`, or `killed by SIGKILL` for a negative Popen return code."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}"
    return f"exit {code}"


class LogTail:
    """New complete lines appended to a file since a byte offset (a child's log)."""

    def __init__(self, path: Path, offset: int):
        self.path, self.offset, self._partial = path, offset, b""

    def lines(self, final: bool = False) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read(1 << 20)
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self._partial + data
        *complete, self._partial = data.split(b"\n")
        if final and self._partial:
            complete.append(self._partial)
            self._partial = b""
        return [c.decode("utf-8", errors="replace") + "\n" for c in complete]


def tail_text(path: Path, lines: int) -> str:
    """The last `lines` lines of a file (reads at most the last 4 MiB)."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - (4 << 20)))
        data = f.read().decode("utf-8", errors="replace")
    return "".join(data.splitlines(keepends=True)[-lines:]) if lines > 0 else ""
