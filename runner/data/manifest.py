"""The on-disk token format both sides share: the manifest, its validation, the shard dtypes.

Layout written by `m3run.runner.data.prepare.prepare_data` and read by the loader and the CLI:

    <out_dir>/
      tokenizer.json       only for `bpe:<vocab_size>`: the trained tokenizer, reusable by path
      train/   manifest.json   shard_00000.bin   shard_00001.bin   ...
      val/     manifest.json   shard_00000.bin   ...

A shard is raw little-endian uint16 (vocab ≤ 65535) or uint32 token ids. The shards of a split,
read in manifest order, form one token stream in which every document is followed by EOS. The
manifest is written last, so a split directory without one is an interrupted preparation.

Torch-free, so preparing or inspecting data never imports torch.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from m3run.runner.files import sha256_file

__all__ = [
    "DTYPES",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "SPLITS",
    "DataError",
    "fingerprint",
    "is_int",
    "load_manifest",
]

FORMAT = "m3run-tokens"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
SPLITS = ("train", "val")
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
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


class DataError(ValueError):
    """Missing, corrupt or unusable training data. User-facing; the worker exits with 78."""


def _prepare_hint(out_dir: Path | str) -> str:
    return f"run `m3run prepare-data <inputs> --out {out_dir}`"


def is_int(v: object) -> bool:
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
    if m["dtype"] not in DTYPES:
        raise DataError(f"manifest {path} is corrupt (dtype {m['dtype']!r}): {hint} again")
    vocab, eos = m["vocab_size"], m["eos_id"]
    if not (is_int(vocab) and vocab > 0 and is_int(eos) and 0 <= eos < vocab):
        raise DataError(
            f"manifest {path} is corrupt (vocab_size {vocab!r}, eos_id {eos!r}): {hint} again"
        )
    shards = m["shards"]
    if not isinstance(shards, list):
        raise DataError(f"manifest {path} is corrupt (shards is not a list): {hint} again")
    itemsize = DTYPES[m["dtype"]].itemsize
    total = 0
    for i, s in enumerate(shards):
        ok = (
            isinstance(s, dict)
            and isinstance(s.get("file"), str)
            and Path(s["file"]).name == s["file"]
            and is_int(s.get("tokens"))
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


def fingerprint(split_dirs: Iterable[str | Path]) -> str:
    """A short hash of what the splits hold, from their manifests alone (a manifest lists its
    shards' sha256, so new data means a new manifest): re-preparing data changes it, reading
    it costs a few small files. A split without a readable manifest counts as missing."""
    h = hashlib.sha256()
    for split_dir in split_dirs:
        h.update(str(split_dir).encode() + b"\0")
        try:
            h.update((Path(split_dir) / MANIFEST_NAME).read_bytes())
        except OSError:
            h.update(b"missing")
        h.update(b"\0")
    return h.hexdigest()[:16]
