"""The checkpoint mirror's background uploader (see runner.supervisor.mirror for the mirror,
its remote layout and upload protocol). Torch-free: the supervisor runs it."""

from __future__ import annotations

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
from m3run.runner.supervisor.mirror import (
    MIRROR_FILE,
    Identity,
    Mirror,
    MirrorConflict,
    local_complete,
    short,
)
from m3run.runner.supervisor.mirror_history import RunHistory
from m3run.runner.supervisor.mirror_probe import cause

log = logging.getLogger(__name__)

Key = tuple[int, str]  # (step, sha256 of meta.json): one save of one step


class MirrorUploader(threading.Thread):
    """Keeps the mirror up to date with the run dir's newest complete checkpoint, and with the
    run's history (`history`) after each checkpoint and at each flush.

    Looks when `notify()` says a new checkpoint was verified, and every `poll_s`; uploads the
    newest complete checkpoint if the mirror lacks it, then applies remote retention (never to
    the steps in `others`: those above where the run resumed, until it uploads them itself). A
    complete mirrored checkpoint is never replaced by a different one of the same step, unless
    `replaceable` (step -> identity) names it (found corrupt): the mirror's is kept and a
    `mirror_conflict` event says so, once. Local checkpoints in `stale` (step -> sha256 of
    meta.json: another trajectory's, above an explicit `--resume`) are never uploaded.

    A failure is recorded in mirror.json and in a `mirror_error` event naming its real cause,
    and the next attempt waits `backoff_initial_s`, doubling up to `backoff_max_s`: neither
    `notify` nor a waiting `flush` cuts that wait short, so a broken mirror costs a few attempts,
    never a busy loop. A flush gets one attempt at once, then the same backoff. It never raises
    and never blocks its caller; `close` stops the thread. `on_event(event, fields)` (optional)
    is told about uploads, conflicts and errors."""

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
        history: RunHistory | None = None,
        replaceable: dict[int, Identity] | None = None,
        others: set[int] | None = None,
        stale: dict[int, str] | None = None,
    ):
        super().__init__(name="ckpt-mirror", daemon=True)
        self.mirror = mirror
        self.run_dir = Path(run_dir)
        self.keep_last = keep_last
        self.poll_s = poll_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.on_event = on_event
        self.history = history
        self._replaceable: dict[int, Identity] = dict(replaceable or {})
        self._others: set[int] = set(others or ())
        self._stale: set[Key] = set((stale or {}).items())
        self._cond = threading.Condition()
        self._stopping = False
        self._kick = True  # first look at once: the mirror may lack the newest checkpoint
        self._retry_at: float | None = None  # while failing: no attempt before this
        self._flush_gen = 0  # flushes asked for
        self._history_gen = 0  # flushes whose history upload is done
        self._history_due = False  # a checkpoint was synced since the history was uploaded
        self._done_key: Key | None = None  # newest checkpoint mirrored (or kept out: conflict)
        self.conflict_step: int | None = None  # newest checkpoint kept out by a conflict
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
        """A new checkpoint may exist: look now, or when a failure's backoff ends."""
        with self._cond:
            self._kick = True
            self._cond.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the newest complete local checkpoint to be mirrored (or
        kept out by a conflict: `conflict_step`) and the history uploaded after it. True when
        both are done."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._flush_gen += 1
            gen = self._flush_gen
            if self._retry_at is not None:
                self._retry_at = time.monotonic()  # one attempt now; failures back off again
            self._kick = True
            self._cond.notify_all()
            while True:
                want = self._newest_key()
                if (want is None or want == self._done_key) and self._history_gen >= gen:
                    return True
                left = deadline - time.monotonic()
                if left <= 0 or not self.is_alive():
                    return False
                self._cond.wait(min(left, 1.0))

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop after the transfer in flight (waiting at most `timeout_s`; it is a daemon)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self.is_alive():
            self.join(timeout_s)

    # ---- thread side

    def run(self) -> None:
        next_poll = time.monotonic()
        while True:
            with self._cond:
                while True:
                    if self._stopping:
                        return
                    now = time.monotonic()
                    if self._retry_at is not None:
                        due = self._retry_at
                    else:
                        due = now if self._kick else next_poll
                    if now >= due:
                        break
                    self._cond.wait(due - now)
                self._kick = False
                gen = self._flush_gen
            try:
                self._sync_once(history=gen > self._history_gen)
            except Exception as e:  # never let an upload problem reach training
                self._failed(e)
            else:
                with self._cond:
                    self._retry_at = None
                    self._history_gen = max(self._history_gen, gen)
                next_poll = time.monotonic() + self.poll_s
            with self._cond:
                self._cond.notify_all()

    def _newest_key(self) -> Key | None:
        """The newest complete local checkpoint of the run's trajectory (not `stale`)."""
        for info in reversed(local_complete(self.run_dir)):
            try:
                digest = hashlib.sha256((info.path / META_FILE).read_bytes()).hexdigest()
            except OSError:  # deleted by retention just now: the next look finds the newer one
                return None
            if (info.step, digest) not in self._stale:
                return info.step, digest
        return None

    def _sync_once(self, history: bool) -> None:
        key = self._newest_key()
        if key is not None and key != self._done_key:
            self._sync_checkpoint(key)
            self._history_due = True
        due = history or self._history_due
        if due and self.history is not None and self.history.upload():
            self._state["history"] = dict(self.history.sent)
            self._state["history_uploaded_at"] = time.time()
            self._save_state()
        self._history_due = False

    def _sync_checkpoint(self, key: Key) -> None:
        step = key[0]
        t0 = time.monotonic()
        path = checkpoint_dir(self.run_dir, step)
        meta = read_json(path / META_FILE) or {}
        corrupt = self._replaceable.get(step)
        try:
            sent = self.mirror.upload_checkpoint(path, {corrupt} if corrupt else set())
        except MirrorConflict as e:
            self._done_key, self.conflict_step = key, step
            self._failures = 0
            self._event(
                "mirror_conflict",
                level="warning",
                step=step,
                local_sha256=short(e.local),
                mirror_sha256=short(e.remote),
                reason=str(e),
            )
            return
        self._others.discard(step)
        deleted = self.mirror.apply_retention(self.keep_last, protect={step}, others=self._others)
        self._done_key, self.conflict_step = key, None
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
        wait = min(self.backoff_max_s, self.backoff_initial_s * 2 ** (self._failures - 1))
        with self._cond:
            self._retry_at = time.monotonic() + wait
        message = cause(e)
        log.warning(
            "checkpoint mirror %s: %s (failure %d)", self.mirror.url, message, self._failures
        )
        self._state.update(last_error=message, last_error_at=time.time(), failures=self._failures)
        try:
            self._save_state()
        except OSError as err:
            log.warning("cannot record the mirror's state in %s: %s", MIRROR_FILE, err)
        self._event(
            "mirror_error",
            level="warning",
            reason=f"{message}; the next attempt in {wait:g}s",
            failures=self._failures,
            retry_in_s=wait,
        )

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
