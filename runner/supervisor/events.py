"""The supervisor's record of what it did and why: events.jsonl, supervisor.log, the console."""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import structlog

from runner.files import RunDirWriteError, append_jsonl, open_append
from runner.protocol import EVENTS_FILE, SUPERVISOR_LOG


class EventLog:
    """Supervisor transitions: one record in events.jsonl, one structured line in
    supervisor.log (JSON), and optionally one line on the console (human on a terminal,
    JSON otherwise)."""

    def __init__(self, run_dir: Path, console: bool):
        self.run_dir = run_dir
        self._file = open_append(run_dir / SUPERVISOR_LOG)
        timestamper = structlog.processors.TimeStamper(fmt="iso", utc=True)
        self._log = structlog.wrap_logger(
            structlog.PrintLogger(self._file),
            processors=[
                structlog.processors.add_log_level,
                timestamper,
                structlog.processors.JSONRenderer(sort_keys=True),
            ],
        )
        self._console = None
        if console:
            tty = sys.stdout.isatty()
            renderer = (
                structlog.dev.ConsoleRenderer(colors=True)
                if tty
                else structlog.processors.JSONRenderer(sort_keys=True)
            )
            self._console = structlog.wrap_logger(
                structlog.PrintLogger(sys.stdout),
                processors=[
                    structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=False),
                    renderer,
                ],
            )

    def emit(
        self, event: str, reason: str | None = None, level: str = "info", **fields: Any
    ) -> None:
        record = {"time": time.time(), "event": event, "reason": reason, **fields}
        if self._console is not None:
            getattr(self._console, level)(event, reason=reason, **fields)
        try:
            append_jsonl(self.run_dir / EVENTS_FILE, record)
        except OSError as e:
            raise RunDirWriteError.wrap(e, self.run_dir / EVENTS_FILE) from e
        try:
            getattr(self._log, level)(event, reason=reason, **fields)
        except OSError as e:
            raise RunDirWriteError.wrap(e, self.run_dir / SUPERVISOR_LOG) from e

    def echo(self, line: str) -> None:
        """A child's output line in the foreground console."""
        if self._console is not None:
            sys.stdout.write(line)
            sys.stdout.flush()

    def close(self) -> None:
        with contextlib.suppress(OSError):  # a full disk may refuse the last flush
            self._file.close()
