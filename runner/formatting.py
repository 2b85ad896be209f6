"""Numbers as a person reads them, shared by both process sides: the worker's console step line
and the CLI's views print the same durations the same way. Torch-free and import-free, so the
worker can use it without loading anything of the CLI's or the supervisor's."""

from __future__ import annotations

from typing import Any


def format_duration(seconds: Any) -> str:
    """1h02m, 3m07s, 42s; "-" for anything that is not a finite, non-negative number."""
    if not isinstance(seconds, (int, float)) or not 0 <= seconds < float("inf"):
        return "-"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def count(n: int, noun: str, plural: str | None = None) -> str:
    """1 document, 2 documents, 1,234 files: a count with its noun in the right number."""
    return f"{n:,} {noun if n == 1 else (plural or noun + 's')}"
