"""`python -m m3run.runner.train CONFIG --run-dir DIR ...`: the training worker's command line.

The worker lives in runner.worker (runner/worker/main.py); this module keeps the command and
the `run` that `m3run train` calls.
"""

from __future__ import annotations

from m3run.runner.procs import exit_now
from m3run.runner.worker.main import main, run

__all__ = ["main", "run"]

if __name__ == "__main__":
    # run() returned: checkpoints written, files closed, the run dir released. A crash raises
    # past this and exits through the interpreter, traceback printed.
    exit_now(main())
