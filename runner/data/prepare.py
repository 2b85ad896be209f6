"""Offline data preparation: `prepare_data` turns text into the train/val token shards.

Documents are tokenised in this process or in a pool of spawned processes (the shard bytes do
not depend on how many), split by a content hash, written by `ShardWriter` and published with
their manifests (format: `runner.data.manifest`). Needs only numpy and the tokenizer libraries,
never torch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runner.data.documents import Documents, no_documents_message, resolve_inputs
from runner.data.manifest import DTYPES, FORMAT, FORMAT_VERSION, MANIFEST_NAME, SPLITS, DataError
from runner.data.shards import ShardWriter, move_document, publish
from runner.data.tokenizer import Tokenizer, parse_bpe_spec, train_bpe
from runner.files import sha256_file

__all__ = ["prepare_data"]

log = logging.getLogger(__name__)

# Work unit sent to a tokenizer process: large enough to amortise pickling, small enough to
# keep every worker busy and memory bounded.
_CHUNK_BYTES = 1 << 20
_CHUNK_DOCS = 1024


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
    return _encode_chunk(_WORKER_TOKENIZER, texts, DTYPES[dtype_name], nbytes)


def _encode_all(
    tok: Tokenizer, docs: Iterable[tuple[str, int]], dtype_name: str, workers: int
) -> Iterator[_Encoded]:
    """Encoded chunks in input order. A bounded window of in-flight chunks keeps memory flat."""
    if workers <= 1:
        for texts, nbytes in _chunks(docs):
            yield _encode_chunk(tok, texts, DTYPES[dtype_name], nbytes)
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
    resolved = resolve_inputs(inputs, exclude=out.resolve())
    docs = Documents(resolved, text_field, max_bytes)
    notes: list[str] = []

    # Load a ready-made tokenizer before touching out_dir, so a failure leaves old data intact.
    tok: Tokenizer | None = None
    bpe_size = None
    if tokenizer.startswith("bpe:"):
        bpe_size = parse_bpe_spec(tokenizer)
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
            train_bpe((text for text, _ in docs), bpe_size, tok_path)
            bar.done()
            if docs.bytes_read == 0:
                raise DataError(no_documents_message(resolved, max_bytes))
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
        dtype = DTYPES[dtype_name]
        writers = {s: ShardWriter(split_dirs[s], dtype, shard_tokens, ".tmp") for s in SPLITS}
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
                raise DataError(no_documents_message(resolved, max_bytes))

            train, val = writers["train"], writers["val"]
            if train.num_documents == 0:
                writers["val"] = move_document(
                    val, train, val_cand.start, val_cand.length, ".re.tmp"
                )
                notes.append(
                    "no document hashed into train; moved one val document (the one whose "
                    "hash is farthest below the val threshold) to train"
                )
            elif val_fraction > 0 and val.num_documents == 0 and n_docs >= 2:
                writers["train"] = move_document(
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
        publish(split_dirs[split], w, manifest)
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
