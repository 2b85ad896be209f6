"""The supervisor's event log keeps writing supervisor.log when the file is deleted or
replaced under it."""

from __future__ import annotations

import json

from m3run.runner.protocol import EVENTS_FILE, SUPERVISOR_LOG
from m3run.runner.supervisor.events import EventLog


def _events(path) -> list[str]:
    return [json.loads(line)["event"] for line in path.read_text().splitlines()]


def test_a_deleted_supervisor_log_is_opened_afresh_for_the_next_event(tmp_path):
    log = EventLog(tmp_path, console=False)
    try:
        log.emit("first")
        (tmp_path / SUPERVISOR_LOG).unlink()
        log.emit("second")
        log.emit("third")
        assert _events(tmp_path / SUPERVISOR_LOG) == ["second", "third"]
        # A file put in its place (a rotation) gets the events after it, appended.
        (tmp_path / SUPERVISOR_LOG).rename(tmp_path / "rotated.log")
        (tmp_path / SUPERVISOR_LOG).write_text("")
        log.emit("fourth")
        assert _events(tmp_path / SUPERVISOR_LOG) == ["fourth"]
        assert _events(tmp_path / EVENTS_FILE) == ["first", "second", "third", "fourth"]
    finally:
        log.close()
