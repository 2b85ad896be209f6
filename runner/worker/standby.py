"""The worker as a warm spare (runner/supervisor/spare.py): ``python -m m3run.runner.train
--standby``.

Imported with the worker (torch, the model, the kernels), it imports torch's compile stack too,
in this thread (no background import, so no race with the setup: runner/worker/preimport.py),
then waits for one line on stdin: the worker's arguments as a JSON list. EOF instead (the
supervisor discarded the spare or is gone) ends the process quietly. The moment the arguments
arrive is the worker's start for its startup record: the imports before it were paid while the
previous worker was still training, or, for a launch's first worker, while the smoke test ran.

From the moment it waits, a SIGTERM or SIGINT is recorded, not fatal: the supervisor may stop
the run right after handing the spare its arguments, before the worker's own handler is in
place, and the new worker must then save and exit 75 like any stopped worker
(runner/worker/main.py takes the recorded signal over).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import sys
import time

from m3run.runner.protocol import SPARE_READY_FD_ENV

from .faults import standby_fault
from .preimport import COMPILE_STACK

_activated_at: float | None = None
_stop_signal: int | None = None


def _record_stop(signum: int, _frame: object) -> None:
    # Only record it: the worker acts on it once its trainer exists.
    global _stop_signal
    _stop_signal = signum


def stop_signal() -> int | None:
    """The SIGTERM or SIGINT this spare received before its worker's handler was installed."""
    return _stop_signal


def activated_at() -> float | None:
    """When this process, a spare, was handed its arguments; None for a worker started as one."""
    return _activated_at


def _say_ready() -> None:
    """One byte on the supervisor's readiness pipe (SPARE_READY_FD_ENV): the imports are done.
    A supervisor that has gone away (a closed pipe) is none of the spare's business here: it
    reads EOF on stdin next."""
    fd = os.environ.get(SPARE_READY_FD_ENV)
    if fd is None or not fd.isdigit():
        return
    with contextlib.suppress(OSError):
        os.write(int(fd), b"\n")
        os.close(int(fd))


def wait_for_arguments() -> list[str] | None:
    """Import the compile stack, then block until the supervisor writes the worker's arguments;
    None at EOF. A malformed line is an error: the supervisor wrote it."""
    global _activated_at
    signal.signal(signal.SIGTERM, _record_stop)
    signal.signal(signal.SIGINT, _record_stop)
    standby_fault()
    for name in COMPILE_STACK:
        importlib.import_module(name)
    _say_ready()
    line = sys.stdin.readline()
    if not line:
        return None
    _activated_at = time.time()
    args = json.loads(line)
    if not (isinstance(args, list) and all(isinstance(a, str) for a in args)):
        raise ValueError(f"a warm spare takes a JSON list of strings on stdin, got {line!r}")
    return args
