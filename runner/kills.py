"""What killed a child: a SIGKILL nobody in m3run sent is most often the kernel's out-of-memory
killer, which logs nothing to the child's own output. `ExitWitness` watches one child from its
start and names its death from the evidence it can read: the kernel's OOM record (/dev/kmsg,
records written during the child's life) and the OOM-kill count of the child's memory cgroup
(cgroup v2 memory.events, v1 memory.oom_control), with the child's peak memory beside it.
Torch-free: the supervisor and the preflight use it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
from pathlib import Path

import psutil

from m3run.runner.procs import describe_exit

CGROUP_ROOT = Path("/sys/fs/cgroup")
KMSG = Path("/dev/kmsg")

# The kernel's record of an OOM kill (mm/oom_kill.c): "Out of memory: Killed process 123
# (python) total-vm:…, anon-rss:…" or, under a cgroup's limit, "Memory cgroup out of memory: …".
_KILLED = re.compile(r"Killed process (\d+) ")
# A read of /dev/kmsg returns one record; the kernel's records are at most this long.
_KMSG_RECORD = 8192


_FIX = ". Fix: a smaller train.micro_batch_size, more memory, or fewer other processes on it"


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


class ExitWitness:
    """One child process watched from its start (construct it right after the spawn):
    `sample()` while it runs records its peak resident memory (VmHWM, the largest of it and its
    descendants), `describe(code)` names its exit, `close()` lets the evidence go."""

    def __init__(self, pid: int, cgroup_root: Path = CGROUP_ROOT, kmsg: Path = KMSG):
        self.pid = pid
        self.pids = {pid}
        self.peak_rss = 0
        self.peak_pid = pid
        self._oom_file, self._memory_limit = _memory_cgroup(pid, cgroup_root)
        self._oom_kills = _oom_kills(self._oom_file)
        self._kmsg = _open_kmsg(kmsg)
        self.sample()

    def sample(self) -> None:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(self.pid)
            for p in [proc, *proc.children(recursive=True)]:
                self.pids.add(p.pid)
                hwm = _vm_hwm(p.pid)
                if hwm is not None and hwm > self.peak_rss:
                    self.peak_rss, self.peak_pid = hwm, p.pid

    def describe(self, code: int) -> str:
        """`exit 1`, `killed by SIGTERM`, or for a SIGKILL what the evidence says sent it."""
        try:
            if code != -signal.SIGKILL:
                return describe_exit(code)
            record = self._kernel_record()
            if record is not None:
                return (
                    f"killed by the out-of-memory killer (SIGKILL; the kernel's log: {record})"
                    f"{self._memory()}{_FIX}"
                )
            after = _oom_kills(self._oom_file)
            if self._oom_kills is not None and after is not None:
                if after > self._oom_kills:
                    return (
                        "killed by the out-of-memory killer (SIGKILL; the memory cgroup's "
                        f"oom_kill count rose from {self._oom_kills} to {after} in "
                        f"{self._oom_file}){self._memory()}{_FIX}"
                    )
                return (
                    "killed by SIGKILL, not by the out-of-memory killer (the memory cgroup's "
                    f"oom_kill count stayed at {after}): another process sent it{self._memory()}"
                )
            return f"killed by SIGKILL: most often the out-of-memory killer{self._memory()}{_FIX}"
        finally:
            self.close()

    def close(self) -> None:
        if self._kmsg is not None:
            os.close(self._kmsg)
            self._kmsg = None

    __del__ = close

    def _memory(self) -> str:
        """`; peak RSS …` with the limit it ran under, or "" when nothing was read."""
        if not self.peak_rss:
            return ""
        whose = "" if self.peak_pid == self.pid else f" (its child pid {self.peak_pid})"
        limit = self._memory_limit or psutil.virtual_memory().total
        what = "the memory cgroup's limit" if self._memory_limit else "this machine's memory"
        return f"; peak RSS at least {_size(self.peak_rss)}{whose} of {_size(limit)} ({what})"

    def _kernel_record(self) -> str | None:
        """The kernel's OOM-kill record of one of the child's processes, among the records
        written since it started; None when there is none or /dev/kmsg cannot be read."""
        if self._kmsg is None:
            return None
        found = None
        while True:
            try:
                raw = os.read(self._kmsg, _KMSG_RECORD)
            except BrokenPipeError:
                continue  # records were overwritten before this read: go on with the next
            except OSError:
                break  # EAGAIN: no more records
            if not raw:
                break
            text = raw.decode("utf-8", errors="replace").partition(";")[2].splitlines()[0]
            m = _KILLED.search(text)
            if m and int(m.group(1)) in self.pids:
                found = text.strip()
        return found


def _vm_hwm(pid: int) -> int | None:
    """The process's peak resident set size in bytes (VmHWM), None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _memory_cgroup(pid: int, root: Path) -> tuple[Path | None, int | None]:
    """(the file holding the OOM-kill count of the child's memory cgroup, the cgroup's memory
    limit in bytes or None when unlimited); (None, None) when neither version can be read."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if controllers == "":  # cgroup v2: one hierarchy
            candidates = [(root / rel, "memory.events", "memory.max")]
        elif "memory" in controllers.split(","):
            candidates = [(root / "memory" / rel, "memory.oom_control", "memory.limit_in_bytes")]
        else:
            continue
        for folder, events, limit in candidates:
            if _oom_kills(folder / events) is not None:
                return folder / events, _limit(folder / limit)
    return None, None


def _oom_kills(path: Path | None) -> int | None:
    if path is None:
        return None
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        return None
    return None


def _limit(path: Path) -> int | None:
    """A cgroup memory limit in bytes; None for none ("max", or v1's page-rounded 2**63)."""
    try:
        value = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return value if value < 2**62 else None


def _open_kmsg(path: Path) -> int | None:
    """/dev/kmsg opened at its end (only records written from now on are read), or None where
    it cannot be read (an unprivileged user under dmesg_restrict, most containers)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        os.lseek(fd, 0, os.SEEK_END)
    except OSError:
        os.close(fd)
        return None
    return fd
