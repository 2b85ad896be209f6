"""The supervisor's side of the checkpoint mirror (checkpoint.mirror_url): restore the newest
remote checkpoint into a run dir that has none (a new disk after preemption or a node swap),
keep the mirror up to date while the run goes on, and wait for the newest checkpoint to reach
it before the supervisor exits."""

from __future__ import annotations

import time
from pathlib import Path

from m3run.runner.supervisor.events import EventLog
from m3run.runner.supervisor.mirror import Mirror
from m3run.runner.supervisor.mirror_upload import MirrorUploader
from m3run.runner.supervisor.settings import SupervisorSettings


class MirrorSync:
    """One run dir's mirror. `start` raises MirrorError when the mirror cannot be read."""

    def __init__(self, settings: SupervisorSettings, run_dir: Path, log: EventLog):
        self.s = settings
        self.run_dir = run_dir
        self.log = log
        self._uploader: MirrorUploader | None = None

    def start(self, resume: str) -> None:
        mirror = Mirror(self.s.mirror_url)
        # Only `--resume latest` continues from the newest checkpoint wherever it is;
        # `none` starts over and an explicit STEP must be in the run dir already.
        restored = mirror.restore_latest(self.run_dir) if resume == "latest" else None
        if restored is not None:
            self.log.emit(
                "mirror_restore",
                step=restored,
                url=self.s.mirror_url,
                reason=f"the run dir had no complete checkpoint; restored step "
                f"{restored} from the mirror",
            )

        def on_event(event: str, fields: dict) -> None:
            self.log.emit(event, level="warning" if event.endswith("error") else "info", **fields)

        self._uploader = MirrorUploader(
            mirror,
            self.run_dir,
            self.s.mirror_keep_last,
            backoff_initial_s=self.s.backoff_initial_s,
            backoff_max_s=self.s.backoff_max_s,
            on_event=on_event,
        )
        self._uploader.start()

    def notify(self) -> None:
        """A new checkpoint was verified complete."""
        if self._uploader is not None:
            self._uploader.notify()

    def flush(self) -> None:
        """Wait (at most checkpoint.mirror_flush_s) for the newest checkpoint to be mirrored."""
        if self._uploader is None or self.s.mirror_flush_s <= 0:
            return
        t0 = time.monotonic()
        ok = self._uploader.flush(self.s.mirror_flush_s)
        waited = time.monotonic() - t0
        if ok:
            self.log.emit(
                "mirror_flush", reason=f"newest checkpoint is in the mirror (waited {waited:.1f}s)"
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
        if self._uploader is not None:
            self._uploader.close()
