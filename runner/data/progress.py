"""Progress of data preparation on stderr: a rich bar on a terminal, a line every N seconds
elsewhere (a container log, a CI job, `nohup`), so a long preparation is never silent."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from m3run.runner.formatting import count

__all__ = ["Progress"]


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


class Progress:
    """`phase()`, `advance(bytes, documents, tokens)`, `done()`, as a context manager; and
    `waiting()` around work that reports nothing as it goes (a BPE trainer computing merges).

    mode "bar" (a terminal), "lines" (a plain line to stderr at most every `interval_s` seconds
    and at the end of each phase) or "off".
    """

    def __init__(self, mode: str, interval_s: float = 10.0):
        if mode not in ("bar", "lines", "off"):
            raise ValueError(f"progress mode {mode!r}: expected bar, lines or off")
        self.mode = mode
        self.interval_s = interval_s
        self._bar: Any = None
        self._task: Any = None
        self._description = ""
        self._total: int | None = None
        self._started = self._last = time.monotonic()
        self._bytes = self._docs = self._tokens = 0

    def __enter__(self) -> Progress:
        if self.mode == "bar":
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=False,
            )
            self._bar.__enter__()
        return self

    def phase(self, description: str, total: int | None) -> None:
        self._description, self._total = description, total
        self._started = self._last = time.monotonic()
        self._bytes = self._docs = self._tokens = 0
        if self._bar is not None:
            self._task = self._bar.add_task(description, total=total)

    def advance(self, nbytes: int, documents: int = 0, tokens: int = 0) -> None:
        self._bytes += nbytes
        self._docs += documents
        self._tokens += tokens
        if self._bar is not None and self._task is not None:
            self._bar.advance(self._task, nbytes)
        elif self.mode == "lines" and time.monotonic() - self._last >= self.interval_s:
            self._line()

    def done(self) -> None:
        if self._bar is not None and self._task is not None:
            total = self._bar.tasks[-1].total or self._bytes or 1
            self._bar.update(self._task, total=total, completed=total)
        elif self.mode == "lines":
            self._line(final=True)

    @contextlib.contextmanager
    def waiting(self, description: str) -> Iterator[None]:
        """Show that `description` is under way while the body runs, with the time it has
        taken: a bar whose text counts the seconds, or a line when it starts, every
        `interval_s` seconds and when it ends. The count runs on a thread, so the body must
        let go of the GIL (the tokenizers library does while it trains)."""
        if self.mode == "off":
            yield
            return
        started = time.monotonic()
        task = None
        if self._bar is not None:
            task = self._bar.add_task(description, total=None)
        else:
            _say(f"prepare-data: {description}")

        def show() -> None:
            elapsed = time.monotonic() - started
            if task is not None:
                self._bar.update(task, description=f"{description} ({elapsed:,.0f} s)")
            else:
                _say(f"prepare-data: {description} ({elapsed:,.0f} s so far)")

        stop = threading.Event()
        period = 1.0 if task is not None else self.interval_s

        def tick() -> None:
            while not stop.wait(period):
                show()

        ticker = threading.Thread(target=tick, name="m3run-progress", daemon=True)
        ticker.start()
        try:
            yield
        finally:
            stop.set()
            ticker.join()
            elapsed = time.monotonic() - started
            if task is not None:  # a byte count means nothing here: a line in its place
                self._bar.remove_task(task)
                self._bar.console.print(f"{description} done in {elapsed:,.0f} s")
            else:
                _say(f"prepare-data: {description} done in {elapsed:,.0f} s")

    def _line(self, final: bool = False) -> None:
        now = time.monotonic()
        self._last = now
        elapsed = max(now - self._started, 1e-9)
        of = f" (inputs: {_mb(self._total)} on disk)" if self._total else ""
        # A phase counts what it sees: reading text for the tokenizer's training counts
        # documents, tokenising counts tokens too.
        counts = "".join(
            f", {count(n, noun)}"
            for n, noun in ((self._docs, "document"), (self._tokens, "token"))
            if n
        )
        state = " done" if final else ""
        print(
            f"prepare-data: {self._description}{state}: {_mb(self._bytes)} of text{of}{counts}, "
            f"{self._bytes / elapsed / 1e6:,.2f} MB/s, {elapsed:,.0f} s",
            file=sys.stderr,
            flush=True,
        )

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
