"""Token data: `prepare_data` turns text into token shards; `BatchLoader` streams batches from them.

On-disk layout written by `prepare_data` and read by everything else in this module:

    <out_dir>/
      tokenizer.json       only for `bpe:<vocab_size>`: the trained tokenizer, reusable by path
      train/   manifest.json   shard_00000.bin   shard_00001.bin   ...
      val/     manifest.json   shard_00000.bin   ...

A shard is raw little-endian uint16 (vocab ≤ 65535) or uint32 token ids. The shards of a split,
read in manifest order, form one token stream in which every document is followed by EOS. The
manifest is written last, so a split directory without one is an interrupted preparation.

Training reads that stream as windows of seq_len+1 tokens at stride seq_len (inputs and shifted
targets), in an order shuffled per epoch from the seed. The loader's position is a single
world-size independent integer, the number of windows consumed globally, so it goes into the
checkpoint and a resumed run sees exactly the batches the uninterrupted run would have seen.

Torch is imported lazily: preparing data needs only numpy and the tokenizer libraries.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import logging
import os
import queue
import sys
import sysconfig
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from runner.files import atomic_write_text, sha256_file

if TYPE_CHECKING:
    import torch

__all__ = [
    "EOS_TEXT",
    "FORMAT_VERSION",
    "BatchLoader",
    "DataError",
    "TokenWindows",
    "Tokenizer",
    "check_vocab",
    "eval_batches",
    "load_manifest",
    "load_tokenizer",
    "prepare_data",
]

log = logging.getLogger(__name__)

FORMAT = "m3run-tokens"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
SPLITS = ("train", "val")
EOS_TEXT = "<|endoftext|>"
# EOS names tried, in order, when a HF tokenizer.json is given by path.
EOS_CANDIDATES = (EOS_TEXT, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]")
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_REQUIRED_KEYS = (
    "format_version",
    "tokenizer",
    "vocab_size",
    "eos_id",
    "dtype",
    "shards",
    "total_tokens",
    "num_documents",
)
# tiktoken caches each downloaded file under sha1(url) in $TIKTOKEN_CACHE_DIR; these are the two
# files its `gpt2` encoding reads (tiktoken_ext/openai_public.py).
_GPT2_FILES = (
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
)
_STDLIB_SKIP_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)
_SNIFF_BYTES = 8192
# Work unit sent to a tokenizer process: large enough to amortise pickling, small enough to
# keep every worker busy and memory bounded.
_CHUNK_BYTES = 1 << 20
_CHUNK_DOCS = 1024


class DataError(ValueError):
    """Missing, corrupt or unusable training data. User-facing; the worker exits with 78."""


def _prepare_hint(out_dir: Path | str) -> str:
    return f"run `m3run prepare-data <inputs> --out {out_dir}`"


# --------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------


class Tokenizer:
    """A loaded tokenizer with the few operations data preparation needs.

    `kind` is "tiktoken" (source: an encoding name, only "gpt2") or "hf" (source: the path of a
    HF `tokenizer.json`). Text that happens to contain a special token's string (for example a
    literal "<|endoftext|>") is encoded as plain text: EOS only ever separates documents.
    """

    def __init__(self, kind: str, source: str, backend: Any, vocab_size: int, eos_id: int):
        self.kind = kind
        self.source = source
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self._backend = backend

    @classmethod
    def load(cls, kind: str, source: str) -> Tokenizer:
        if kind == "tiktoken":
            return cls._load_tiktoken(source)
        if kind == "hf":
            return cls._load_hf(source)
        raise DataError(f"unknown tokenizer kind {kind!r}: expected 'tiktoken' or 'hf'")

    @classmethod
    def _load_tiktoken(cls, name: str) -> Tokenizer:
        if name != "gpt2":
            raise DataError(
                f"unsupported tiktoken encoding {name!r}: only 'gpt2' is supported; "
                "pass a tokenizer.json path or bpe:<vocab_size> for anything else"
            )
        import tiktoken

        try:
            enc = tiktoken.get_encoding(name)
        # tiktoken downloads on first use; offline it raises requests, urllib or OS errors
        # depending on the version, so every failure becomes the same actionable message.
        except Exception as e:
            raise DataError(_tiktoken_offline_message(e)) from e
        return cls("tiktoken", name, enc, enc.n_vocab, enc.eot_token)

    @classmethod
    def _load_hf(cls, path: str) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        if not Path(path).is_file():
            raise DataError(
                f"tokenizer file not found: {path}: pass the path of a HF tokenizer.json, "
                "`gpt2`, or `bpe:<vocab_size>`"
            )
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception for malformed files
            raise DataError(
                f"cannot read tokenizer file {path} ({e}): it must be a HF tokenizer.json "
                "(as saved by `tokenizers`), e.g. the one a `bpe:<vocab_size>` run saved"
            ) from e
        tok.encode_special_tokens = True
        vocab = tok.get_vocab(with_added_tokens=True)
        if not vocab:
            raise DataError(f"tokenizer file {path} has an empty vocabulary: use another one")
        eos_id = next((vocab[name] for name in EOS_CANDIDATES if name in vocab), None)
        if eos_id is None:
            raise DataError(
                f"tokenizer file {path} has no end-of-text token (looked for "
                f"{', '.join(EOS_CANDIDATES)}): add {EOS_TEXT!r} as a special token, "
                "or use `bpe:<vocab_size>` which adds one"
            )
        return cls("hf", str(path), tok, max(vocab.values()) + 1, eos_id)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if self.kind == "tiktoken":
            return [self._backend.encode_ordinary(t) for t in texts]
        return [e.ids for e in self._backend.encode_batch(list(texts), add_special_tokens=False)]

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        if self.kind == "tiktoken":
            return self._backend.decode(ids)
        return self._backend.decode(ids, skip_special_tokens=False)


def _tiktoken_offline_message(err: BaseException) -> str:
    names = ", ".join(
        f"{url.rsplit('/', 1)[1]} as {hashlib.sha1(url.encode()).hexdigest()}"
        for url in _GPT2_FILES
    )
    detail = f"{type(err).__name__}: {err}"[:300]
    return (
        f"could not load tiktoken's `gpt2` encoding ({detail}). tiktoken downloads it on first "
        "use and this machine cannot. Provide the encoding files: on a machine with network "
        'access run `TIKTOKEN_CACHE_DIR=<dir> python -c "import tiktoken; '
        "tiktoken.get_encoding('gpt2')\"`, copy <dir> here and set TIKTOKEN_CACHE_DIR=<dir> "
        f"(the folder must hold {names}, downloaded from {' and '.join(_GPT2_FILES)}). "
        "Or pick an offline tokenizer: --tokenizer path/to/tokenizer.json or "
        "--tokenizer bpe:<vocab_size>"
    )


def _train_bpe(texts: Iterable[str], vocab_size: int, path: Path) -> None:
    """Train a byte-level BPE with `<|endoftext|>` (id 0) as EOS; save it as tokenizer.json."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tmp = path.with_name(path.name + ".tmp")
    tok.save(str(tmp))
    os.replace(tmp, path)


def load_tokenizer(split_dir: str | Path) -> Tokenizer:
    """The tokenizer a prepared split was made with (e.g. to decode samples)."""
    split_dir = Path(split_dir)
    spec = load_manifest(split_dir)["tokenizer"]
    kind, source = spec.get("kind"), spec.get("path") or spec.get("name")
    if kind == "hf":
        source = str((split_dir / source).resolve())
    return Tokenizer.load(kind, source)


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


@dataclass
class _Input:
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


def _resolve_inputs(inputs: Sequence[str], exclude: Path) -> list[_Input]:
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
            resolved.append(_Input(item, "stdlib", root, files))
        elif path.is_dir():
            files = _walk_files(
                path, lambda d: d.startswith(".") or d == "__pycache__", exclude=exclude
            )
            if not files:
                raise DataError(f"input folder {item} has no files: pass a folder with text")
            resolved.append(_Input(item, "folder", path, files))
        elif path.is_file():
            kind = "jsonl" if path.suffix == ".jsonl" else "file"
            resolved.append(_Input(item, kind, path, [path]))
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


class _Documents:
    """Iterates the documents of the inputs in order, honouring max_bytes; re-iterable.

    A document is one file (text files, folder members, stdlib) or one line of a .jsonl file.
    max_bytes caps the UTF-8 bytes of document text: the document that crosses the cap is cut
    and reading stops. Empty documents are skipped.
    """

    def __init__(self, inputs: list[_Input], text_field: str, max_bytes: int | None):
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

    def _text_file(self, inp: _Input, path: Path) -> tuple[str, int] | None:
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

    def _jsonl(self, inp: _Input, path: Path) -> Iterator[tuple[str, int]]:
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


def _chunks(docs: Iterable[tuple[str, int]]) -> Iterator[tuple[list[str], int]]:
    texts: list[str] = []
    size = 0
    for text, nbytes in docs:
        texts.append(text)
        size += nbytes
        if size >= _CHUNK_BYTES or len(texts) >= _CHUNK_DOCS:
            yield texts, size
            texts, size = [], 0
    if texts:
        yield texts, size


# --------------------------------------------------------------------------------------------
# Tokenising (in this process or in a pool of processes)
# --------------------------------------------------------------------------------------------


@dataclass
class _Encoded:
    hashes: list[int]  # first 8 bytes of sha1(document), big-endian: the split key
    lengths: np.ndarray  # tokens per document, EOS included
    tokens: np.ndarray  # the documents' tokens, each followed by EOS
    nbytes: int


def _encode_chunk(tok: Tokenizer, texts: list[str], dtype: np.dtype, nbytes: int) -> _Encoded:
    ids = tok.encode_batch(texts)
    lengths = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
    flat = np.empty(int(lengths.sum()), dtype=np.uint32)
    pos = 0
    for seq in ids:
        flat[pos : pos + len(seq)] = seq
        flat[pos + len(seq)] = tok.eos_id
        pos += len(seq) + 1
    if flat.size and int(flat.max()) >= tok.vocab_size:
        raise DataError(
            f"tokenizer {tok.source} produced id {int(flat.max())} ≥ its vocabulary size "
            f"{tok.vocab_size}: the tokenizer file is inconsistent; use another tokenizer"
        )
    hashes = [int.from_bytes(hashlib.sha1(t.encode("utf-8")).digest()[:8], "big") for t in texts]
    return _Encoded(hashes, lengths, flat.astype(dtype), nbytes)


_WORKER_TOKENIZER: Tokenizer | None = None


def _init_worker(kind: str, source: str) -> None:
    global _WORKER_TOKENIZER
    # One tokeniser thread per process: the pool already uses every core.
    os.environ["RAYON_NUM_THREADS"] = "1"
    _WORKER_TOKENIZER = Tokenizer.load(kind, source)


def _encode_in_worker(texts: list[str], dtype_name: str, nbytes: int) -> _Encoded:
    assert _WORKER_TOKENIZER is not None, "worker initializer did not run"
    return _encode_chunk(_WORKER_TOKENIZER, texts, _DTYPES[dtype_name], nbytes)


def _encode_all(
    tok: Tokenizer, docs: Iterable[tuple[str, int]], dtype_name: str, workers: int
) -> Iterator[_Encoded]:
    """Encoded chunks in input order. A bounded window of in-flight chunks keeps memory flat."""
    if workers <= 1:
        for texts, nbytes in _chunks(docs):
            yield _encode_chunk(tok, texts, _DTYPES[dtype_name], nbytes)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn, not fork: the parent may already run tokenizer threads (BPE training), and a fork
    # taken while those hold locks can deadlock the child.
    ctx = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(
        workers, mp_context=ctx, initializer=_init_worker, initargs=(tok.kind, tok.source)
    )
    try:
        pending: deque = deque()
        for texts, nbytes in _chunks(docs):
            pending.append(pool.submit(_encode_in_worker, texts, dtype_name, nbytes))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# --------------------------------------------------------------------------------------------
# Writing shards
# --------------------------------------------------------------------------------------------


class _ShardWriter:
    """Appends tokens to fixed-size shard files, written as `<name>.bin<suffix>` temporaries."""

    def __init__(self, directory: Path, dtype: np.dtype, shard_tokens: int, suffix: str):
        self.directory = directory
        self.dtype = dtype
        self.shard_tokens = shard_tokens
        self.suffix = suffix
        self.shards: list[dict] = []  # {"tmp", "tokens", "sha256"}
        self.total_tokens = 0
        self.num_documents = 0
        self._fh = None
        self._sha = None
        self._count = 0

    def write(self, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens, dtype=self.dtype)
        while tokens.size:
            if self._fh is None:
                tmp = self.directory / f"shard_{len(self.shards):05d}.bin{self.suffix}"
                self._fh = open(tmp, "wb")  # noqa: SIM115 (held open across write() calls)
                self._sha, self._count = hashlib.sha256(), 0
                self.shards.append({"tmp": tmp, "tokens": 0, "sha256": ""})
            part = tokens[: self.shard_tokens - self._count]
            data = part.tobytes()
            self._fh.write(data)
            self._sha.update(data)
            self._count += part.size
            self.total_tokens += part.size
            tokens = tokens[part.size :]
            if self._count == self.shard_tokens:
                self._close_shard()

    def _close_shard(self) -> None:
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        self.shards[-1].update(tokens=self._count, sha256=self._sha.hexdigest())
        self._fh = None

    def close(self) -> None:
        if self._fh is not None:
            self._close_shard()

    def discard(self) -> None:
        self.close()
        for s in self.shards:
            s["tmp"].unlink(missing_ok=True)


def _read_range(shards: list[dict], dtype: np.dtype, start: int, stop: int) -> Iterator[np.ndarray]:
    """Pieces of tokens [start, stop) of the stream formed by the (temporary) shards."""
    offset = 0
    for s in shards:
        lo, hi = max(start, offset), min(stop, offset + s["tokens"])
        if lo < hi:
            yield np.fromfile(
                s["tmp"], dtype=dtype, count=hi - lo, offset=(lo - offset) * dtype.itemsize
            )
        offset += s["tokens"]


def _move_document(
    src: _ShardWriter, dst: _ShardWriter, start: int, length: int, suffix: str
) -> _ShardWriter:
    """Move the document at [start, start+length) of src into dst; returns src rewritten."""
    for piece in _read_range(src.shards, src.dtype, start, start + length):
        dst.write(piece)
    dst.num_documents += 1
    dst.close()
    rewritten = _ShardWriter(src.directory, src.dtype, src.shard_tokens, suffix)
    for lo, hi in ((0, start), (start + length, src.total_tokens)):
        # Copy in shard-sized pieces so memory stays bounded by one shard.
        for piece_start in range(lo, hi, src.shard_tokens):
            piece_stop = min(hi, piece_start + src.shard_tokens)
            for piece in _read_range(src.shards, src.dtype, piece_start, piece_stop):
                rewritten.write(piece)
    rewritten.num_documents = src.num_documents - 1
    rewritten.close()
    src.discard()
    return rewritten


def _publish(split_dir: Path, writer: _ShardWriter, manifest: dict) -> None:
    names = []
    for i, s in enumerate(writer.shards):
        name = f"shard_{i:05d}.bin"
        os.replace(s["tmp"], split_dir / name)
        names.append(name)
    for stale in split_dir.glob("shard_*.bin"):
        if stale.name not in names:
            stale.unlink()
    atomic_write_text(split_dir / MANIFEST_NAME, json.dumps(manifest, indent=2) + "\n")


# --------------------------------------------------------------------------------------------
# prepare_data
# --------------------------------------------------------------------------------------------


@dataclass
class _Candidate:
    """The document that moves split if the other split would otherwise be empty."""

    key: int = -1
    start: int = 0
    length: int = 0
    found: bool = False

    def offer(self, key: int, start: int, length: int) -> None:
        if not self.found or key < self.key:
            self.key, self.start, self.length, self.found = key, start, length, True


@dataclass
class _Progress:
    enabled: bool
    _bar: Any = None
    _task: Any = None

    def __enter__(self) -> _Progress:
        if self.enabled:
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
        if self._bar is not None:
            self._task = self._bar.add_task(description, total=total)

    def done(self) -> None:
        if self._bar is not None and self._task is not None:
            total = self._bar.tasks[-1].total or 1
            self._bar.update(self._task, total=total, completed=total)

    def advance(self, n: int) -> None:
        if self._bar is not None and self._task is not None:
            self._bar.advance(self._task, n)

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)


def _parse_bpe_spec(spec: str) -> int:
    try:
        n = int(spec.split(":", 1)[1])
    except ValueError:
        n = -1
    if n < 257:
        raise DataError(
            f"bad tokenizer spec {spec!r}: bpe:<vocab_size> needs an integer vocab_size ≥ 257 "
            "(256 bytes plus EOS), e.g. bpe:8192"
        )
    return n


def prepare_data(
    inputs: list[str],
    out_dir: str | Path,
    tokenizer: str = "gpt2",
    val_fraction: float = 0.005,
    text_field: str = "text",
    shard_tokens: int = 50_000_000,
    workers: int | None = None,
    max_bytes: int | None = None,
    progress: bool = True,
) -> dict:
    """Tokenise `inputs` into `out_dir/train` and `out_dir/val` token shards; returns a summary.

    inputs: text files (one document each), folders (every UTF-8 text file below, recursively,
      hidden entries skipped; `.jsonl` members read as jsonl), `.jsonl` files (one document per
      line, text in `text_field`), or `stdlib` (this Python's standard library .py sources,
      test directories and site-packages skipped) for a download-free demo corpus.
    tokenizer: "gpt2" (tiktoken), the path of a HF tokenizer.json, or "bpe:<vocab_size>" to
      train a byte-level BPE on the inputs, saved as out_dir/tokenizer.json with an
      `<|endoftext|>` EOS.
    val_fraction: a document goes to val when sha1(document) read as a fraction of 2**64 is
      below it, so the split depends on content only (not order, not workers).
    The shard bytes are identical for any `workers`. `max_bytes` caps the document text read.
    """
    started = time.monotonic()
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction={val_fraction} is out of range: use 0 ≤ val_fraction < 1")
    if shard_tokens < 1:
        raise DataError(f"shard_tokens={shard_tokens} must be ≥ 1 (default 50_000_000)")
    if max_bytes is not None and max_bytes < 1:
        raise DataError(f"max_bytes={max_bytes} must be ≥ 1, or None for no cap")
    if workers is None:
        workers = min(os.cpu_count() or 1, 8)
    if workers < 1:
        raise DataError(f"workers={workers} must be ≥ 1")

    out = Path(out_dir)
    resolved = _resolve_inputs(inputs, exclude=out.resolve())
    docs = _Documents(resolved, text_field, max_bytes)
    notes: list[str] = []

    # Load a ready-made tokenizer before touching out_dir, so a failure leaves old data intact.
    tok: Tokenizer | None = None
    bpe_size = None
    if tokenizer.startswith("bpe:"):
        bpe_size = _parse_bpe_spec(tokenizer)
    elif tokenizer == "gpt2":
        tok = Tokenizer.load("tiktoken", "gpt2")
    elif tokenizer.endswith(".json") or Path(tokenizer).is_file():
        tok = Tokenizer.load("hf", str(Path(tokenizer).resolve()))
    else:
        raise DataError(
            f"unknown tokenizer {tokenizer!r}: use `gpt2`, a path to a HF tokenizer.json, "
            "or `bpe:<vocab_size>` (e.g. bpe:8192)"
        )

    out.mkdir(parents=True, exist_ok=True)
    split_dirs = {s: out / s for s in SPLITS}
    for d in split_dirs.values():
        d.mkdir(exist_ok=True)
        # The manifest goes first: until the new one is written the split reads as incomplete.
        (d / MANIFEST_NAME).unlink(missing_ok=True)
        for tmp in d.glob("*.tmp"):
            tmp.unlink()

    show = progress and sys.stderr.isatty()
    total_bytes = docs.total_bytes_hint() if show else None
    with _Progress(show) as bar:
        if bpe_size is not None:
            bar.phase(f"training bpe:{bpe_size}", total_bytes)
            tok_path = out / "tokenizer.json"
            _train_bpe((text for text, _ in docs), bpe_size, tok_path)
            bar.done()
            if docs.bytes_read == 0:
                raise DataError(_no_documents_message(resolved, max_bytes))
            tok = Tokenizer.load("hf", str(tok_path))
            tok_record = {
                "spec": tokenizer,
                "kind": "hf",
                "path": "../tokenizer.json",  # relative to the manifest's directory
                "sha256": sha256_file(tok_path),
            }
            if tok.vocab_size < bpe_size:
                notes.append(
                    f"bpe:{bpe_size} learned only {tok.vocab_size} tokens: the corpus is small"
                )
        elif tok.kind == "hf":
            tok_record = {
                "spec": tokenizer,
                "kind": "hf",
                "path": tok.source,
                "sha256": sha256_file(Path(tok.source)),
            }
        else:
            tok_record = {"spec": tokenizer, "kind": "tiktoken", "name": tok.source}
        log.info("tokenizer %s: vocab %d, eos %d", tokenizer, tok.vocab_size, tok.eos_id)

        dtype_name = "uint16" if tok.vocab_size <= 65535 else "uint32"
        dtype = _DTYPES[dtype_name]
        writers = {s: _ShardWriter(split_dirs[s], dtype, shard_tokens, ".tmp") for s in SPLITS}
        # Fallbacks when a split ends up empty: the train document nearest the val threshold
        # (smallest key) or the val document farthest below it (largest key, stored negated).
        train_cand, val_cand = _Candidate(), _Candidate()
        bar.phase("tokenising", total_bytes)
        try:
            for chunk in _encode_all(tok, docs, dtype_name, workers):
                ends = np.cumsum(chunk.lengths)
                for i, key in enumerate(chunk.hashes):
                    lo, hi = int(ends[i] - chunk.lengths[i]), int(ends[i])
                    split = "val" if key / 2**64 < val_fraction else "train"
                    w = writers[split]
                    if split == "train":
                        train_cand.offer(key, w.total_tokens, hi - lo)
                    else:
                        val_cand.offer(-key, w.total_tokens, hi - lo)
                    w.write(chunk.tokens[lo:hi])
                    w.num_documents += 1
                bar.advance(chunk.nbytes)
            for w in writers.values():
                w.close()
            n_docs = writers["train"].num_documents + writers["val"].num_documents
            if n_docs == 0:
                raise DataError(_no_documents_message(resolved, max_bytes))

            train, val = writers["train"], writers["val"]
            if train.num_documents == 0:
                writers["val"] = _move_document(
                    val, train, val_cand.start, val_cand.length, ".re.tmp"
                )
                notes.append(
                    "no document hashed into train; moved one val document (the one whose "
                    "hash is farthest below the val threshold) to train"
                )
            elif val_fraction > 0 and val.num_documents == 0 and n_docs >= 2:
                writers["train"] = _move_document(
                    train, val, train_cand.start, train_cand.length, ".re.tmp"
                )
                notes.append(
                    "no document hashed into val; moved one train document (the one whose "
                    "hash is nearest the val threshold) to val so it is not empty"
                )
            if writers["val"].num_documents == 0 and val_fraction > 0:
                notes.append("val is empty: there is only one document, kept for train")
        except BaseException:
            for w in writers.values():
                w.discard()
            raise

    source = {
        "inputs": [str(i) for i in inputs],
        "description": "; ".join(i.describe() for i in resolved),
        "input_bytes": docs.bytes_read,
        "max_bytes": max_bytes,
        "val_fraction": val_fraction,
        "text_field": text_field,
        "split_rule": "val iff int(sha1(utf8(document))[:8], big-endian) / 2**64 < val_fraction",
    }
    summary: dict[str, Any] = {
        "out_dir": str(out),
        "tokenizer": tok_record,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "dtype": dtype_name,
        "documents": 0,
        "input_bytes": docs.bytes_read,
        "source": source["description"],
    }
    for split in SPLITS:
        w = writers[split]
        shards = [
            {"file": f"shard_{i:05d}.bin", "tokens": s["tokens"], "sha256": s["sha256"]}
            for i, s in enumerate(w.shards)
        ]
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "split": split,
            "tokenizer": tok_record,
            "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id,
            "dtype": dtype_name,
            "shards": shards,
            "total_tokens": w.total_tokens,
            "num_documents": w.num_documents,
            "source": source,
        }
        _publish(split_dirs[split], w, manifest)
        summary[split] = {
            "dir": str(split_dirs[split]),
            "tokens": w.total_tokens,
            "documents": w.num_documents,
            "shards": len(shards),
        }
        summary["documents"] += w.num_documents
    summary["notes"] = notes
    summary["seconds"] = round(time.monotonic() - started, 3)
    return summary


def _no_documents_message(resolved: list[_Input], max_bytes: int | None) -> str:
    what = "; ".join(i.describe() for i in resolved)
    cap = f", or raise max_bytes={max_bytes}" if max_bytes is not None else ""
    return (
        f"the inputs hold no text documents ({what}): pass non-empty UTF-8 text files, "
        f"folders of them, or .jsonl files{cap}"
    )


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def load_manifest(split_dir: str | Path, verify: bool = False) -> dict:
    """Read and validate `split_dir/manifest.json` and its shards; returns the manifest.

    Checks the directory, the JSON, the required keys, every shard's presence and byte size,
    and that the split has tokens. `verify=True` also checks every shard's sha256 (slow on GBs).
    """
    split_dir = Path(split_dir)
    hint = _prepare_hint(split_dir.parent)
    if not split_dir.is_dir():
        raise DataError(f"training data not found at {split_dir}: {hint} first")
    path = split_dir / MANIFEST_NAME
    if not path.is_file():
        raise DataError(
            f"no {MANIFEST_NAME} in {split_dir}: the data preparation did not finish; {hint}"
        )
    raw = path.read_bytes()
    if not raw.strip():
        raise DataError(f"manifest {path} is empty: {hint} again")
    try:
        m = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"manifest {path} is corrupt (not valid JSON: {e}): {hint} again") from e
    if not isinstance(m, dict):
        raise DataError(f"manifest {path} is corrupt (not a JSON object): {hint} again")
    missing = [k for k in _REQUIRED_KEYS if k not in m]
    if missing:
        raise DataError(f"manifest {path} is corrupt (missing {', '.join(missing)}): {hint} again")
    if m["format_version"] != FORMAT_VERSION:
        raise DataError(
            f"manifest {path} has format_version {m['format_version']!r}, this m3run reads "
            f"{FORMAT_VERSION}: {hint} again with this version"
        )
    if m["dtype"] not in _DTYPES:
        raise DataError(f"manifest {path} is corrupt (dtype {m['dtype']!r}): {hint} again")
    vocab, eos = m["vocab_size"], m["eos_id"]
    if not (_is_int(vocab) and vocab > 0 and _is_int(eos) and 0 <= eos < vocab):
        raise DataError(
            f"manifest {path} is corrupt (vocab_size {vocab!r}, eos_id {eos!r}): {hint} again"
        )
    shards = m["shards"]
    if not isinstance(shards, list):
        raise DataError(f"manifest {path} is corrupt (shards is not a list): {hint} again")
    itemsize = _DTYPES[m["dtype"]].itemsize
    total = 0
    for i, s in enumerate(shards):
        ok = (
            isinstance(s, dict)
            and isinstance(s.get("file"), str)
            and Path(s["file"]).name == s["file"]
            and _is_int(s.get("tokens"))
            and s["tokens"] >= 0
        )
        if not ok:
            raise DataError(f"manifest {path} is corrupt (shard entry {i}: {s!r}): {hint} again")
        shard_path = split_dir / s["file"]
        if not shard_path.is_file():
            raise DataError(f"shard {shard_path} listed in {path} is missing: {hint} again")
        size, want = shard_path.stat().st_size, s["tokens"] * itemsize
        if size != want:
            raise DataError(
                f"shard {shard_path} has {size} bytes, the manifest records {want} "
                f"({s['tokens']} {m['dtype']} tokens): the file is truncated or replaced; "
                f"{hint} again"
            )
        if verify and sha256_file(shard_path) != s.get("sha256"):
            raise DataError(f"shard {shard_path} fails its sha256 check: {hint} again")
        total += s["tokens"]
    if total != m["total_tokens"]:
        raise DataError(
            f"manifest {path} is corrupt (shards hold {total} tokens, total_tokens says "
            f"{m['total_tokens']!r}): {hint} again"
        )
    if total == 0:
        raise DataError(
            f"the data at {split_dir} has no tokens (an empty split, e.g. val with "
            f"val_fraction=0): {hint} with inputs that have text"
        )
    return m


class TokenWindows:
    """A split's shards, memory-mapped as one token stream, viewed as training windows.

    Window i covers tokens [i·seq_len, i·seq_len + seq_len + 1): inputs and their next-token
    targets. Consecutive windows share one token, so every token is a target exactly once.
    """

    def __init__(self, split_dir: str | Path, seq_len: int, *, verify: bool = False):
        if not _is_int(seq_len) or seq_len < 1:
            raise DataError(f"seq_len={seq_len!r} must be an integer ≥ 1")
        self.split_dir = Path(split_dir)
        self.seq_len = seq_len
        self.manifest = load_manifest(self.split_dir, verify=verify)
        dtype = _DTYPES[self.manifest["dtype"]]
        shards = [s for s in self.manifest["shards"] if s["tokens"] > 0]
        self._maps = [np.memmap(self.split_dir / s["file"], dtype=dtype, mode="r") for s in shards]
        self._starts = np.cumsum([0] + [s["tokens"] for s in shards], dtype=np.int64)
        self.num_tokens = int(self._starts[-1])
        self._n = (self.num_tokens - 1) // seq_len
        if self._n < 1:
            raise DataError(
                f"the data at {self.split_dir} has {self.num_tokens} tokens; one window of "
                f"seq_len {seq_len} needs {seq_len + 1}: prepare more data or lower seq_len"
            )

    def __len__(self) -> int:
        return self._n

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the concatenated stream, as int64."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"token range [{start}, {stop}) outside [0, {self.num_tokens})")
        out = np.empty(stop - start, dtype=np.int64)
        k = int(np.searchsorted(self._starts, start, side="right")) - 1
        pos = start
        while pos < stop:
            shard_lo = int(self._starts[k])
            take = min(stop, int(self._starts[k + 1])) - pos
            out[pos - start : pos - start + take] = self._maps[k][
                pos - shard_lo : pos - shard_lo + take
            ]
            pos += take
            k += 1
        return out

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self._n:
            raise IndexError(f"window {i} outside [0, {self._n})")
        start = i * self.seq_len
        return self.tokens(start, start + self.seq_len + 1)

    def batch(self, indices: Sequence[int]) -> np.ndarray:
        """Windows stacked as (len(indices), seq_len + 1) int64."""
        out = np.empty((len(indices), self.seq_len + 1), dtype=np.int64)
        for row, i in enumerate(indices):
            out[row] = self[int(i)]
        return out

    def close(self) -> None:
        # Dropping the memmaps unmaps the files (numpy has no explicit close).
        self._maps = []


def _to_tensors(windows: np.ndarray, pin: bool) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    x = torch.from_numpy(np.ascontiguousarray(windows[:, :-1]))
    y = torch.from_numpy(np.ascontiguousarray(windows[:, 1:]))
    if pin:
        x, y = x.pin_memory(), y.pin_memory()
    return x, y


class _Prefetcher:
    """A thread producing batches for stream positions start, start+step, ... into a queue."""

    def __init__(self, produce: Callable[[int], Any], start: int, step: int, depth: int):
        self._produce = produce
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(start, step), name="m3run-batch-prefetch", daemon=True
        )
        self._thread.start()

    def _run(self, pos: int, step: int) -> None:
        while not self._stop.is_set():
            try:
                item = (pos, self._produce(pos), None)
            except BaseException as e:  # handed to the consumer, which re-raises it
                item = (pos, None, e)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[2] is not None:
                return
            pos += step

    def get(self) -> tuple[int, Any]:
        while True:
            try:
                pos, batch, err = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError("the batch prefetch thread stopped unexpectedly") from None
        if err is not None:
            raise err
        return pos, batch

    def close(self) -> None:
        self._stop.set()
        while self._thread.is_alive():
            try:
                while True:
                    self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=0.1)


class BatchLoader:
    """Shuffled training batches from a prepared split, resumable to the exact batch.

    The global stream visits windows in a permutation drawn from PCG64 seeded with
    (seed, epoch); after the last window of an epoch the next epoch starts with a fresh
    permutation. The stream is consumed in blocks of micro_batch_size·world_size windows and
    rank r takes the r-th micro_batch_size slice of each block. The position (windows consumed
    globally) is independent of world size and counts only batches returned by next_batch().
    """

    def __init__(
        self,
        split_dir: str | Path,
        seq_len: int,
        micro_batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        prefetch: int = 2,
        pin_memory: bool = False,
    ):
        for name, value, lo in (
            ("micro_batch_size", micro_batch_size, 1),
            ("world_size", world_size, 1),
            ("seed", seed, 0),
            ("prefetch", prefetch, 0),
        ):
            if not _is_int(value) or value < lo:
                raise DataError(f"{name}={value!r} must be an integer ≥ {lo}")
        if not _is_int(rank) or not 0 <= rank < world_size:
            raise DataError(f"rank={rank!r} must be an integer in [0, world_size={world_size})")
        self.windows = TokenWindows(split_dir, seq_len)
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self._block = micro_batch_size * world_size
        self._depth = prefetch
        self._pin = bool(pin_memory) and self._cuda_available()
        self._consumed = 0
        self._perms: dict[int, np.ndarray] = {}
        self._prefetcher: _Prefetcher | None = None
        self._lock = threading.RLock()
        self._closed = False

    @staticmethod
    def _cuda_available() -> bool:
        import torch

        if torch.cuda.is_available():
            return True
        warnings.warn("pin_memory=True ignored: CUDA is not available", stacklevel=3)
        return False

    # -- facts about the data ------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return int(self.windows.manifest["vocab_size"])

    @property
    def eos_id(self) -> int:
        return int(self.windows.manifest["eos_id"])

    @property
    def num_tokens(self) -> int:
        return self.windows.num_tokens

    @property
    def num_windows(self) -> int:
        return len(self.windows)

    @property
    def windows_consumed(self) -> int:
        return self._consumed

    @property
    def epoch(self) -> int:
        return self._consumed // len(self.windows)

    # -- order ---------------------------------------------------------------------------------
    def _permutation(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            perm = rng.permutation(len(self.windows))
            # Keep the previous epoch too: a batch can straddle an epoch boundary.
            self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}
            self._perms[epoch] = perm
        return perm

    def _window_indices(self, position: int) -> list[int]:
        n = len(self.windows)
        first = position + self.rank * self.micro_batch_size
        out = []
        for p in range(first, first + self.micro_batch_size):
            out.append(int(self._permutation(p // n)[p % n]))
        return out

    def _produce(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _to_tensors(self.windows.batch(self._window_indices(position)), self._pin)

    # -- the trainer's API ---------------------------------------------------------------------
    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), both int64 (micro_batch_size, seq_len); y[:, t] is the token after x[:, t]."""
        with self._lock:
            if self._closed:
                raise RuntimeError("BatchLoader.next_batch() called after close()")
            if self._depth == 0:
                batch = self._produce(self._consumed)
            else:
                if self._prefetcher is None:
                    self._prefetcher = _Prefetcher(
                        self._produce, self._consumed, self._block, self._depth
                    )
                try:
                    pos, batch = self._prefetcher.get()
                except BaseException:
                    self._stop_prefetch()  # a retry starts a fresh prefetcher at this position
                    raise
                if pos != self._consumed:
                    raise RuntimeError(
                        f"prefetched batch for window {pos}, expected {self._consumed}"
                    )
            self._consumed += self._block
            return batch

    def state_dict(self) -> dict[str, int]:
        """Plain ints: the position after the last batch returned (not the prefetched ones)."""
        with self._lock:
            return {
                "format_version": FORMAT_VERSION,
                "seed": self.seed,
                "seq_len": self.seq_len,
                "num_windows": len(self.windows),
                "windows_consumed": self._consumed,
            }

    def load_state_dict(self, state: dict) -> None:
        with self._lock:
            for key in ("seed", "seq_len", "num_windows", "windows_consumed"):
                if not _is_int(state.get(key)):
                    raise DataError(
                        f"data-loader state is missing integer {key!r} (got {state!r}): the "
                        "checkpoint is not from this m3run; resume from another checkpoint"
                    )
            for key in ("seed", "seq_len", "num_windows"):
                if state[key] != getattr(self, key):
                    raise DataError(
                        f"checkpoint data position was recorded with {key}={state[key]}, this "
                        f"run has {key}={getattr(self, key)} (data at {self.windows.split_dir}): "
                        "resume with the config and data the run started with, or start a new run"
                    )
            if state["windows_consumed"] < 0:
                raise DataError(f"data-loader windows_consumed={state['windows_consumed']} < 0")
            self._stop_prefetch()
            self._consumed = state["windows_consumed"]

    def skip(self, n_micro_batches: int) -> None:
        """Advance as if n batches had been read and discarded, without reading them."""
        if not _is_int(n_micro_batches) or n_micro_batches < 0:
            raise ValueError(f"skip({n_micro_batches!r}): the count must be an integer ≥ 0")
        with self._lock:
            self._stop_prefetch()
            self._consumed += n_micro_batches * self._block

    def close(self) -> None:
        with self._lock:
            self._stop_prefetch()
            self.windows.close()
            self._closed = True

    def _stop_prefetch(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None

    def __enter__(self) -> BatchLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def eval_batches(
    split_dir: str | Path, seq_len: int, micro_batch_size: int, n_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed validation set: up to n_batches batches of windows spread evenly over the split.

    Depends only on the data and the shapes (not on a seed or training state), so every eval
    of a run, and of a resumed run, scores the same tokens. Returns fewer batches when the split
    has fewer than n_batches·micro_batch_size windows; only full batches.
    """
    if not _is_int(micro_batch_size) or micro_batch_size < 1:
        raise DataError(f"micro_batch_size={micro_batch_size!r} must be an integer ≥ 1")
    if not _is_int(n_batches) or n_batches < 1:
        raise DataError(f"n_batches={n_batches!r} must be an integer ≥ 1")
    windows = TokenWindows(split_dir, seq_len)
    try:
        n = len(windows)
        if n < micro_batch_size:
            raise DataError(
                f"the data at {split_dir} has {n} windows of {seq_len + 1} tokens; one eval "
                f"batch needs {micro_batch_size}: lower micro_batch_size or seq_len, or prepare "
                "with a larger val_fraction"
            )
        k = min(n_batches * micro_batch_size, (n // micro_batch_size) * micro_batch_size)
        picks = (np.arange(k, dtype=np.int64) * n) // k
        return [
            _to_tensors(windows.batch(picks[b : b + micro_batch_size]), pin=False)
            for b in range(0, k, micro_batch_size)
        ]
    finally:
        windows.close()


def check_vocab(
    manifest_or_loader: dict | BatchLoader | TokenWindows, model_vocab_size: int
) -> None:
    """Raise DataError when the data's token ids may not fit the model's embedding."""
    if isinstance(manifest_or_loader, dict):
        data_vocab = manifest_or_loader["vocab_size"]
        spec = manifest_or_loader.get("tokenizer", {}).get("spec", "?")
    elif isinstance(manifest_or_loader, TokenWindows):
        data_vocab = manifest_or_loader.manifest["vocab_size"]
        spec = manifest_or_loader.manifest["tokenizer"].get("spec", "?")
    else:
        data_vocab = manifest_or_loader.vocab_size
        spec = manifest_or_loader.windows.manifest["tokenizer"].get("spec", "?")
    if data_vocab > model_vocab_size:
        raise DataError(
            f"the data's vocabulary ({data_vocab} tokens, tokenizer {spec}) is larger than the "
            f"model's vocab_size {model_vocab_size}: set model.vocab_size ≥ {data_vocab}, or "
            f"re-run `m3run prepare-data` with a smaller tokenizer (e.g. "
            f"--tokenizer bpe:{model_vocab_size})"
        )
