"""The checkpoint mirror's background uploader (see runner.supervisor.mirror for the mirror,
its remote layout and upload protocol). Torch-free: the supervisor runs it."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from m3run.runner.checkpoint.layout import META_FILE, checkpoint_dir
from m3run.runner.files import atomic_write_json, read_json
from m3run.runner.supervisor.mirror import MIRROR_FILE, Mirror, local_complete

log = logging.getLogger(__name__)


class MirrorUploader(threading.Thread):
    """Keeps the mirror up to date with the run dir's newest complete checkpoint.

    Wakes on `notify()` (a new checkpoint was verified) or every `poll_s`, uploads the newest
    complete checkpoint if the mirror lacks it, then applies remote retention. A failure is
    recorded in mirror.json and retried after `backoff_initial_s`, doubling up to
    `backoff_max_s`. It never raises and never blocks its caller; `flush` waits (bounded) for the
    newest checkpoint to be mirrored, `close` stops the thread. `on_event(event, fields)`
    (optional) is told about uploads and errors."""

    def __init__(
        self,
        mirror: Mirror,
        run_dir: str | os.PathLike,
        keep_last: int,
        *,
        poll_s: float = 30.0,
        backoff_initial_s: float = 2.0,
        backoff_max_s: float = 300.0,
        on_event: Callable[[str, dict], None] | None = None,
    ):
        super().__init__(name="ckpt-mirror", daemon=True)
        self.mirror = mirror
        self.run_dir = Path(run_dir)
        self.keep_last = keep_last
        self.poll_s = poll_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.on_event = on_event
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._cond = threading.Condition()
        self._done_key: tuple[int, str] | None = None  # (step, sha256 of meta.json) mirrored
        self._failures = 0
        # Keep what an earlier supervisor recorded about this mirror (status shows it until
        # the first sync of this one).
        previous = read_json(self.run_dir / MIRROR_FILE) or {}
        self._state: dict[str, Any] = previous if previous.get("url") == mirror.url else {}
        for key in (
            "remote_step",
            "remote_saved_at",
            "last_upload_at",
            "last_error",
            "last_error_at",
        ):
            self._state.setdefault(key, None)
        self._state.update(url=mirror.url, failures=0)

    # ---- caller side

    def notify(self) -> None:
        """A new checkpoint may exist: look now (also cuts a backoff short)."""
        self._wake.set()

    def flush(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the newest complete local checkpoint to be mirrored.
        True when it is (or there is none)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                want = self._newest_key()
                if want is None or want == self._done_key:
                    return True
                left = deadline - time.monotonic()
                if left <= 0 or not self.is_alive():
                    return False
                self._wake.set()
                self._cond.wait(min(left, 1.0))

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop after the transfer in flight (waiting at most `timeout_s`; it is a daemon)."""
        self._stopping.set()
        self._wake.set()
        if self.is_alive():
            self.join(timeout_s)

    # ---- thread side

    def run(self) -> None:
        delay = 0.0  # first look at once: the mirror may lack the newest checkpoint
        while not self._stopping.is_set():
            if delay:
                self._wake.wait(delay)
                if self._stopping.is_set():
                    break
            self._wake.clear()
            try:
                self._sync_once()
            except Exception as e:  # never let an upload problem reach training
                self._failed(e)
                delay = min(self.backoff_max_s, self.backoff_initial_s * 2 ** (self._failures - 1))
            else:
                delay = self.poll_s
            with self._cond:
                self._cond.notify_all()

    def _newest_key(self) -> tuple[int, str] | None:
        local = local_complete(self.run_dir)
        if not local:
            return None
        try:
            digest = hashlib.sha256((local[-1].path / META_FILE).read_bytes()).hexdigest()
        except OSError:  # deleted by retention just now: the next look finds the newer one
            return None
        return local[-1].step, digest

    def _sync_once(self) -> None:
        key = self._newest_key()
        if key is None or key == self._done_key:
            return
        step = key[0]
        t0 = time.monotonic()
        path = checkpoint_dir(self.run_dir, step)
        sent = self.mirror.upload_checkpoint(path)
        deleted = self.mirror.apply_retention(self.keep_last, protect={step})
        meta = read_json(path / META_FILE) or {}
        self._done_key = key
        self._failures = 0
        now = time.time()
        self._state.update(
            remote_step=step,
            remote_saved_at=meta.get("saved_at"),
            failures=0,
            last_error=None,
            last_error_at=None,
        )
        if sent:
            seconds = time.monotonic() - t0
            self._state.update(last_upload_at=now, last_upload_step=step, last_upload_s=seconds)
            self._event("mirror_upload", step=step, seconds=round(seconds, 3), deleted=deleted)
        self._save_state()

    def _failed(self, e: Exception) -> None:
        self._failures += 1
        message = f"{type(e).__name__}: {e}"
        log.warning(
            "checkpoint mirror %s: %s (failure %d)", self.mirror.url, message, self._failures
        )
        self._state.update(last_error=message, last_error_at=time.time(), failures=self._failures)
        with contextlib.suppress(Exception):
            self._save_state()
        self._event("mirror_error", reason=message, failures=self._failures)

    def _save_state(self) -> None:
        self._state["updated_at"] = time.time()
        atomic_write_json(self.run_dir / MIRROR_FILE, self._state)

    def _event(self, event: str, **fields: Any) -> None:
        if self.on_event is None:
            return
        try:
            self.on_event(event, fields)
        except Exception as e:
            log.warning("mirror event callback failed: %s", e)
