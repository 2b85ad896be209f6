"""Writing a checkpoint from a host snapshot: the atomic protocol of
:mod:`m3run.runner.checkpoint.layout`, at the disk's speed.

The two data files are written side by side, each hashed on the way out (no file is read back
for its digest) and fsync'd once: model.safetensors on a thread of its own, streamed tensor by
tensor straight from the snapshot's memory (the safetensors library would first copy every
tensor into a bytes object), and optim.pt through torch.save. A write can be cancelled
(`cancel`, a threading.Event): it stops at its next block and leaves nothing behind, for a save
that a newer one supersedes (a stop's save cancels the periodic write in flight).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import struct
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, TYPE_CHECKING

from m3run.runner.checkpoint.layout import (
    DEL_PREFIX,
    FORMAT_VERSION,
    META_FILE,
    MODEL_FILE,
    OPTIM_FILE,
    RESERVED_META_KEYS,
    TMP_PREFIX,
    CheckpointError,
    check_step,
    checkpoint_dir,
    remove_leftovers,
)
from m3run.runner.checkpoint.snapshot import check_model_state
from m3run.runner.files import describe_os_error, fsync_path

if TYPE_CHECKING:
    import torch

# The largest single write: a cancelled write stops within one block.
_BLOCK = 64 << 20


class WriteCancelled(Exception):
    """A checkpoint write stopped because it was cancelled; nothing of it is left on disk."""

    def __init__(self, step: int):
        super().__init__(f"the write of checkpoint step {step} was cancelled")
        self.step = step


class _HashingFile(io.RawIOBase):
    """An unbuffered file that hashes the bytes as it writes them, so a large file is not read
    back for its digest. Each block is hashed on `hasher` while this thread writes it (both
    release the GIL), so the hash costs the write no time on a disk slower than it. Between
    blocks it checks `cancel` and raises _Cancelled once it is set."""

    def __init__(
        self, f: IO[bytes], hasher: ThreadPoolExecutor, cancel: threading.Event | None = None
    ):
        self._f = f
        self._hasher = hasher
        self._cancel = cancel
        self._hash = hashlib.sha256()
        self.nbytes = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        for start in range(0, len(view), _BLOCK):
            if self._cancel is not None and self._cancel.is_set():
                raise _Cancelled
            block = view[start : start + _BLOCK]
            hashed = self._hasher.submit(self._hash.update, block)
            try:
                done = 0
                while done < len(block):  # an unbuffered write may write less than asked
                    done += self._f.write(block[done:])
            finally:
                hashed.result()  # in order, and the caller may reuse `b` once this returns
        self.nbytes += len(view)
        return len(view)

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


class _Cancelled(Exception):
    """Raised inside a file write; write_checkpoint turns it into WriteCancelled."""


def _digest(path: Path, written: _HashingFile) -> dict:
    """A data file's sha256 and size for meta.json, hashed on the way out."""
    size = path.stat().st_size
    if written.nbytes != size:
        raise CheckpointError(f"{path} holds {size} bytes after {written.nbytes} were written")
    return {"sha256": written.hexdigest(), "bytes": size}


# safetensors' names for the dtypes a model state holds.
_SAFETENSORS_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}


def _safetensors_layout(state: Mapping[str, torch.Tensor]) -> tuple[bytes, list]:
    """The file's header (length prefix, JSON, space padding to 8 bytes, as the safetensors
    library writes it) and the tensors in the order their bytes follow it: widest dtype first,
    then by name, so each tensor's data starts aligned to its element size."""
    order = sorted(state.items(), key=lambda kv: (-kv[1].dtype.itemsize, kv[0]))
    # One metadata key only, as the library was given before: the same state, the same bytes.
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in order:
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(
                f"model_state[{name!r}] is {t.dtype}, which m3run does not write to "
                f"safetensors; use one of {', '.join(_SAFETENSORS_DTYPES)}"
            )
        n = t.numel() * t.dtype.itemsize
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, [t for _, t in order]


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy."""
    import torch

    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _write_model_file(
    path: Path, header: bytes, tensors: list, cancel: threading.Event | None
) -> dict:
    """model.safetensors: `header` and the `tensors` in its order (:func:`_safetensors_layout`)."""
    with (
        ThreadPoolExecutor(1, thread_name_prefix="m3run-checkpoint-hash") as hasher,
        open(path, "wb", buffering=0) as f,
    ):
        out = _HashingFile(f, hasher, cancel)
        out.write(header)
        for t in tensors:
            if t.numel():
                out.write(_tensor_bytes(t))
        os.fsync(f.fileno())
    return _digest(path, out)


def _write_optim_file(path: Path, cpu_optim_state: Mapping, cancel: threading.Event | None) -> dict:
    import torch

    with (
        ThreadPoolExecutor(1, thread_name_prefix="m3run-checkpoint-hash") as hasher,
        open(path, "wb", buffering=0) as f,
    ):
        out = _HashingFile(f, hasher, cancel)
        torch.save(dict(cpu_optim_state), out)
        os.fsync(f.fileno())
    return _digest(path, out)


def _build_meta(step: int, meta: Mapping, files: dict) -> str:
    clash = RESERVED_META_KEYS & set(meta)
    if clash:
        raise ValueError(
            f"meta passes reserved key(s) {sorted(clash)}; save_checkpoint writes "
            "these itself, remove them from meta"
        )
    if "step" in meta and meta["step"] != step:
        raise ValueError(
            f"meta['step'] is {meta['step']!r} but the checkpoint step is {step}; "
            "drop 'step' from meta or make them agree"
        )
    full = {
        **meta,
        "step": step,
        "format_version": FORMAT_VERSION,
        "files": files,
        "saved_at": time.time(),
    }
    try:
        return json.dumps(full, indent=2, sort_keys=True) + "\n"
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"meta is not JSON-serialisable ({e}); pass plain ints, floats, strings, "
            "lists and dicts (convert tensors with .item() or .tolist())"
        ) from e


def _write_fsynced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    cpu_model_state: Mapping[str, torch.Tensor],
    cpu_optim_state: Mapping,
    meta: Mapping,
    *,
    before_meta: Callable[[], None] | None = None,
    cancel: threading.Event | None = None,
) -> Path:
    """Write a checkpoint from states already on CPU (the output of `snapshot`) and return its
    directory. Atomic: see the layout module for the protocol. An existing checkpoint for the
    same step is replaced. `before_meta` is called once both data files are written and before
    meta.json (tests inject a slow or failing disk there); an OSError it raises fails the write
    like a real one. Once `cancel` is set, the write stops at its next block (or before
    meta.json) with WriteCancelled, removing what it wrote; a checkpoint already renamed into
    place stays."""
    import torch

    step = check_step(step)
    check_model_state(cpu_model_state)
    for key, t in cpu_model_state.items():
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(
                f"cpu_model_state[{key!r}] is not a contiguous CPU tensor; pass the "
                "output of snapshot(), or call save_checkpoint()"
            )
    # A dtype safetensors cannot name, or meta that is not JSON, fails here, before gigabytes
    # are written.
    header, tensors = _safetensors_layout(cpu_model_state)
    _build_meta(step, meta, {})

    final = checkpoint_dir(run_dir, step)
    root = final.parent
    if not Path(run_dir).is_dir():
        raise CheckpointError(
            f"run directory {run_dir} does not exist; create it (the supervisor "
            "does at launch) before saving checkpoints"
        )
    tmp: Path | None = None
    old: Path | None = None
    try:
        if not root.is_dir():
            root.mkdir(exist_ok=True)
            fsync_path(root.parent, directory=True)
        remove_leftovers(root)
        # Not mkdtemp: its 0700 mode would survive the rename; this one follows the umask.
        tmp = root / f"{TMP_PREFIX}{final.name}-{os.getpid()}-{os.urandom(4).hex()}"
        tmp.mkdir()

        # The two data files side by side (the module docstring says why).
        with ThreadPoolExecutor(1, thread_name_prefix="m3run-checkpoint-model") as pool:
            model_job = pool.submit(_write_model_file, tmp / MODEL_FILE, header, tensors, cancel)
            try:
                optim_digest = _write_optim_file(tmp / OPTIM_FILE, cpu_optim_state, cancel)
            finally:
                model_digest = model_job.result()  # its error first: it started first
        if before_meta is not None:
            before_meta()
        if cancel is not None and cancel.is_set():
            raise _Cancelled
        files = {MODEL_FILE: model_digest, OPTIM_FILE: optim_digest}
        # meta.json last: its presence with matching hashes is what makes the checkpoint complete.
        _write_fsynced(tmp / META_FILE, _build_meta(step, meta, files).encode("utf-8"))
        fsync_path(tmp, directory=True)

        if final.exists():
            old = root / f"{DEL_PREFIX}{final.name}-{os.getpid()}-{os.urandom(4).hex()}"
            os.rename(final, old)
        os.rename(tmp, final)
        tmp = None
        fsync_path(root, directory=True)
    except (OSError, RuntimeError, _Cancelled) as e:
        if any(isinstance(x, _Cancelled) for x in _chain(e)):
            raise WriteCancelled(step) from None
        cause = _os_error_in(e)
        if cause is not None:
            raise CheckpointError(
                f"could not write checkpoint for step {step}: "
                f"{describe_os_error(cause, cause.filename or root)}; the run's earlier "
                "checkpoints are untouched",
                errno=cause.errno,
            ) from e
        raise CheckpointError(
            f"could not write checkpoint for step {step} under {root}: {e}. Check free disk space "
            "and write permission there; the run's earlier checkpoints are untouched"
        ) from e
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            if final.exists():
                shutil.rmtree(old, ignore_errors=True)
            else:  # failed between the two renames: put the previous checkpoint back
                os.rename(old, final)
    return final


def _os_error_in(exc: BaseException) -> OSError | None:
    """The filesystem error behind a failed write. torch.save reports a full disk as
    "unexpected pos" with the OSError as its context."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno is not None:
            return e
        if m := re.search(r"os error (\d+)", str(e)):
            code = int(m.group(1))
            return OSError(code, os.strerror(code))
    return None


def _chain(exc: BaseException | None):
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__
