"""Checkpoint directories written by hand, torch-free, in the layout runner/checkpoint/layout.py
reads: complete ones (meta.json written last, recording both files' sha256 and size), torn ones
(no meta.json, or a size that does not match it) and corrupt ones (sizes match, a hash does not).
Their data files hold bytes, not tensors: what is under test reads meta.json and hashes."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from m3run.runner.checkpoint.layout import (
    DATA_FILES,
    FORMAT_VERSION,
    META_FILE,
    checkpoint_dir,
)


def write_checkpoint(
    run_dir: Path, step: int, *, lr_scale: object = None, meta_mtime_ns: int | None = None
) -> Path:
    """A complete checkpoint for `step`; `lr_scale` goes into meta.json unless None (a
    checkpoint that predates the field). `meta_mtime_ns` sets meta.json's mtime, so a re-save
    of a step within the filesystem's timestamp resolution still reads as another save."""
    path = checkpoint_dir(run_dir, step)
    path.mkdir(parents=True, exist_ok=True)
    files = {}
    for name in DATA_FILES:
        data = f"{name} of step {step}".encode() * 16
        (path / name).write_bytes(data)
        files[name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    meta: dict = {"format_version": FORMAT_VERSION, "step": step, "files": files}
    if lr_scale is not None:
        meta["lr_scale"] = lr_scale
    (path / META_FILE).write_text(json.dumps(meta))
    if meta_mtime_ns is not None:
        os.utime(path / META_FILE, ns=(meta_mtime_ns, meta_mtime_ns))
    return path


def write_torn(run_dir: Path, step: int, *, with_meta: bool) -> Path:
    """A checkpoint whose writer died: without meta.json, or (`with_meta`) with one whose
    recorded size of a data file is not what is on disk."""
    path = write_checkpoint(run_dir, step)
    if with_meta:
        with open(path / DATA_FILES[0], "ab") as f:
            f.write(b"more")
    else:
        (path / META_FILE).unlink()
    return path


def corrupt(path: Path) -> None:
    """Flip one byte of a data file: sizes still match meta.json, the sha256 no longer does."""
    target = path / DATA_FILES[-1]
    data = bytearray(target.read_bytes())
    data[0] ^= 0xFF
    target.write_bytes(bytes(data))
