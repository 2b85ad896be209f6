"""The console in the format a launch chose (runner.protocol.LogFormat): text lines for people, or
one JSON object per line for log collectors. The supervisor's events (supervisor/events.py) and
what `m3run launch` says on its own (refusals, warnings, usage errors) are written through here,
so that a json console holds nothing on stdout or stderr that is not a record.

Every JSON record has `time` (ISO-8601 UTC), `source` (launch, supervisor or worker), `level`
(info, warning or error) and `event`, then the event's fields: `reason` for a message, `exit_code`
for an error that ends the command. Torch-free."""

from __future__ import annotations

import json
import math
import sys
import time
from datetime import UTC, datetime
from typing import Any, TextIO

from m3run.runner.protocol import LogFormat


def iso_time(t: float) -> str:
    """ISO-8601 UTC with milliseconds: 2026-12-01T10:42:07.123Z."""
    stamp = datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds")
    return stamp.replace("+00:00", "Z")


def _finite(value: Any) -> Any:
    """`value` with every non-finite float replaced by None: json.dumps would write NaN, which
    is not JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def json_record(source: str, level: str, event: str, when: float, /, **fields: Any) -> str:
    """One console record as one JSON line; a value JSON cannot hold is written as its str.
    (Positional-only: an event may have fields of any name, `when` included.)"""
    record = {**fields, "time": iso_time(when), "source": source, "level": level, "event": event}
    return json.dumps(_finite(record), sort_keys=True, default=str)


def text_level(line: str) -> str:
    """The level of a plain output line, by the prefix m3run's processes give their messages."""
    head = line.lstrip().lower()
    if head.startswith(("error:", "traceback")):
        return "error"
    if head.startswith("warning:"):
        return "warning"
    return "info"


class Console:
    """What a command says on its own, as `prefix: message` lines or JSON records from `source`:
    errors and warnings on stderr, notes on stdout."""

    def __init__(self, log_format: LogFormat | str, source: str, prefix: str):
        self.json = LogFormat(log_format) == LogFormat.JSON
        self.source = source
        self.prefix = prefix

    def error(self, message: str, exit_code: int, event: str = "error", **fields: Any) -> None:
        """An error that ends the command with `exit_code`."""
        self._say(sys.stderr, "error", event, message, message, exit_code=exit_code, **fields)

    def warning(self, message: str, event: str = "warning", **fields: Any) -> None:
        self._say(sys.stderr, "warning", event, f"warning: {message}", message, **fields)

    def info(self, message: str, event: str, **fields: Any) -> None:
        self._say(sys.stdout, "info", event, message, message, **fields)

    def relay(self, text: str) -> None:
        """Another process's output (a background supervisor's refusal) on stderr: as it is in
        text, and in json its records as they are, its other lines wrapped in records."""
        if not self.json:
            print(text, file=sys.stderr, flush=True)
            return
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                is_record = isinstance(json.loads(line), dict)
            except json.JSONDecodeError:
                is_record = False
            out = line if is_record else self.record(text_level(line), "output", line=line)
            print(out, file=sys.stderr, flush=True)

    def record(self, level: str, event: str, **fields: Any) -> str:
        return json_record(self.source, level, event, time.time(), **fields)

    def _say(
        self, stream: TextIO, level: str, event: str, text: str, reason: str, **fields: Any
    ) -> None:
        line = self.record(level, event, reason=reason, **fields) if self.json else None
        print(line if line is not None else f"{self.prefix}: {text}", file=stream, flush=True)
