"""Writing token shards: fixed-size temporaries, a document moved between splits, publishing.

Shards are written as `<name>.bin<suffix>` temporaries, each fsync'd, and renamed into place by
`publish`, which writes the manifest last. Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from m3run.runner.data.manifest import MANIFEST_NAME
from m3run.runner.files import atomic_write_text

__all__ = ["ShardWriter", "move_document", "move_tail", "publish"]


class ShardWriter:
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


def move_document(
    src: ShardWriter, dst: ShardWriter, start: int, length: int, suffix: str
) -> ShardWriter:
    """Move the document at [start, start+length) of src into dst; returns src rewritten."""
    for piece in _read_range(src.shards, src.dtype, start, start + length):
        dst.write(piece)
    dst.num_documents += 1
    dst.close()
    rewritten = ShardWriter(src.directory, src.dtype, src.shard_tokens, suffix)
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


def move_tail(src: ShardWriter, dst: ShardWriter, n: int, eos_id: int, suffix: str) -> ShardWriter:
    """Move the last n tokens of src into dst (a token-level split); returns src rewritten.

    The tail ends with EOS (every stream does). When the cut falls inside a document, src's
    part of it gets an EOS of its own, so both streams stay sequences of whole documents.
    """
    start = src.total_tokens - n
    tail_documents = 0
    for piece in _read_range(src.shards, src.dtype, start, src.total_tokens):
        dst.write(piece)
        tail_documents += int(np.count_nonzero(piece == eos_id))
    dst.num_documents += tail_documents
    dst.close()
    rewritten = ShardWriter(src.directory, src.dtype, src.shard_tokens, suffix)
    for piece_start in range(0, start, src.shard_tokens):
        for piece in _read_range(
            src.shards, src.dtype, piece_start, min(start, piece_start + src.shard_tokens)
        ):
            rewritten.write(piece)
    before_cut = next(_read_range(src.shards, src.dtype, start - 1, start))
    cut_inside = int(before_cut[0]) != eos_id
    if cut_inside:
        rewritten.write(np.array([eos_id]))
    rewritten.num_documents = src.num_documents - tail_documents + int(cut_inside)
    rewritten.close()
    src.discard()
    return rewritten


def publish(split_dir: Path, writer: ShardWriter, manifest: dict) -> None:
    names = []
    for i, s in enumerate(writer.shards):
        name = f"shard_{i:05d}.bin"
        os.replace(s["tmp"], split_dir / name)
        names.append(name)
    for stale in split_dir.glob("shard_*.bin"):
        if stale.name not in names:
            stale.unlink()
    atomic_write_text(split_dir / MANIFEST_NAME, json.dumps(manifest, indent=2) + "\n")
