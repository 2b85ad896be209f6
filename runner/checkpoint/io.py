"""Saving and loading checkpoints (torch): the write protocol of
:mod:`m3run.runner.checkpoint.layout`, the snapshot buffers and the background writer.

Saving without stalling training (`SnapshotBuffers`, `BackgroundWriter`): the training loop only
waits for `snapshot(..., buffers=...)`, a device→host copy into CPU tensors allocated once (pinned
when the source is on CUDA) and reused by every later snapshot; `write_checkpoint` and retention
then run on one background thread while training goes on. The caller keeps at most one write in
flight and must not snapshot into the buffers again before collecting it, since the writer is
still reading them.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

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
    dir_bytes,
    read_and_verify,
    remove_leftovers,
)
from m3run.runner.files import apply_umask, describe_os_error, fsync_path, sha256_file

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
# --------------------------------------------------------------------------- saving

_LEAF_TYPES = (type(None), bool, int, float, complex, str, bytes)


def _check_model_state(model_state: Mapping) -> None:
    import torch

    if not isinstance(model_state, Mapping):
        raise ValueError(
            f"model_state must be a dict of tensors, got "
            f"{type(model_state).__name__}; pass model.state_dict()"
        )
    by_storage: dict[tuple[str, int], str] = {}
    for key, t in model_state.items():
        if not isinstance(key, str):
            raise ValueError(
                f"model_state key {key!r} is not a string; safetensors names tensors by string keys"
            )
        if not isinstance(t, torch.Tensor):
            raise ValueError(
                f"model_state[{key!r}] is a {type(t).__name__}, not a tensor; move "
                "non-tensor state into meta or optim_state"
            )
        if t.is_sparse or t.device.type == "meta":
            raise ValueError(
                f"model_state[{key!r}] is a {t.layout}/{t.device} tensor; only dense "
                "tensors with data can be saved"
            )
        if t.numel() == 0:
            continue
        sid = (str(t.device), t.untyped_storage().data_ptr())
        if sid in by_storage:
            raise ValueError(
                f"model_state[{key!r}] shares storage with model_state[{by_storage[sid]!r}]; "
                "safetensors would store them as separate tensors and the alias would be lost on "
                "load. Tie weights by using one Parameter, or drop the alias from the state dict"
            )
        by_storage[sid] = key


def _cpu_copy(t: torch.Tensor, where: str = "") -> torch.Tensor:
    import torch

    out = torch.empty(t.shape, dtype=t.dtype, device="cpu")  # contiguous
    out.copy_(t.detach())
    return out


class SnapshotBuffers:
    """CPU destination tensors for `snapshot`, allocated on first use and reused by every later
    snapshot of the same state, so a checkpoint costs a device→host copy and no allocation.

    A buffer is pinned (page-locked) when its source tensor is on CUDA, so the copy runs at full
    PCIe/NVLink speed without a bounce buffer; expect host memory equal to the state's size (for
    the 434m preset with AdamW: ~5.2 GB) to stay locked for the life of the process. Buffers are
    keyed by their place in the state tree; one whose shape or dtype changed is reallocated, and
    buffers whose key disappeared are released.

    The tensors a snapshot returns ARE the buffers: the next snapshot overwrites them. Collect the
    write that reads them (`BackgroundWriter.join`/`result`) before snapshotting again."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}
        self._used: set[str] = set()
        self._cuda_devices: set = set()
        self.allocated_bytes = 0  # bytes allocated by the latest snapshot (0 once warm)

    @property
    def nbytes(self) -> int:
        """Host memory held by the buffers."""
        return sum(b.numel() * b.element_size() for b in self._bufs.values())

    def _begin(self) -> None:
        self._used = set()
        self._cuda_devices = set()
        self.allocated_bytes = 0

    def copy(self, t: torch.Tensor, key: str) -> torch.Tensor:
        import torch

        src = t.detach()
        buf = self._bufs.get(key)
        fresh = key in self._used  # the same key twice in one tree (e.g. set members)
        if fresh or buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            pin = src.device.type == "cuda"
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)
            self.allocated_bytes += buf.numel() * buf.element_size()
            if not fresh:
                self._bufs[key] = buf
        self._used.add(key)
        if src.device.type == "cuda" and buf.is_pinned():
            # Queued on the current stream, so it reads the state as of this point even though
            # the call returns at once; `_end` waits for it.
            buf.copy_(src, non_blocking=True)
            self._cuda_devices.add(src.device)
        else:
            buf.copy_(src)
        return buf

    def _wait(self) -> None:
        import torch

        for device in self._cuda_devices:
            torch.cuda.synchronize(device)

    def _release_unused(self) -> None:
        for key in set(self._bufs) - self._used:
            del self._bufs[key]


def _copy_tree(
    obj: Any, where: str, copy: Callable[[torch.Tensor, str], torch.Tensor] = _cpu_copy
) -> Any:
    """Deep copy of optimizer-side state with tensors moved to CPU (by `copy`), refusing anything
    torch.load(weights_only=True) cannot read back. `where` names the value in errors."""
    import torch

    if isinstance(obj, torch.Tensor):
        return copy(obj, f"optim{where}")
    if isinstance(obj, (*_LEAF_TYPES, torch.dtype, torch.device, torch.Size)):
        return obj
    if type(obj) in (dict, OrderedDict):
        out = type(obj)()
        for k, v in obj.items():
            if not isinstance(k, _LEAF_TYPES):
                raise ValueError(
                    f"optim_state{where} has a key of type {type(k).__name__}; use str or int keys"
                )
            out[k] = _copy_tree(v, f"{where}[{k!r}]", copy)
        return out
    if type(obj) in (list, tuple):
        return type(obj)(_copy_tree(v, f"{where}[{i}]", copy) for i, v in enumerate(obj))
    if type(obj) is set:
        return {_copy_tree(v, f"{where}{{}}", copy) for v in obj}
    raise ValueError(
        f"optim_state{where} is a {type(obj).__module__}.{type(obj).__qualname__}, which "
        "torch.load(weights_only=True) cannot read back; store it as tensors and plain "
        "containers (e.g. torch.from_numpy(array), a dict instead of an object)"
    )


def snapshot(
    model_state: Mapping[str, torch.Tensor],
    optim_state: Mapping,
    *,
    buffers: SnapshotBuffers | None = None,
) -> tuple[dict[str, torch.Tensor], dict]:
    """Copy both states to contiguous CPU tensors that share nothing with the live training
    state, validating them on the way. The slow disk part (`write_checkpoint`) can then run while
    training continues. Without `buffers` every tensor is freshly allocated; with them the copies
    land in (and the result aliases) the reused buffers. Either way the copy is complete when this
    returns, and the written checkpoint is byte-for-byte the same."""
    _check_model_state(model_state)
    if not isinstance(optim_state, Mapping):
        raise ValueError(f"optim_state must be a dict, got {type(optim_state).__name__}")
    if buffers is None:
        return {k: _cpu_copy(t) for k, t in model_state.items()}, _copy_tree(dict(optim_state), "")
    buffers._begin()
    try:
        cpu_model = {k: buffers.copy(t, f"model[{k!r}]") for k, t in model_state.items()}
        cpu_optim = _copy_tree(dict(optim_state), "", buffers.copy)
    finally:
        buffers._wait()  # never hand out (or leave) a copy still in flight
    buffers._release_unused()
    return cpu_model, cpu_optim


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


class _HashingFile(io.RawIOBase):
    """An unbuffered file that hashes the bytes as it writes them, so a large file is not
    read back for its digest. Each block is hashed on `hasher` while this thread writes it
    (both release the GIL), so the hash costs the write no time on a disk slower than it."""

    def __init__(self, f: IO[bytes], hasher: ThreadPoolExecutor):
        self._f = f
        self._hasher = hasher
        self._hash = hashlib.sha256()
        self.nbytes = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        hashed = self._hasher.submit(self._hash.update, view)
        try:
            done = 0
            while done < len(view):  # an unbuffered write may write less than asked
                done += self._f.write(view[done:])
        finally:
            hashed.result()  # the caller may reuse `b` once this returns
        self.nbytes += done
        return done

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def _digest(path: Path, written: _HashingFile | None = None) -> dict:
    """A data file's sha256 and size for meta.json: hashed on the way out when `written` wrote
    exactly the file's bytes (a writer that seeks back to patch a header would not), else read
    back."""
    size = path.stat().st_size
    if written is not None and written.nbytes == size:
        return {"sha256": written.hexdigest(), "bytes": size}
    return {"sha256": sha256_file(path), "bytes": size}


def _write_model_file(path: Path, cpu_model_state: Mapping[str, torch.Tensor]) -> dict:
    from safetensors.torch import save_file

    # One metadata key only: safetensors writes its metadata map in no fixed order, and the
    # same state must always give the same bytes (and sha256).
    save_file(dict(cpu_model_state), path, metadata={"format": "pt"})
    apply_umask(path)  # safetensors creates it 0600
    fsync_path(path)
    return _digest(path)  # safetensors writes the file itself: read back, beside optim.pt


def _write_optim_file(path: Path, cpu_optim_state: Mapping) -> dict:
    import torch

    with (
        ThreadPoolExecutor(1, thread_name_prefix="m3run-checkpoint-hash") as hasher,
        open(path, "wb", buffering=0) as f,
    ):
        out = _HashingFile(f, hasher)
        torch.save(dict(cpu_optim_state), out)
        os.fsync(f.fileno())
    return _digest(path, out)


def write_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    cpu_model_state: Mapping[str, torch.Tensor],
    cpu_optim_state: Mapping,
    meta: Mapping,
    *,
    before_meta: Callable[[], None] | None = None,
) -> Path:
    """Write a checkpoint from states already on CPU (the output of `snapshot`) and return its
    directory. Atomic: see the module docstring for the protocol. An existing checkpoint for the
    same step is replaced. `before_meta` is called once both data files are written and before
    meta.json (tests inject a slow or failing disk there); an OSError it raises fails the write
    like a real one."""
    import torch
    from safetensors import SafetensorError

    step = check_step(step)
    _check_model_state(cpu_model_state)
    for key, t in cpu_model_state.items():
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(
                f"cpu_model_state[{key!r}] is not a contiguous CPU tensor; pass the "
                "output of snapshot(), or call save_checkpoint()"
            )
    _build_meta(step, meta, {})  # fail on bad meta before writing gigabytes

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

        # The two data files are written side by side, each fsync'd once: the model file and
        # its read-back digest on a thread of their own while optim.pt (twice its size with
        # AdamW) is written and hashed on the way out here, so a fast disk waits on neither
        # the serialisation nor the hashing of the other file.
        with ThreadPoolExecutor(1, thread_name_prefix="m3run-checkpoint-model") as pool:
            model_job = pool.submit(_write_model_file, tmp / MODEL_FILE, cpu_model_state)
            try:
                optim_digest = _write_optim_file(tmp / OPTIM_FILE, cpu_optim_state)
            finally:
                model_digest = model_job.result()  # its error first: it started first
        if before_meta is not None:
            before_meta()
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
    except (OSError, RuntimeError, SafetensorError) as e:
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
    "unexpected pos" with the OSError as its context; safetensors names it "os error N"."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno is not None:
            return exc
        if m := re.search(r"os error (\d+)", str(exc)):
            code = int(m.group(1))
            return OSError(code, os.strerror(code))
        exc = exc.__cause__ or exc.__context__
    return None


def save_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    model_state: Mapping[str, torch.Tensor],
    optim_state: Mapping,
    meta: Mapping,
) -> Path:
    """`snapshot` then `write_checkpoint`. `meta` is the caller's part of meta.json (tokens_seen,
    data_state, config_hash, versions, …); step, format_version, files (sha256 + bytes of
    model.safetensors and optim.pt) and saved_at (unix seconds) are added."""
    cpu_model, cpu_optim = snapshot(model_state, optim_state)
    return write_checkpoint(run_dir, step, cpu_model, cpu_optim, meta)


# --------------------------------------------------------------------------- background writes


@dataclass
class SaveResult:
    """A checkpoint the background writer finished: complete on disk, retention applied."""

    step: int
    path: Path
    write_s: float  # write + fsync + rename + retention, seconds
    bytes: int  # size on disk of the checkpoint directory (the triple)


def timed_write(step: int, job: Callable[[], Path]) -> SaveResult:
    """Run `job` (write the checkpoint for `step`, return its directory) and time it."""
    t0 = time.perf_counter()
    path = job()
    return SaveResult(step, path, time.perf_counter() - t0, dir_bytes(path))


class BackgroundWriter:
    """Runs one checkpoint write at a time on a background thread.

    `submit(step, job)` starts `job()` (which writes a checkpoint and returns its directory) and
    returns at once; `join()` waits for it; `result()` hands over the finished write exactly
    once, re-raising its failure as a CheckpointError in the caller's thread. Nothing is reported
    complete until `job` has returned, i.e. until meta.json is on disk and renamed into place.

    The thread is not a daemon: an interpreter that exits with a write in flight finishes it
    first (a kill -9 leaves a torn `.tmp-*` directory, which discovery ignores)."""

    def __init__(self, name: str = "m3run-checkpoint-writer") -> None:
        self.name = name
        self._thread: threading.Thread | None = None
        self._step: int | None = None
        self._t0 = 0.0
        self._result: SaveResult | None = None
        self._error: BaseException | None = None

    @property
    def pending_step(self) -> int | None:
        """The step of the write submitted and not yet collected by `result()` (running or
        finished), else None."""
        return self._step

    @property
    def elapsed_s(self) -> float:
        """Seconds since the pending write started (0 when none is pending)."""
        return time.perf_counter() - self._t0 if self._step is not None else 0.0

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def finished(self) -> bool:
        """A write is pending and has ended (successfully or not): `result()` will not block."""
        return self._step is not None and not self.running()

    def submit(self, step: int, job: Callable[[], Path]) -> None:
        if self._step is not None:
            raise RuntimeError(
                f"the checkpoint write for step {self._step} has not been collected; call "
                f"join() and result() before submitting the write for step {step}"
            )
        self._step, self._result, self._error = step, None, None
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, args=(step, job), name=self.name)
        self._thread.start()

    def _run(self, step: int, job: Callable[[], Path]) -> None:
        try:
            self._result = timed_write(step, job)
        except BaseException as e:  # handed to the caller's thread by result()
            self._error = e

    def join(self, timeout: float | None = None) -> bool:
        """Wait up to `timeout` seconds (None: for as long as it takes) for the pending write.
        True when no write is running any more."""
        if self._thread is not None:
            self._thread.join(timeout)
        return not self.running()

    def result(self) -> SaveResult:
        """The finished write (then nothing is pending). CheckpointError when it failed; the
        message names the step, the cause and what to check."""
        if self._step is None or self.running():
            raise RuntimeError("no finished checkpoint write to collect; call join() first")
        step, error, result = self._step, self._error, self._result
        self._step, self._thread, self._error, self._result = None, None, None, None
        if error is not None:
            if isinstance(error, CheckpointError):
                raise CheckpointError(
                    f"background checkpoint write failed: {error}", errno=error.errno
                ) from error
            raise CheckpointError(
                f"background checkpoint write for step {step} failed with "
                f"{type(error).__name__}: {error}. Nothing was reported complete for this step; "
                "the earlier checkpoints are untouched (the traceback below shows where it failed)"
            ) from error
        assert result is not None
        return result


# --------------------------------------------------------------------------- loading


def load_checkpoint(
    path: str | os.PathLike,
    map_location: str | torch.device = "cpu",
    *,
    hashes_checked: bool = False,
) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """(model_state, optim_state, meta) of a checkpoint directory, after checking both sha256
    digests (only presence and sizes with ``hashes_checked``, for a checkpoint that
    `latest_complete`/`find_step` has just verified: hashing 5 GB twice costs seconds).
    CheckpointError if it is torn or corrupt. optim.pt is read with
    torch.load(weights_only=True), memory-mapped."""
    import pickle

    import torch
    from safetensors.torch import load_file

    path = Path(path)
    meta, reason = read_and_verify(path, full=not hashes_checked)
    if reason is not None:
        raise CheckpointError(
            f"checkpoint {path} is not complete: {reason}. Pick a complete one "
            f"(`m3run checkpoints {path.parent.parent}` lists them) or delete this directory"
        )
    assert meta is not None
    device = str(map_location)
    try:
        model_state = load_file(str(path / MODEL_FILE), device=device)
        # mmap: the tensors are read from the page cache where they are used (a copy to the
        # GPU, or in place on CPU: a private mapping, so no write reaches the file), not first
        # copied into fresh memory, which for a 434m run's 3.5 GB of moments took seconds.
        optim_state = torch.load(
            path / OPTIM_FILE, map_location=map_location, weights_only=True, mmap=True
        )
    except (OSError, pickle.UnpicklingError, RuntimeError) as e:
        raise CheckpointError(
            f"checkpoint {path} passed its hash check but could not be loaded onto "
            f"map_location={map_location!r}: {e}. If the device is the problem, load with "
            "map_location='cpu'; otherwise the files were not written by m3run's save_checkpoint, "
            "so pick another checkpoint"
        ) from e
    if not isinstance(optim_state, dict):
        raise CheckpointError(
            f"{path / OPTIM_FILE} holds a {type(optim_state).__name__}, expected "
            "a dict; pick another checkpoint"
        )
    return model_state, optim_state, meta
