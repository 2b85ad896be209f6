"""Runs a Supervisor over the stand-in worker in its own process (real signal handling),
holding the run dir's supervisor.lock as `m3run launch` does.

`python supervisor_driver.py RUN_DIR SETTINGS_JSON STANDIN_PATH`; exits with the supervisor's
code, and fails if the supervisor imported torch.
"""

import json
import sys
from pathlib import Path

from m3run.runner.supervisor.launch import RunLock
from m3run.runner.supervisor.settings import SupervisorSettings
from m3run.runner.supervisor.supervisor import Supervisor


def main() -> None:
    run_dir, settings, standin = Path(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]

    def argv(resume: str, lr: float) -> list[str]:
        return [sys.executable, standin, str(run_dir), resume, repr(lr)]

    lock = RunLock(run_dir)
    lock.acquire()
    code = Supervisor(run_dir, SupervisorSettings(**settings), argv, console=True).run()
    lock.release()
    assert "torch" not in sys.modules, "the supervisor imported torch"
    sys.exit(code)


if __name__ == "__main__":
    main()
