"""Offline data preparation: `prepare_data` turns inputs into the train/val token shards.

Documents (`m3run.runner.data.documents`) are tokenised in this process or in a pool of spawned
processes (the shard bytes do not depend on how many), split by a content hash or at token
level, written by `ShardWriter` and published with their manifests (format:
`m3run.runner.data.manifest`), which record every input with its document and token counts.
Needs only numpy, pyarrow and the tokenizer libraries, never torch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from m3run.runner.data.documents import Documents, no_documents_message
from m3run.runner.data.inputs import Input, read_inputs_file, resolve_inputs
from m3run.runner.data.manifest import (
    DTYPES,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_NAME,
    SPLITS,
    DataError,
    load_manifest,
)
from m3run.runner.data.progress import Progress
from m3run.runner.data.readers import BLANK_LINES
from m3run.runner.data.shards import ShardWriter, move_document, move_tail, publish
from m3run.runner.data.tokenizer import Tokenizer, parse_bpe_spec, train_bpe
from m3run.runner.files import sha256_file
from m3run.runner.formatting import count

__all__ = ["VAL_SPLITS", "existing_output", "prepare_data", "small_val_warning"]

log = logging.getLogger(__name__)

# Work unit sent to a tokenizer process: large enough to amortise pickling, small enough to
# keep every worker busy and memory bounded.
_CHUNK_BYTES = 1 << 20
_CHUNK_DOCS = 1024
VAL_SPLITS = ("hash", "tail")
_SPLIT_RULES = {
    "hash": "val iff int(sha1(utf8(document))[:8], big-endian) / 2**64 < val_fraction",
    "tail": "val = the last round(val_fraction * tokens) tokens of the stream",
}


@dataclass
class _Chunk:
    texts: list[str]
    inputs: list[int]  # the input each document came from
    nbytes: int


def _chunks(docs: Iterable[tuple[str, int, int]]) -> Iterator[_Chunk]:
    chunk = _Chunk([], [], 0)
    for text, nbytes, index in docs:
        chunk.texts.append(text)
        chunk.inputs.append(index)
        chunk.nbytes += nbytes
        if chunk.nbytes >= _CHUNK_BYTES or len(chunk.texts) >= _CHUNK_DOCS:
            yield chunk
            chunk = _Chunk([], [], 0)
    if chunk.texts:
        yield chunk


@dataclass
class _Encoded:
    hashes: list[int]  # first 8 bytes of sha1(document), big-endian: the split key
    lengths: np.ndarray  # tokens per document, EOS included
    tokens: np.ndarray  # the documents' tokens, each followed by EOS
    inputs: list[int]
    nbytes: int


def _encode_chunk(tok: Tokenizer, chunk: _Chunk, dtype: np.dtype) -> _Encoded:
    texts = chunk.texts
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
    return _Encoded(hashes, lengths, flat.astype(dtype), chunk.inputs, chunk.nbytes)


_WORKER_TOKENIZER: Tokenizer | None = None


def _init_worker(kind: str, source: str) -> None:
    global _WORKER_TOKENIZER
    # One tokeniser thread per process: the pool already uses every core.
    os.environ["RAYON_NUM_THREADS"] = "1"
    _WORKER_TOKENIZER = Tokenizer.load(kind, source)


def _encode_in_worker(chunk: _Chunk, dtype_name: str) -> _Encoded:
    assert _WORKER_TOKENIZER is not None, "worker initializer did not run"
    return _encode_chunk(_WORKER_TOKENIZER, chunk, DTYPES[dtype_name])


def _encode_all(
    tok: Tokenizer, docs: Iterable[tuple[str, int, int]], dtype_name: str, workers: int
) -> Iterator[_Encoded]:
    """Encoded chunks in input order. A bounded window of in-flight chunks keeps memory flat."""
    if workers <= 1:
        for chunk in _chunks(docs):
            yield _encode_chunk(tok, chunk, DTYPES[dtype_name])
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
        for chunk in _chunks(docs):
            pending.append(pool.submit(_encode_in_worker, chunk, dtype_name))
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


def _ready_tokenizer(spec: str) -> Tokenizer | None:
    """The named tokenizer, or None for `bpe:<n>` (trained on the inputs later)."""
    if spec.startswith("bpe:"):
        parse_bpe_spec(spec)
        return None
    if spec == "gpt2":
        return Tokenizer.load("tiktoken", "gpt2")
    if spec.endswith(".json") or Path(spec).is_file():
        return Tokenizer.load("hf", str(Path(spec).resolve()))
    raise DataError(
        f"unknown tokenizer {spec!r}: use `gpt2`, a path to a HF tokenizer.json, "
        "or `bpe:<vocab_size>` (e.g. bpe:8192)"
    )


def _reported(docs, bar: Progress):
    """The documents' texts, advancing the progress line as the tokenizer trainer reads them
    (BPE training reads the whole corpus first: a long wait that must not look stuck)."""
    seen = 0
    for text, _, _ in docs:
        yield text
        bar.advance(docs.bytes_read - seen, documents=1)
        seen = docs.bytes_read
    bar.advance(docs.bytes_read - seen)


def _tokenizer_record(spec: str, tok: Tokenizer, trained: Path | None) -> dict:
    if trained is not None:
        # The path is relative to the manifest's directory.
        return {
            "spec": spec,
            "kind": "hf",
            "path": "../tokenizer.json",
            "sha256": sha256_file(trained),
        }
    if tok.kind == "hf":
        return {
            "spec": spec,
            "kind": "hf",
            "path": tok.source,
            "sha256": sha256_file(Path(tok.source)),
        }
    return {"spec": spec, "kind": "tiktoken", "name": tok.source}


@dataclass
class _Splitter:
    """Writes each encoded document to train or val and keeps the per-input token counts."""

    writers: dict[str, ShardWriter]
    val_fraction: float
    by_hash: bool
    inputs: list[Input]
    # Fallbacks when a split ends up empty: the train document nearest the val threshold
    # (smallest key) or the val document farthest below it (largest key, stored negated).
    train_cand: _Candidate
    val_cand: _Candidate

    def add(self, chunk: _Encoded) -> None:
        ends = np.cumsum(chunk.lengths)
        for i, key in enumerate(chunk.hashes):
            lo, hi = int(ends[i] - chunk.lengths[i]), int(ends[i])
            to_val = self.by_hash and key / 2**64 < self.val_fraction
            w = self.writers["val" if to_val else "train"]
            if to_val:
                self.val_cand.offer(-key, w.total_tokens, hi - lo)
            else:
                self.train_cand.offer(key, w.total_tokens, hi - lo)
            w.write(chunk.tokens[lo:hi])
            w.num_documents += 1
            self.inputs[chunk.inputs[i]].tokens += hi - lo

    def balance(self, eos_id: int, notes: list[str]) -> None:
        """Give each split at least one document, or at token level when there is one."""
        for w in self.writers.values():
            w.close()
        train, val = self.writers["train"], self.writers["val"]
        n_docs = train.num_documents + val.num_documents
        if self.val_fraction == 0:
            return
        if n_docs == 1 and val.num_documents == 1:  # the one document goes to train, cut below
            self.writers["val"] = move_document(val, train, 0, val.total_tokens, ".re.tmp")
        train, val = self.writers["train"], self.writers["val"]
        if not self.by_hash or n_docs == 1:
            n = round(self.val_fraction * train.total_tokens)
            n = min(max(n, 1), train.total_tokens - 2)
            if n < 1:
                notes.append(f"val is empty: the corpus has only {train.total_tokens} tokens")
                return
            self.writers["train"] = move_tail(train, val, n, eos_id, ".re.tmp")
            why = "as asked (--val-split tail)" if not self.by_hash else "there is one document"
            notes.append(f"val is the last {n:,} tokens of the stream, a token-level split: {why}")
        elif train.num_documents == 0:
            self.writers["val"] = move_document(
                val, train, self.val_cand.start, self.val_cand.length, ".re.tmp"
            )
            notes.append(
                "no document hashed into train; moved one val document (the one whose "
                "hash is farthest below the val threshold) to train"
            )
        elif val.num_documents == 0:
            self.writers["train"] = move_document(
                train, val, self.train_cand.start, self.train_cand.length, ".re.tmp"
            )
            notes.append(
                "no document hashed into val; moved one train document (the one whose "
                "hash is nearest the val threshold) to val so it is not empty"
            )


# A val split is checked against eval batches of micro-batch 8 at these common context lengths:
# under _FEW_EVAL_BATCHES of the longest, prepare-data warns before a run finds out at its smoke
# test (a run's eval needs micro_batch_size windows of seq_len + 1 tokens per batch).
_EVAL_SEQ_LENS = (256, 1024, 2048)
_EVAL_MICRO_BATCH = 8
_FEW_EVAL_BATCHES = 2


def small_val_warning(val_tokens: int, total_tokens: int, val_split: str) -> str | None:
    """A warning when the val split holds under a few eval batches at common shapes, with the
    --val-fraction that would give enough here; None when it holds enough (or val is off)."""

    def batches(seq_len: int) -> int:
        return max(val_tokens - 1, 0) // seq_len // _EVAL_MICRO_BATCH

    longest = _EVAL_SEQ_LENS[-1]
    if val_tokens == 0 or batches(longest) >= _FEW_EVAL_BATCHES:
        return None
    mb = _EVAL_MICRO_BATCH
    fills = " / ".join(str(batches(t)) for t in _EVAL_SEQ_LENS)
    lens = " / ".join(map(str, _EVAL_SEQ_LENS))
    message = (
        f"the val split is small: its {count(val_tokens, 'token')} make {fills} eval batches "
        f"of {mb} windows at seq_len {lens}; a run whose eval needs more fails its smoke test "
        "(exit 78). "
    )
    needed = _FEW_EVAL_BATCHES * mb * longest + 1
    # A document-hash split takes a share of documents, so aim a little above the share of
    # tokens needed.
    fraction = needed / max(total_tokens, 1) * (1.0 if val_split == "tail" else 1.25)
    if fraction >= 0.5:
        return message + (
            f"The corpus ({count(total_tokens, 'token')}) is too small for "
            f"{_FEW_EVAL_BATCHES} eval batches at seq_len {longest}: add text, or train with "
            "a shorter data.seq_len"
        )
    fraction = float(f"{fraction:.2g}")
    return message + (
        f"For {_FEW_EVAL_BATCHES} eval batches at seq_len {longest} ({needed:,} tokens), "
        f"prepare again with --val-fraction {fraction:g} or more"
    )


def existing_output(out_dir: str | Path) -> str | None:
    """What usable prepared data `out_dir` already holds (its tokenizer and token counts), or
    None: preparing into it again replaces that data. A preparation that did not finish, or
    data that fails its manifest's checks, holds nothing a run could use."""
    out = Path(out_dir)
    found = []
    for split in SPLITS:
        try:
            m = load_manifest(out / split)
        except DataError:
            return None
        found.append(f"{split}: {count(m['total_tokens'], 'token')}")
    return f"{', '.join(found)}; tokenizer {m['tokenizer'].get('spec', '?')}"


def _check_arguments(
    val_fraction: float, val_split: str, shard_tokens: int, max_bytes: int | None, workers: int
) -> None:
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction={val_fraction} is out of range: use 0 ≤ val_fraction < 1")
    if val_split not in VAL_SPLITS:
        raise DataError(f"val_split={val_split!r}: use one of {', '.join(VAL_SPLITS)}")
    if shard_tokens < 1:
        raise DataError(f"shard_tokens={shard_tokens} must be ≥ 1 (default 50_000_000)")
    if max_bytes is not None and max_bytes < 1:
        raise DataError(f"max_bytes={max_bytes} must be ≥ 1, or None for no cap")
    if workers < 1:
        raise DataError(f"workers={workers} must be ≥ 1")


def prepare_data(
    inputs: Sequence[str],
    out_dir: str | Path,
    tokenizer: str = "gpt2",
    val_fraction: float = 0.005,
    text_field: str = "text",
    shard_tokens: int = 50_000_000,
    workers: int | None = None,
    max_bytes: int | None = None,
    progress: bool = True,
    *,
    inputs_file: str | Path | None = None,
    separator: str | None = BLANK_LINES,
    val_split: str = "hash",
    skip_bad: bool = False,
    progress_interval_s: float = 10.0,
    warn: Callable[[str], None] | None = None,
) -> dict:
    """Tokenise `inputs` into `out_dir/train` and `out_dir/val` token shards; returns a summary.

    inputs: `LOCATION[:FIELD]` items (see `m3run.runner.data.inputs`): text files, JSON Lines
      (.jsonl, .gz/.zst), JSON arrays, parquet and Arrow files, folders and globs of them
      (each text file one document, hidden entries skipped), HF `save_to_disk` folders,
      `hf:<folder>` (through `datasets`, the hf extra), or `stdlib` (this Python's standard
      library .py sources) for a download-free demo corpus. FIELD (default `text_field`, dotted
      for nested records) names the text of records. `inputs_file` adds a YAML list of them.
    separator: how a lone text file is cut into documents: BLANK_LINES (one or more blank
      lines), None (the file is one document), or a literal string.
    tokenizer: "gpt2" (tiktoken), the path of a HF tokenizer.json, or "bpe:<vocab_size>" to
      train a byte-level BPE on the inputs, saved as out_dir/tokenizer.json with an
      `<|endoftext|>` EOS.
    val_split "hash": a document goes to val when sha1(document) read as a fraction of 2**64 is
      below val_fraction, so the split depends on content only (not order, not workers); a
      corpus of one document is split at token level. "tail": val is the last val_fraction of
      the token stream.
    skip_bad: a file that cannot be read or yields no text is skipped with a warning (`warn`,
      default stderr) instead of being an error.
    progress: a bar on a terminal, else a line to stderr every progress_interval_s seconds.
    The shard bytes are identical for any `workers`. `max_bytes` caps the document text read.
    """
    started = time.monotonic()
    if workers is None:
        workers = min(os.cpu_count() or 1, 8)
    _check_arguments(val_fraction, val_split, shard_tokens, max_bytes, workers)

    out = Path(out_dir)
    items: list[str | tuple[str, str | None]] = list(inputs)
    if inputs_file is not None:
        items += read_inputs_file(inputs_file)
    resolved = resolve_inputs(items, text_field, exclude=out.resolve())
    docs = Documents(resolved, max_bytes, separator, skip_bad, **({"warn": warn} if warn else {}))
    notes: list[str] = []

    # Load a ready-made tokenizer before touching out_dir, so a failure leaves old data intact.
    tok = _ready_tokenizer(tokenizer)

    out.mkdir(parents=True, exist_ok=True)
    split_dirs = {s: out / s for s in SPLITS}
    for d in split_dirs.values():
        d.mkdir(exist_ok=True)
        # The manifest goes first: until the new one is written the split reads as incomplete.
        (d / MANIFEST_NAME).unlink(missing_ok=True)
        for tmp in d.glob("*.tmp"):
            tmp.unlink()

    mode = "off" if not progress else ("bar" if sys.stderr.isatty() else "lines")
    total_bytes = docs.total_bytes_hint() if mode != "off" else None
    trained = None
    with Progress(mode, progress_interval_s) as bar:
        if tok is None:
            bpe_size = parse_bpe_spec(tokenizer)
            bar.phase(f"training bpe:{bpe_size}", total_bytes)
            trained = out / "tokenizer.json"
            merging = bar.waiting(f"training bpe:{bpe_size}: computing merges")
            train_bpe(_reported(docs, bar), bpe_size, trained, merging)
            bar.done()
            if docs.bytes_read == 0:
                raise DataError(no_documents_message(resolved, max_bytes))
            tok = Tokenizer.load("hf", str(trained))
            if tok.vocab_size < bpe_size:
                notes.append(
                    f"bpe:{bpe_size} learned only {tok.vocab_size} tokens: the corpus is small"
                )
        tok_record = _tokenizer_record(tokenizer, tok, trained)
        log.info("tokenizer %s: vocab %d, eos %d", tokenizer, tok.vocab_size, tok.eos_id)

        dtype_name = "uint16" if tok.vocab_size <= 65535 else "uint32"
        dtype = DTYPES[dtype_name]
        writers = {s: ShardWriter(split_dirs[s], dtype, shard_tokens, ".tmp") for s in SPLITS}
        splitter = _Splitter(
            writers, val_fraction, val_split == "hash", resolved, _Candidate(), _Candidate()
        )
        bar.phase("tokenising", total_bytes)
        try:
            for chunk in _encode_all(tok, docs, dtype_name, workers):
                splitter.add(chunk)
                bar.advance(chunk.nbytes, len(chunk.hashes), int(chunk.tokens.size))
            bar.done()
            if sum(w.num_documents for w in writers.values()) == 0:
                raise DataError(no_documents_message(resolved, max_bytes))
            splitter.balance(tok.eos_id, notes)
        except BaseException:
            for w in splitter.writers.values():
                w.discard()
            raise
        writers = splitter.writers

    skipped = [(f, r) for i in resolved for f, r in i.skipped if i.kind != "stdlib"]
    if skipped:
        notes.append(f"skipped {len(skipped)} unreadable or empty files (--skip-bad)")
    source = {
        "inputs": [i.record() for i in resolved],
        "description": "; ".join(i.describe() for i in resolved),
        "input_bytes": docs.bytes_read,
        "max_bytes": max_bytes,
        "val_fraction": val_fraction,
        "val_split": val_split,
        "separator": separator,
        "text_field": text_field,
        "split_rule": _SPLIT_RULES[val_split],
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
        "inputs": source["inputs"],
        "skipped": skipped,
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
    warning = small_val_warning(
        writers["val"].total_tokens,
        writers["train"].total_tokens + writers["val"].total_tokens,
        val_split,
    )
    summary["warnings"] = [warning] if warning else []
    summary["seconds"] = round(time.monotonic() - started, 3)
    return summary
