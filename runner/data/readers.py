"""Readers of one input file each: the texts it holds, through the library that owns the format.

Plain text (one document, or split into documents by blank lines or a separator), JSON Lines,
JSON arrays of records, parquet and Arrow (pyarrow), each optionally gzip- or zstd-compressed
where the format allows. A reader yields `str` texts, or None for a record whose text is null.
A file it cannot read raises `BadFile` with the reason; the caller decides whether that stops
preparation or skips the file. Torch-free.
"""

from __future__ import annotations

import codecs
import gzip
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

__all__ = [
    "BLANK_LINES",
    "BadFile",
    "file_format",
    "get_field",
    "read_file",
    "record_text",
]

BLANK_LINES = "blank"  # the default document separator of a split text file: ≥1 blank line
_SNIFF_BYTES = 8192
_TEXT_CHUNK = 1 << 20
_COMPRESSIONS = (".gz", ".zst")
# File signatures, so a file with an unhelpful name is still read by what it holds.
_MAGIC = (
    (b"PAR1", "parquet"),
    (b"ARROW1", "arrow"),
    (b"\xff\xff\xff\xff", "arrow"),  # an Arrow IPC stream (what `save_to_disk` writes)
)
_MAGIC_COMPRESSION = ((b"\x1f\x8b", ".gz"), (b"\x28\xb5\x2f\xfd", ".zst"))
_RECORD_BATCH_ROWS = 1024
_VERBS = ("is", "has", "yields", "cannot")


class BadFile(Exception):
    """An input file that cannot be read as documents; `reason` says why."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason

    def message(self) -> str:
        """`<path> is not ...` or `<path>: line 3 ...`, whichever reads as a sentence."""
        verb = self.reason.split(" ", 1)[0]
        return f"{self.path}{' ' if verb in _VERBS else ': '}{self.reason}"


def _split_compression(path: Path) -> tuple[str, str | None]:
    name = path.name.lower()
    for ext in _COMPRESSIONS:
        if name.endswith(ext):
            return name[: -len(ext)], ext
    return name, None


def file_format(path: Path) -> tuple[str, str | None]:
    """(format, compression) of a file: format is text, jsonl, json, parquet or arrow.

    By the name first (`x.jsonl.zst` is zstd-compressed JSON Lines); a name that says nothing
    (`x.bin`, `part-0`) is read by its signature, and anything else is taken as text, which
    the text reader then checks.
    """
    name, compression = _split_compression(path)
    if name.endswith((".jsonl", ".ndjson")):
        return "jsonl", compression
    if name.endswith(".json"):
        return "json", compression
    if compression is None and name.endswith(".parquet"):
        return "parquet", None
    if compression is None and name.endswith((".arrow", ".feather")):
        return "arrow", None
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise BadFile(path, f"cannot be read ({e.strerror})") from e
    if compression is None:
        for magic, fmt in _MAGIC:
            if head.startswith(magic):
                return fmt, None
        for magic, ext in _MAGIC_COMPRESSION:
            if head.startswith(magic):
                return "text", ext
    return "text", compression


def _open_binary(path: Path, compression: str | None) -> IO[bytes]:
    if compression == ".gz":
        return gzip.open(path, "rb")
    if compression == ".zst":
        import zstandard

        return zstandard.open(path, "rb")
    return open(path, "rb")


def _open_text(path: Path, compression: str | None) -> IO[str]:
    return io.TextIOWrapper(_open_binary(path, compression), encoding="utf-8", errors="replace")


_DECOMPRESS_ERRORS: tuple[type[BaseException], ...] = (EOFError, gzip.BadGzipFile, OSError)


def _decompress_errors(compression: str | None) -> tuple[type[BaseException], ...]:
    """What reading a file of this compression raises for a damaged file. Evaluated before the
    read starts: an `except` clause's expression also runs when the reader generator is closed
    early, and an import there would fail the close."""
    if compression != ".zst":
        return _DECOMPRESS_ERRORS
    import zstandard

    return (*_DECOMPRESS_ERRORS, zstandard.ZstdError)


def get_field(record: Any, field: str) -> Any:
    """record[field], where a dotted field (`meta.text`) walks nested objects.

    A key that itself contains the dots wins, so `{"meta.text": ...}` is read as written.
    Raises KeyError naming what was there when the field is missing.
    """
    if isinstance(record, dict) and field in record:
        return record[field]
    value = record
    for i, part in enumerate(field.split(".")):
        if not isinstance(value, dict) or part not in value:
            where = ".".join(field.split(".")[:i]) or "the record"
            found = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise KeyError(f"no field {field!r} ({where} holds {found})")
        value = value[part]
    return value


def record_text(record: Any, field: str, where: str, path: Path) -> str | None:
    if isinstance(record, str):
        return record
    try:
        text = get_field(record, field)
    except KeyError as e:
        raise BadFile(
            path,
            f"{where} has {e.args[0]}: name the text field with `{path}:<field>` or "
            "--text-field (nested fields as meta.text)",
        ) from None
    if text is None or isinstance(text, str):
        return text
    raise BadFile(path, f"{where} field {field!r} is a {type(text).__name__}, not a string")


def _is_text(head: bytes) -> bool:
    if b"\0" in head:
        return False
    try:
        codecs.getincrementaldecoder("utf-8")("strict").decode(head, final=False)
    except UnicodeDecodeError:
        return False
    return True


def _text(path: Path, compression: str | None, separator: str | None) -> Iterator[str]:
    with _open_binary(path, compression) as f:
        head = f.read(_SNIFF_BYTES)
    if not _is_text(head):
        raise BadFile(
            path,
            "is not recognised: binary content that is not UTF-8 text, JSON, parquet or Arrow",
        )
    with _open_text(path, compression) as f:
        if separator is None:
            yield f.read()
        elif separator == BLANK_LINES:
            lines: list[str] = []
            for line in f:
                if line.strip():
                    lines.append(line)
                elif lines:
                    yield "".join(lines)
                    lines = []
            if lines:
                yield "".join(lines)
        else:
            rest = ""
            while chunk := f.read(_TEXT_CHUNK):
                *docs, rest = (rest + chunk).split(separator)
                yield from docs
            yield rest


def _jsonl(path: Path, compression: str | None, field: str) -> Iterator[str | None]:
    with _open_text(path, compression) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise BadFile(
                    path,
                    f"line {lineno} is not valid JSON ({e.msg}): each line of JSON Lines must "
                    f"be one JSON object with a {field!r} field",
                ) from e
            if not isinstance(record, dict):
                raise BadFile(
                    path, f"line {lineno} is a JSON {type(record).__name__}, not an object"
                )
            yield record_text(record, field, f"line {lineno}", path)


def _json(path: Path, compression: str | None, field: str) -> Iterator[str | None]:
    with _open_text(path, compression) as f:
        first = f.read(_SNIFF_BYTES).lstrip()[:1]
    if first == "{":
        # `Dataset.to_json` and many exporters write JSON Lines under a .json name.
        with _open_text(path, compression) as f:
            line = f.readline()
        try:
            json.loads(line)
        except json.JSONDecodeError:
            raise BadFile(
                path,
                "is one JSON object, not records: a .json input must be an array of "
                "records or JSON Lines (one object per line)",
            ) from None
        yield from _jsonl(path, compression, field)
        return
    if first != "[":
        raise BadFile(path, "is not a JSON array of records nor JSON Lines")
    with _open_text(path, compression) as f:
        try:
            records = json.load(f)
        except json.JSONDecodeError as e:
            raise BadFile(path, f"is not valid JSON ({e.msg} at line {e.lineno})") from e
    for i, record in enumerate(records):
        if not isinstance(record, dict | str):
            raise BadFile(path, f"element {i} is a JSON {type(record).__name__}, not a record")
        yield record_text(record, field, f"element {i}", path)


def _column_texts(batches: Iterator[Any], schema: Any, field: str, path: Path) -> Iterator[Any]:
    """The string values of `field` (dotted: a struct's child) over Arrow record batches."""
    import pyarrow as pa
    import pyarrow.compute as pc

    parts = [field] if field in schema.names else field.split(".")
    if parts[0] not in schema.names:
        raise BadFile(
            path,
            f"has no column {field!r} (columns: {', '.join(schema.names)}): name the text "
            f"column with `{path}:<column>` or --text-field (struct children as meta.text)",
        )
    for batch in batches:
        column = batch.column(batch.schema.get_field_index(parts[0]))
        try:
            for child in parts[1:]:
                column = pc.struct_field(column, child)
        except (pa.ArrowInvalid, pa.ArrowTypeError, KeyError, TypeError) as e:
            raise BadFile(path, f"column {field!r} cannot be read ({e})") from None
        if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
            raise BadFile(path, f"column {field!r} holds {column.type}, not strings")
        yield from column.to_pylist()


def _parquet(path: Path, field: str) -> Iterator[str | None]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        schema = pf.schema_arrow
    except (pa.ArrowInvalid, OSError) as e:
        raise BadFile(path, f"is not a readable parquet file ({e})") from e
    top = field if field in schema.names else field.split(".")[0]
    columns = [top] if top in schema.names else []
    batches = pf.iter_batches(batch_size=_RECORD_BATCH_ROWS, columns=columns)
    try:
        yield from _column_texts(batches, schema, field, path)
    except (pa.ArrowInvalid, OSError) as e:
        raise BadFile(path, f"is a corrupt parquet file ({e})") from e


def _arrow(path: Path, field: str) -> Iterator[str | None]:
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        try:
            reader = pa.ipc.open_stream(source)
            batches = iter(reader)
        except pa.ArrowInvalid:
            try:
                file_reader = pa.ipc.open_file(source)
            except pa.ArrowInvalid as e:
                raise BadFile(path, f"is not a readable Arrow IPC file or stream ({e})") from e
            reader = file_reader
            batches = (file_reader.get_batch(i) for i in range(file_reader.num_record_batches))
        try:
            yield from _column_texts(batches, reader.schema, field, path)
        except pa.ArrowInvalid as e:
            raise BadFile(path, f"is a corrupt Arrow file ({e})") from e


def read_file(path: Path, field: str, separator: str | None) -> Iterator[str | None]:
    """The texts in one file. `separator` (text files only): None keeps the file whole,
    BLANK_LINES splits at blank lines, any other string splits at that string."""
    fmt, compression = file_format(path)
    readers = {
        "text": lambda: _text(path, compression, separator),
        "jsonl": lambda: _jsonl(path, compression, field),
        "json": lambda: _json(path, compression, field),
        "parquet": lambda: _parquet(path, field),
        "arrow": lambda: _arrow(path, field),
    }
    damaged = _decompress_errors(compression)
    try:
        yield from readers[fmt]()
    except BadFile:
        raise
    except damaged as e:
        raise BadFile(path, f"cannot be read or decompressed ({type(e).__name__}: {e})") from e
