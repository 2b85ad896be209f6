"""The supervisor's side of the checkpoint mirror (checkpoint.mirror_url): at (re)start, probe
the mirror (a missing bucket or an unwritable mirror ends the launch), resume from the newest
complete checkpoint wherever it lives (mirror_reconcile) and bring back the run's history
(mirror_history); keep the mirror up to date while the run goes on; and wait for the newest
checkpoint and the history to reach it before the supervisor exits."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from m3run.runner.files import read_json
from m3run.runner.supervisor.events import EventLog
from m3run.runner.supervisor.mirror import MIRROR_FILE, Mirror
from m3run.runner.supervisor.mirror_history import RunHistory
from m3run.runner.supervisor.mirror_probe import cause, probe
from m3run.runner.supervisor.mirror_reconcile import reconcile
from m3run.runner.supervisor.mirror_upload import MirrorUploader
from m3run.runner.supervisor.settings import SupervisorSettings

# After the final state is written, the history (the run's last events) gets this long at most.
_CLOSE_FLUSH_S = 10.0


class MirrorSync:
    """One run dir's mirror. `start` raises MirrorError when the mirror cannot be used or a
    checkpoint the run must resume from cannot be restored."""

    def __init__(self, settings: SupervisorSettings, run_dir: Path, log: EventLog):
        self.s = settings
        self.run_dir = run_dir
        self.log = log
        self._uploader: MirrorUploader | None = None
        self._flushed = False

    def start(self, resume: str) -> None:
        mirror = Mirror(self.s.mirror_url)
        remote = probe(mirror)
        found = reconcile(mirror, self.run_dir, resume, remote, self.log.emit)
        history: RunHistory | None = self._restore_history(mirror)

        def on_event(event: str, fields: dict[str, Any]) -> None:
            level = fields.pop("level", "warning" if event.endswith("error") else "info")
            self.log.emit(event, level=level, **fields)

        self._uploader = MirrorUploader(
            mirror,
            self.run_dir,
            self.s.mirror_keep_last,
            backoff_initial_s=self.s.backoff_initial_s,
            backoff_max_s=self.s.backoff_max_s,
            on_event=on_event,
            history=history,
            replaceable=found.replaceable,
            others=found.others,
            stale=found.stale,
        )
        self._uploader.start()

    def _restore_history(self, mirror: Mirror) -> RunHistory | None:
        """The mirror's history merged into the run dir's; None (history not uploaded by this
        run, so the mirror's copy stays whole) when it cannot be read."""
        state = read_json(self.run_dir / MIRROR_FILE) or {}
        sent = state.get("history") if state.get("url") == mirror.url else None
        history = RunHistory(mirror, self.run_dir, sent if isinstance(sent, dict) else None)
        try:
            done = history.restore()
        except Exception as e:
            self.log.emit(
                "mirror_error",
                level="warning",
                url=mirror.url,
                reason=f"could not read the run's history from the mirror: {cause(e)}; this "
                "run does not upload its history, so the mirror's copy stays whole (fix: "
                "check the mirror, then relaunch)",
            )
            return None
        if done:
            self.log.emit(
                "mirror_history",
                url=mirror.url,
                files=done,
                reason=f"brought the run's history back from {mirror.url}: "
                + ", ".join(f"{k} ({v})" for k, v in done.items()),
            )
        return history

    def notify(self) -> None:
        """A new checkpoint was verified complete."""
        if self._uploader is not None:
            self._uploader.notify()

    def flush(self) -> None:
        """Wait (at most checkpoint.mirror_flush_s) for the newest checkpoint and the history to
        be mirrored."""
        if self._uploader is None or self.s.mirror_flush_s <= 0:
            return
        t0 = time.monotonic()
        ok = self._uploader.flush(self.s.mirror_flush_s)
        waited = time.monotonic() - t0
        self._flushed = ok
        kept_out = self._uploader.conflict_step
        if ok and kept_out is None:
            self.log.emit(
                "mirror_flush",
                reason=f"newest checkpoint and the run's history are in the mirror (waited "
                f"{waited:.1f}s)",
            )
        elif ok:
            self.log.emit(
                "mirror_flush",
                level="warning",
                reason=f"the run's history is in the mirror, but not its newest checkpoint: the "
                f"mirror holds another checkpoint of step {kept_out}, which is kept (see the "
                "mirror_conflict event)",
            )
        else:
            self.log.emit(
                "mirror_flush",
                level="warning",
                reason=f"the newest checkpoint did not reach {self.s.mirror_url} "
                f"within checkpoint.mirror_flush_s={self.s.mirror_flush_s:g}s; a "
                "relaunch on another disk would resume from an older one",
            )

    def close(self) -> None:
        if self._uploader is None:
            return
        if self._flushed:
            # The final state's event came after the flush: send the history once more.
            self._uploader.flush(min(self.s.mirror_flush_s, _CLOSE_FLUSH_S))
        self._uploader.close()
