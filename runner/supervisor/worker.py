"""The worker as a child process: its command line (python, or torchrun for several ranks), its
start in a session of its own with its output in worker.log, SIGTERM, and its protocol exit
code (torchrun exits 1 whatever its ranks' codes were: the ranks record theirs)."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from m3run.runner.files import lock_holder, read_json
from m3run.runner.kills import ExitWitness
from m3run.runner.procs import (
    LogTail,
    append_header,
    command_line,
    create_time,
    describe_exit,
    signal_group,
    spawn_logged,
    terminate_then_kill,
)
from m3run.runner.protocol import (
    CONFIG_FILE,
    EXIT_CONFIG,
    EXIT_NAN,
    EXIT_OK,
    EXIT_STOPPED,
    FAULT_ENV,
    FAULT_SCOPE_ENV,
    SUPERVISOR_PID_ENV,
    WORKER_EXIT_GLOB,
    WORKER_LOCK_FILE,
    WORKER_LOG,
    WorkerExit,
)
from m3run.runner.supervisor.events import EventLog
from m3run.runner.supervisor.spare import WarmSpare

# (resume, lr_scale) -> argv
WorkerArgv = Callable[[str, float], list[str]]


def worker_argv(run_dir: Path, distributed: Any = None, start_over: bool = False) -> WorkerArgv:
    """The real worker: `python -m m3run.runner.train RUN_DIR/config.yaml --run-dir RUN_DIR --resume
    R [--lr-scale F]`, through torchrun when the config's `distributed` section asks for more than
    one process (torchrun never restarts on its own: the supervisor does). `start_over` (a launch
    with `--resume none --force`) passes `--force` with `--resume none`: the worker then moves
    existing checkpoints aside instead of refusing to start from scratch."""

    def build(resume: str, lr_scale: float) -> list[str]:
        argv = [
            sys.executable,
            "-m",
            "m3run.runner.train",
            str(run_dir / CONFIG_FILE),
            "--run-dir",
            str(run_dir),
            "--resume",
            resume,
        ]
        if lr_scale != 1.0:
            argv += ["--lr-scale", repr(lr_scale)]
        if start_over and resume == "none":
            argv.append("--force")
        d = distributed
        if d is None or (d.nproc_per_node == 1 and d.nnodes == 1):
            return argv
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(d.nproc_per_node),
            "--max-restarts",
            "0",
        ]
        if d.nnodes == 1:
            launcher.append("--standalone")
        else:
            launcher += [
                "--nnodes",
                str(d.nnodes),
                "--node-rank",
                str(d.node_rank),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                d.rdzv_endpoint,
                "--rdzv-id",
                d.rdzv_id or Path(run_dir).absolute().name,
            ]
        # torchrun runs each rank as `python -m m3run.runner.worker.rank <worker args>`, which
        # records the rank's exit code (torchrun itself exits 1 on any failure).
        return [*launcher, "-m", "m3run.runner.worker.rank", *argv[3:]]

    return build


def worker_env(base: dict[str, str], attempt: int) -> dict[str, str]:
    """The environment of worker attempt ``attempt`` (from 1): ``base`` with unbuffered output
    and the supervisor's pid; a fault scoped to the first worker reaches only that one."""
    env = dict(base)
    env["PYTHONUNBUFFERED"] = "1"
    env[SUPERVISOR_PID_ENV] = str(os.getpid())
    scope = env.get(FAULT_SCOPE_ENV)
    if scope not in (None, "", "first", "all"):
        _warn_fault_scope(scope)
    if attempt > 1 and scope == "first":
        env.pop(FAULT_ENV, None)
    return env


@functools.cache
def _warn_fault_scope(scope: str) -> None:
    """Once per value: a misspelt scope ("frist") would otherwise pass the fault to every
    worker, and a chaos test would then read as a run that never heals."""
    print(
        f"warning: {FAULT_SCOPE_ENV}={scope!r} is not first or all; using all (the fault "
        "reaches every worker)",
        file=sys.stderr,
        flush=True,
    )


def _is_torchrun(argv: Sequence[str]) -> bool:
    return "torch.distributed.run" in argv[:3]


def _nproc(argv: Sequence[str]) -> int:
    if "--nproc-per-node" in argv:
        return int(argv[argv.index("--nproc-per-node") + 1])
    return 1


@dataclass
class Outcome:
    """How one worker ended."""

    exit_code: int
    hang: str | None = None  # the reason when the supervisor killed it as hung
    killed_after_grace: bool = False
    how: str | None = None  # what sent a SIGKILL the supervisor did not send (runner/kills.py)

    def description(self) -> str:
        return self.how or describe_exit(self.exit_code)


def reap_stale_worker(run_dir: Path, grace_s: float, log: EventLog) -> None:
    """A worker left by a supervisor that was SIGKILLed keeps training unsupervised; stop it
    (save, then kill after the grace) before starting another on the same run dir. It is
    found by the worker.lock it holds, never by a pid read from state.json."""
    lock = run_dir / WORKER_LOCK_FILE
    pid = lock_holder(lock)
    if pid is None:
        return
    log.emit(
        "stale_worker",
        level="warning",
        reason=f"worker pid {pid} of a previous supervisor still holds {lock}; stopping it "
        "before launching a new one",
        pid=pid,
    )
    terminate_then_kill(pid, grace_s, alive=lambda: lock_holder(lock) == pid)


class WorkerProcess:
    """One worker attempt: started at construction (or, given ``spare``, a warm spare handed
    its arguments: runner/supervisor/spare.py), watched with `wait`, ended by `terminate` and
    `kill`. Its output is appended to worker.log and read back line by line (`lines`)."""

    def __init__(
        self,
        run_dir: Path,
        argv: list[str],
        env: dict[str, str],
        attempt: int,
        spare: WarmSpare | None = None,
    ):
        self.run_dir = run_dir
        self.argv = argv
        self.attempt = attempt
        self.torchrun = _is_torchrun(argv)
        self.local_ranks = _nproc(argv)
        self.spawn_wall = time.time()
        log_path = run_dir / WORKER_LOG
        header = f"m3run supervisor: worker attempt {attempt}: {command_line(argv)}"
        proc = None
        if spare is not None and spare.runs(argv) and spare.usable():
            offset = append_header(log_path, f"{header} (the warm spare)")
            proc = spare.take(argv[3:])
        self.from_spare = proc is not None
        if proc is None:
            proc, offset = spawn_logged(argv, log_path, env=env, header=header)
        self.proc = proc
        self.pid = self.proc.pid
        self.create_time = create_time(self.pid)
        self.tail = LogTail(log_path, offset)
        self.witness = ExitWitness(self.pid)

    def wait(self, timeout_s: float) -> int | None:
        self.witness.sample()
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def terminate(self) -> None:
        """SIGTERM the worker: the whole process group, or under torchrun only the ranks (a
        SIGTERMed torchrun gives its ranks 30 s and then kills them, whatever the grace)."""
        if not self.torchrun:
            signal_group(self.pid, signal.SIGTERM)
            return
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    child.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the group (after an exit: the leftovers, ranks and loader workers)."""
        signal_group(self.pid, signal.SIGKILL)

    def lines(self, final: bool = False) -> list[str]:
        return self.tail.lines(final=final)

    def protocol_code(self, code: int) -> int:
        """The worker's protocol exit code (see `ranks_exit_code` under torchrun)."""
        if not self.torchrun:
            return code
        return ranks_exit_code(self.run_dir, code, self.spawn_wall, self.local_ranks)


def ranks_exit_code(run_dir: Path, code: int, spawn_wall: float, local_ranks: int) -> int:
    """torchrun exits 1 whatever its ranks' codes were: take the protocol code the rank
    wrapper recorded for every rank of this attempt (78 or 76 on any rank wins; 75 or 0 only
    when all ranks agree). A rank that died without a record keeps the crash."""
    if code == EXIT_OK:
        return code
    codes = []
    for path in run_dir.glob(WORKER_EXIT_GLOB):
        rec = WorkerExit.from_dict(read_json(path))
        if rec is not None and rec.time >= spawn_wall - 1.0:
            codes.append(rec.code)
    for wins in (EXIT_CONFIG, EXIT_NAN):
        if wins in codes:
            return wins
    if (
        codes
        and len(set(codes)) == 1
        and codes[0] in (EXIT_OK, EXIT_STOPPED)
        and len(codes) >= local_ranks
    ):
        return codes[0]
    return code
