"""The inputs of data preparation, read as documents: text files, folders, .jsonl, `stdlib`.

`resolve_inputs` turns what the user named into file lists; `Documents` yields their text in a
deterministic order under an optional byte cap. Torch-free.
"""

from __future__ import annotations

import codecs
import json
import os
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from runner.data.manifest import DataError

__all__ = ["Documents", "Input", "no_documents_message", "resolve_inputs"]

_STDLIB_SKIP_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)
_SNIFF_BYTES = 8192


@dataclass
class Input:
    label: str  # as the user wrote it
    kind: str  # "stdlib" | "folder" | "file" | "jsonl"
    root: Path
    files: list[Path]
    documents: int = 0
    skipped: int = 0

    def describe(self) -> str:
        skipped = f", {self.skipped} non-text skipped" if self.skipped else ""
        if self.kind == "stdlib":
            what = f"Python stdlib .py files under {self.root}"
            return f"stdlib ({what}): {self.documents} of {len(self.files)} files{skipped}"
        if self.kind == "folder":
            return f"{self.label} (folder): {self.documents} of {len(self.files)} files{skipped}"
        if self.kind == "jsonl":
            return f"{self.label} (jsonl): {self.documents} documents"
        return f"{self.label} (text file): {self.documents} document"


def _walk_files(root: Path, skip_dir: Callable[[str], bool], exclude: Path | None) -> list[Path]:
    """All files under root in a deterministic (sorted, depth-first) order."""
    found = []
    for here, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not skip_dir(d))
        here_path = Path(here)
        if exclude is not None and here_path.resolve() == exclude:
            dirs[:] = []
            continue
        found.extend(here_path / f for f in sorted(files) if not f.startswith("."))
    return found


def _stdlib_files() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = _walk_files(root, lambda d: d in _STDLIB_SKIP_DIRS or d.startswith("."), exclude=None)
    return root, [f for f in files if f.suffix == ".py"]


def resolve_inputs(inputs: Sequence[str], exclude: Path) -> list[Input]:
    if not inputs:
        raise DataError(
            "no inputs given: pass text files, folders, .jsonl files, or `stdlib` "
            "(the Python standard library's sources, no download needed)"
        )
    resolved = []
    for item in inputs:
        item = str(item)
        path = Path(item)
        if item == "stdlib" and not path.exists():
            root, files = _stdlib_files()
            if not files:
                raise DataError(
                    f"input `stdlib`: found no .py files under {root}: this Python has no "
                    "standard library sources; pass text files or folders instead"
                )
            resolved.append(Input(item, "stdlib", root, files))
        elif path.is_dir():
            files = _walk_files(
                path, lambda d: d.startswith(".") or d == "__pycache__", exclude=exclude
            )
            if not files:
                raise DataError(f"input folder {item} has no files: pass a folder with text")
            resolved.append(Input(item, "folder", path, files))
        elif path.is_file():
            kind = "jsonl" if path.suffix == ".jsonl" else "file"
            resolved.append(Input(item, kind, path, [path]))
        else:
            raise DataError(
                f"input not found: {item}: pass existing text files, folders, .jsonl files, "
                "or `stdlib`"
            )
    return resolved


def _decode(data: bytes, truncated: bool) -> str:
    # A byte cap can cut a multi-byte character; the incremental decoder drops that partial tail.
    return codecs.getincrementaldecoder("utf-8")("replace").decode(data, final=not truncated)


def _is_text(head: bytes) -> bool:
    if b"\0" in head:
        return False
    try:
        codecs.getincrementaldecoder("utf-8")("strict").decode(head, final=False)
    except UnicodeDecodeError:
        return False
    return True


class Documents:
    """Iterates the documents of the inputs in order, honouring max_bytes; re-iterable.

    A document is one file (text files, folder members, stdlib) or one line of a .jsonl file.
    max_bytes caps the UTF-8 bytes of document text: the document that crosses the cap is cut
    and reading stops. Empty documents are skipped.
    """

    def __init__(self, inputs: list[Input], text_field: str, max_bytes: int | None):
        self.inputs = inputs
        self.text_field = text_field
        self.max_bytes = max_bytes
        self.bytes_read = 0

    def total_bytes_hint(self) -> int:
        total = sum(f.stat().st_size for i in self.inputs for f in i.files)
        return total if self.max_bytes is None else min(total, self.max_bytes)

    def __iter__(self) -> Iterator[tuple[str, int]]:
        self.bytes_read = 0
        for inp in self.inputs:
            inp.documents = inp.skipped = 0
        for inp in self.inputs:
            for path in inp.files:
                if self.max_bytes is not None and self.bytes_read >= self.max_bytes:
                    return
                if inp.kind == "jsonl" or (inp.kind == "folder" and path.suffix == ".jsonl"):
                    yield from self._jsonl(inp, path)
                else:
                    doc = self._text_file(inp, path)
                    if doc is not None:
                        yield doc

    def _budget(self) -> int | None:
        return None if self.max_bytes is None else self.max_bytes - self.bytes_read

    def _text_file(self, inp: Input, path: Path) -> tuple[str, int] | None:
        budget = self._budget()
        with open(path, "rb") as f:
            head = f.read(_SNIFF_BYTES)
            if not _is_text(head):
                if inp.kind == "file":
                    raise DataError(
                        f"input {path} is not a UTF-8 text file (binary content): pass text "
                        "files, folders, or .jsonl files"
                    )
                inp.skipped += 1
                return None
            rest = f.read() if budget is None else f.read(max(0, budget - len(head)))
            data = head + rest
            truncated = budget is not None and len(data) > budget
            if truncated:
                data = data[:budget]
            elif budget is not None and len(data) == budget:
                truncated = bool(f.read(1))
        text = _decode(data, truncated)
        nbytes = len(data)
        self.bytes_read += nbytes
        if not text:
            return None
        inp.documents += 1
        return text, nbytes

    def _jsonl(self, inp: Input, path: Path) -> Iterator[tuple[str, int]]:
        with open(path, encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(
                        f"{path}:{lineno} is not valid JSON ({e.msg}): each line of a .jsonl "
                        f"input must be one JSON object with a {self.text_field!r} field"
                    ) from e
                text = record.get(self.text_field) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise DataError(
                        f"{path}:{lineno} has no string field {self.text_field!r} (found "
                        f"{keys}): pass the right field name with --text-field"
                    )
                if not text:
                    continue
                try:
                    data = text.encode("utf-8")
                except UnicodeEncodeError:  # lone surrogates from \ud800-style JSON escapes
                    data = text.encode("utf-8", errors="replace")
                    text = data.decode("utf-8")
                budget = self._budget()
                if budget is not None and len(data) >= budget:
                    data = data[:budget]
                    text = _decode(data, truncated=True)
                self.bytes_read += len(data)
                if text:
                    inp.documents += 1
                    yield text, len(data)
                if budget is not None and self.bytes_read >= self.max_bytes:
                    return


def no_documents_message(resolved: list[Input], max_bytes: int | None) -> str:
    what = "; ".join(i.describe() for i in resolved)
    cap = f", or raise max_bytes={max_bytes}" if max_bytes is not None else ""
    return (
        f"the inputs hold no text documents ({what}): pass non-empty UTF-8 text files, "
        f"folders of them, or .jsonl files{cap}"
    )
