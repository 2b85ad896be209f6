"""The worker as a warm spare (runner/supervisor/spare.py): ``python -m m3run.runner.train
--standby``.

Imported with the worker (torch, the model, the kernels), it imports torch's compile stack too,
in this thread (no background import, so no race with the setup: runner/worker/preimport.py),
then waits for one line on stdin: the worker's arguments as a JSON list. EOF instead (the
supervisor discarded the spare or is gone) ends the process quietly. The moment the arguments
arrive is the worker's start for its startup record: the imports before it were paid while the
previous worker was still training, or, for a launch's first worker, while the smoke test ran.
"""

from __future__ import annotations

import importlib
import json
import sys
import time

from .faults import standby_fault
from .preimport import COMPILE_STACK

_activated_at: float | None = None


def activated_at() -> float | None:
    """When this process, a spare, was handed its arguments; None for a worker started as one."""
    return _activated_at


def wait_for_arguments() -> list[str] | None:
    """Import the compile stack, then block until the supervisor writes the worker's arguments;
    None at EOF. A malformed line is an error: the supervisor wrote it."""
    global _activated_at
    standby_fault()
    for name in COMPILE_STACK:
        importlib.import_module(name)
    line = sys.stdin.readline()
    if not line:
        return None
    _activated_at = time.time()
    args = json.loads(line)
    if not (isinstance(args, list) and all(isinstance(a, str) for a in args)):
        raise ValueError(f"a warm spare takes a JSON list of strings on stdin, got {line!r}")
    return args
