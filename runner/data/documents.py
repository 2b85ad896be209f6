"""The inputs of data preparation read as documents, loudly: nothing unreadable passes unseen.

`Documents` yields the text of every input's files in order under an optional byte cap, drops
empty and whitespace-only documents (counted), and treats a file it cannot read or that yields
no text as an error — or, with `skip_bad`, as a skipped file with a printed warning and a count.
Torch-free.
"""

from __future__ import annotations

import codecs
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from m3run.runner.data.inputs import Input
from m3run.runner.data.manifest import DataError
from m3run.runner.data.readers import BLANK_LINES, BadFile, read_file, record_text

__all__ = ["Documents", "no_documents_message"]

_SKIP_HINT = "pass --skip-bad to skip such files with a warning"


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _decode(data: bytes, truncated: bool) -> str:
    # A byte cap can cut a multi-byte character; the incremental decoder drops that partial tail.
    return codecs.getincrementaldecoder("utf-8")("replace").decode(data, final=not truncated)


class Documents:
    """Iterates (text, utf8 bytes, input index) over the inputs in order; re-iterable.

    A document is a file (folder and glob members), a record (JSON Lines, JSON arrays, parquet,
    Arrow, HF datasets), or a part of a lone text file cut at `separator` (BLANK_LINES: one or
    more blank lines; None: the whole file). max_bytes caps the UTF-8 bytes of document text:
    the document that crosses the cap is cut and reading stops.
    """

    def __init__(
        self,
        inputs: list[Input],
        max_bytes: int | None,
        separator: str | None = BLANK_LINES,
        skip_bad: bool = False,
        warn: Callable[[str], None] = _stderr,
    ):
        self.inputs = inputs
        self.max_bytes = max_bytes
        self.separator = separator
        self.skip_bad = skip_bad
        self.warn = warn
        self.bytes_read = 0
        self._warned: set[str] = set()  # a BPE run reads the inputs twice, warns once

    def total_bytes_hint(self) -> int | None:
        """The bytes a progress bar can count to: only plain files give an honest total."""
        if any(i.kind == "hf" for i in self.inputs):
            return None
        total = sum(f.stat().st_size for i in self.inputs for f in i.files)
        return total if self.max_bytes is None else min(total, self.max_bytes)

    @property
    def capped(self) -> bool:
        return self.max_bytes is not None and self.bytes_read >= self.max_bytes

    def __iter__(self) -> Iterator[tuple[str, int, int]]:
        self.bytes_read = 0
        for inp in self.inputs:
            inp.documents = inp.tokens = inp.empty = 0
            inp.skipped = []
        for index, inp in enumerate(self.inputs):
            if self.capped:
                return
            if inp.kind == "hf":
                texts = _hf_texts(inp)
                yield from self._documents(index, inp, texts, inp.root)
                continue
            for path in inp.files:
                if self.capped:
                    return
                separator = self.separator if inp.split_text else None
                texts = read_file(path, inp.text_field, separator)
                yield from self._documents(index, inp, texts, path)

    def _documents(
        self, index: int, inp: Input, texts: Iterator[str | None], path: Path
    ) -> Iterator[tuple[str, int, int]]:
        found = 0
        try:
            for text in texts:
                doc = self._take(inp, text)
                if doc is not None:
                    found += 1
                    yield doc[0], doc[1], index
                if self.capped:
                    return
        except BadFile as e:
            self._bad(inp, e, found)
            return
        if found == 0:
            reason = "yields no text (empty, or only empty, whitespace or null records)"
            self._bad(inp, BadFile(path, reason), 0)

    def _take(self, inp: Input, text: str | None) -> tuple[str, int] | None:
        if text is None or not text.strip():
            inp.empty += 1
            return None
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates from \ud800-style JSON escapes
            data = text.encode("utf-8", errors="replace")
            text = data.decode("utf-8")
        if self.max_bytes is not None and len(data) >= self.max_bytes - self.bytes_read:
            data = data[: self.max_bytes - self.bytes_read]
            text = _decode(data, truncated=True)
        self.bytes_read += len(data)
        if not text:
            return None
        inp.documents += 1
        return text, len(data)

    def _bad(self, inp: Input, err: BadFile, found: int) -> None:
        after = f" (after {found} documents from it)" if found else ""
        if inp.kind == "stdlib":  # the built-in demo corpus: its empty __init__.py files
            inp.skipped.append((str(err.path), err.reason))
            return
        if not self.skip_bad:
            raise DataError(f"input file {err.message()}: fix or remove the file, or {_SKIP_HINT}")
        inp.skipped.append((str(err.path), err.reason))
        if str(err.path) not in self._warned:
            self._warned.add(str(err.path))
            self.warn(f"warning: skipping {err.path} ({err.reason}){after}")


def _hf_texts(inp: Input) -> Iterator[str | None]:
    """The records of a local dataset folder through `datasets.load_dataset` (the hf extra)."""
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"input {inp.label} needs the optional `datasets` library, which is not installed: "
            "pip install 'm3run[hf]' — or pass the folder's parquet/jsonl files directly, or a "
            "folder written by save_to_disk, which need no extra"
        ) from None
    try:
        loaded = datasets.load_dataset(str(inp.root), streaming=True)
        splits = list(loaded.items()) if isinstance(loaded, dict) else [("all", loaded)]
    # datasets raises its own error types, ValueError and FileNotFoundError for folders it
    # cannot make a dataset of; each becomes the same message naming the folder.
    except Exception as e:
        raise DataError(
            f"input {inp.label}: `datasets` cannot load {inp.root} ({type(e).__name__}: {e}): "
            "pass a folder of data files datasets can read, or the files themselves"
        ) from e
    for split, ds in splits:
        for i, record in enumerate(ds):
            yield record_text(record, inp.text_field, f"split {split} record {i}", inp.root)


def no_documents_message(resolved: list[Input], max_bytes: int | None) -> str:
    what = "; ".join(i.describe() for i in resolved)
    cap = f", or raise max_bytes={max_bytes}" if max_bytes is not None else ""
    return f"the inputs hold no text documents ({what}): pass inputs that have text{cap}"
