"""The supervisor's record of what it did and why: events.jsonl, supervisor.log, the console."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any

import structlog

from m3run.runner.console import iso_time, json_record, text_level
from m3run.runner.files import RunDirWriteError, append_jsonl, open_append
from m3run.runner.protocol import (
    CONSOLE_LOST_EVENT,
    EVENTS_FILE,
    SUPERVISOR_LOG,
    LogFormat,
    parse_worker_record,
)


class EventLog:
    """Supervisor transitions: one record in events.jsonl, one JSON line in supervisor.log, and
    with `console` one line on stdout. The console is one format for every line, the worker's
    echoed output included (what `docker logs` and `kubectl logs` show): `text` (the default),
    an ISO-8601 UTC timestamp, the source and a short message, colour only on a terminal without
    NO_COLOR; or `json`, one object per line (runner.console), where the worker's logged steps
    and evals are records with their numbers as fields (runner.protocol.StepRecord) and its
    other lines are records of event "output".

    A lost console (a closed terminal's SIGHUP, EIO or EPIPE on stdout, a closed stdout) never
    raises: the supervisor goes on without it, recording in the run dir only, as a detached one
    does, and one `console_lost` event says so."""

    def __init__(self, run_dir: Path, console: bool, log_format: LogFormat | str = LogFormat.TEXT):
        self._json = LogFormat(log_format) == LogFormat.JSON
        self.run_dir = run_dir
        self._open_log()
        self._console = console
        self._color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
        self._lost: str | None = None  # why the console went away, until its event is written
        self._lost_recorded = False

    def emit(
        self, event: str, reason: str | None = None, level: str = "info", **fields: Any
    ) -> None:
        record = {"time": time.time(), "event": event, "reason": reason, **fields}
        if self._console:
            self._print(record, level)
        try:
            append_jsonl(self.run_dir / EVENTS_FILE, record)
        except OSError as e:
            raise RunDirWriteError.wrap(e, self.run_dir / EVENTS_FILE) from e
        try:
            self._reopen_if_gone()
            getattr(self._log, level)(event, reason=reason, **fields)
        except OSError as e:
            raise RunDirWriteError.wrap(e, self.run_dir / SUPERVISOR_LOG) from e
        self.record_console_loss()

    def _open_log(self) -> None:
        self._file = open_append(self.run_dir / SUPERVISOR_LOG)
        self._log = structlog.wrap_logger(
            structlog.PrintLogger(self._file),
            processors=[
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                structlog.processors.JSONRenderer(sort_keys=True),
            ],
        )

    def _reopen_if_gone(self) -> None:
        """Open supervisor.log afresh when the file this log writes to is no longer at its path
        (deleted or replaced under a running supervisor): writes to the unlinked file would go
        on succeeding, and every later event would be lost to `m3run logs --supervisor`."""
        path = self.run_dir / SUPERVISOR_LOG
        try:
            at_path = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            at_path = None
        held = os.fstat(self._file.fileno())
        if at_path is not None and (at_path.st_dev, at_path.st_ino) == (held.st_dev, held.st_ino):
            return
        with contextlib.suppress(OSError):
            self._file.close()
        self._open_log()

    def lose_console(self, why: str) -> None:
        """Go on without the console: stdout and stderr are pointed at /dev/null, so that no
        later write (a refusal, the interpreter's last flush) fails on it either. Safe from a
        signal handler: the event is written by the next `emit` or `record_console_loss`."""
        if self._lost is not None or self._lost_recorded:
            return
        had_console, self._console = self._console, False
        self._lost = why if had_console else f"{why}; this supervisor has no console"
        if had_console:
            _silence_stdio()

    def record_console_loss(self) -> None:
        """Write the console_lost event once the console is gone (the supervisor's loop calls
        this every turn, so a SIGHUP is on record while the run trains)."""
        if self._lost is None or self._lost_recorded:
            return
        self._lost_recorded = True
        why, self._lost = self._lost, None
        self.emit(
            CONSOLE_LOST_EVENT,
            reason=f"{why}: the run goes on without a console; follow it with `m3run logs "
            f"{self.run_dir} -f` (supervisor.log and events.jsonl hold every event), stop it "
            f"with `m3run stop {self.run_dir}`",
            level="warning",
        )

    def _write(self, line: str) -> None:
        try:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
        except (OSError, ValueError) as e:  # ValueError: stdout was closed
            self.lose_console(f"writing to the console failed ({type(e).__name__}: {e})")

    def _print(self, record: dict, level: str) -> None:
        if self._json:
            fields = {k: v for k, v in record.items() if k not in ("time", "event")}
            line = json_record("supervisor", level, record["event"], record["time"], **fields)
        else:
            when = iso_time(record["time"])
            # Scalars only: the health report, argv and the like stay in events.jsonl.
            extra = " ".join(
                f"{k}={v}"
                for k, v in record.items()
                if k not in ("time", "event", "reason")
                and isinstance(v, (str, int, float))
                and not isinstance(v, bool)
            )
            tag = level.upper()
            if self._color and level in _COLORS:
                tag = f"\033[{_COLORS[level]}m{tag}\033[0m"
            reason = f": {record['reason']}" if record["reason"] else ""
            line = f"{when} supervisor {tag} {record['event']}{reason}" + (
                f"  ({extra})" if extra else ""
            )
        self._write(line)

    def echo(self, line: str) -> None:
        """A child's output line (the worker's, the smoke test's) in the console's format."""
        if not self._console:
            return
        text = line.rstrip("\n")
        if not self._json:
            self._write(f"{iso_time(time.time())} worker {text}")
            return
        record = parse_worker_record(text)
        if record is None:
            self._write(json_record("worker", text_level(text), "output", time.time(), line=text))
            return
        fields = record.model_dump(exclude={"event", "time"})
        self._write(json_record("worker", record.level(), record.event, record.time, **fields))

    def close(self) -> None:
        with contextlib.suppress(OSError):  # a full disk may refuse the last flush
            self._file.close()


_COLORS = {"warning": "33", "error": "31"}


def _silence_stdio() -> None:
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        for fd in (1, 2):
            with contextlib.suppress(OSError):
                os.dup2(devnull, fd)
        os.close(devnull)
