"""torchrun's entry for each rank: `python -m m3run.runner.worker.rank <worker args>`.

Runs the worker in this process, then records the rank's protocol exit code in
RUN_DIR/worker_exit.local<LOCAL_RANK>.json, since torchrun itself exits 1 whatever its ranks'
codes were; the supervisor reads the records to tell a stop (75) or a NaN excursion (76) from a
crash.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from m3run.runner.files import atomic_write_json
from m3run.runner.procs import exit_now
from m3run.runner.protocol import WorkerExit, worker_exit_file

from .main import main as worker_main


def main(argv: list[str] | None = None) -> int:
    """One torchrun rank: run the worker in this process and record its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    code = worker_main(argv)
    parsed = argparse.ArgumentParser(add_help=False)
    parsed.add_argument("--run-dir", type=Path)
    run_dir = parsed.parse_known_args(argv)[0].run_dir
    if run_dir is not None and run_dir.is_dir():
        rank = int(os.environ.get("LOCAL_RANK", "0"))
        record = WorkerExit(code=code, pid=os.getpid(), time=time.time())
        atomic_write_json(run_dir / worker_exit_file(rank), record.to_dict())
    return code


if __name__ == "__main__":
    exit_now(main())  # the rank's record is written: no teardown for torchrun to wait out
