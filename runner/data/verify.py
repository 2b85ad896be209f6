"""Token shards checked before training: content (sha256) and token ids (< vocab_size).

A shard of the right size can still be zeroed, or hold ids past the vocabulary that would
surface as a bare IndexError deep in the embedding; both are a `DataError` naming the shard.
Each shard is read once: a marker in the user's cache dir keyed by its path, size, mtime and
inode records the result, so a relaunch on the same data checks only what changed. With several
ranks each verifies its own share of the shards. Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np

from m3run.runner.data.manifest import DTYPES, DataError
from m3run.runner.files import atomic_write_text

__all__ = ["default_cache_dir", "verify_split"]

log = logging.getLogger(__name__)

_BLOCK_BYTES = 16 << 20  # a multiple of every dtype's itemsize


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "m3run" / "verified-shards"


def _scan(path: Path, dtype: np.dtype) -> tuple[str, int]:
    """(sha256 hex, the largest token id) of a shard in one pass."""
    sha = hashlib.sha256()
    largest = -1
    with open(path, "rb") as f:
        while block := f.read(_BLOCK_BYTES):
            sha.update(block)
            ids = np.frombuffer(block, dtype=dtype)
            if ids.size:
                largest = max(largest, int(ids.max()))
    return sha.hexdigest(), largest


def verify_split(
    split_dir: str | Path,
    manifest: dict,
    rank: int = 0,
    world_size: int = 1,
    cache_dir: Path | None = None,
) -> int:
    """Check this rank's shards of a split; returns how many were read (not cached)."""
    split_dir = Path(split_dir)
    cache_dir = default_cache_dir() if cache_dir is None else cache_dir
    dtype = DTYPES[manifest["dtype"]]
    vocab = int(manifest["vocab_size"])
    hint = f"run `m3run prepare-data <inputs> --out {split_dir.parent}` again"
    read = 0
    for i, shard in enumerate(manifest["shards"]):
        if i % world_size != rank:
            continue
        path = (split_dir / shard["file"]).resolve()
        want = shard.get("sha256")
        if not isinstance(want, str) or len(want) != 64:
            raise DataError(f"shard {path} has no sha256 in its manifest: {hint}")
        st = path.stat()
        key = {
            "path": str(path),
            "size": st.st_size,
            "mtime_ns": st.st_mtime_ns,
            "inode": st.st_ino,
            "sha256": want,
            "vocab_size": vocab,
        }
        marker = cache_dir / f"{hashlib.sha1(str(path).encode()).hexdigest()}.json"
        try:
            if json.loads(marker.read_text()) == key:
                continue
        except (OSError, ValueError):
            pass
        got, largest = _scan(path, dtype)
        read += 1
        if got != want:
            raise DataError(
                f"shard {path} fails its sha256 check (its content changed after prepare-data "
                f"wrote it: zeroed, corrupted or replaced; size {st.st_size} bytes): {hint}"
            )
        if largest >= vocab:
            raise DataError(
                f"shard {path} holds token id {largest}, outside the vocabulary of its manifest "
                f"(vocab_size {vocab}): the shard was not written by this tokenizer; {hint}"
            )
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(marker, json.dumps(key), fsync=False)
        except OSError as e:  # a read-only home: correct, only slower on the next launch
            log.warning("cannot cache the check of %s in %s (%s)", path, cache_dir, e)
    return read
