"""Atomic, verifiable checkpoints: `<run_dir>/checkpoints/step_00004000/{model.safetensors,
optim.pt, meta.json}`.

Two halves with different import weights:

* discovery and verification (`checkpoint_dir`, `verify_checkpoint`, `list_checkpoints`,
  `latest_complete`, `find_step`, `apply_retention`, `format_checkpoint_table`, `sha256_file`)
  are plain Python. The supervisor and the light CLI commands use them and never import torch.
* saving and loading (`snapshot`, `write_checkpoint`, `save_checkpoint`, `load_checkpoint`)
  import torch and safetensors inside the function.

Write protocol (one worker owns a run dir, so there is one writer at a time):
  1. remove stale `.tmp-*` / `.del-*` entries left by a writer that was killed;
  2. write model.safetensors and optim.pt into `checkpoints/.tmp-step_XXXXXXXX-<pid>-<rand>/`,
     fsync each, hash what was written;
  3. write meta.json LAST (it records the sha256 and size of the other two), fsync it, fsync the
     directory;
  4. rename the directory into place (an existing one for the same step is first renamed aside
     to `.del-*`), fsync `checkpoints/`, remove the old copy.
A checkpoint is *complete* only when meta.json parses and both hashes match, so a writer killed
at any instant leaves either a complete checkpoint or one that discovery reports as torn.

Saving without stalling training (`SnapshotBuffers`, `BackgroundWriter`): the training loop only
waits for `snapshot(..., buffers=...)`, a device→host copy into CPU tensors allocated once (pinned
when the source is on CUDA) and reused by every later snapshot; `write_checkpoint` (the protocol
above, unchanged) and retention then run on one background thread while training goes on. The
caller keeps at most one write in flight and must not snapshot into the buffers again before
collecting it, since the writer is still reading them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optim.pt"
META_FILE = "meta.json"
DATA_FILES = (MODEL_FILE, OPTIM_FILE)
CHECKPOINTS_SUBDIR = "checkpoints"
TMP_PREFIX = ".tmp-"
DEL_PREFIX = ".del-"
# Keys save_checkpoint writes itself; a caller passing them would be silently overwritten.
RESERVED_META_KEYS = frozenset({"format_version", "files", "saved_at"})

_STEP_DIR_RE = re.compile(r"^step_(\d{8,})$")
_HASH_BLOCK = 1 << 20  # 1 MiB: large enough that hashlib runs without the GIL most of the time


class CheckpointError(RuntimeError):
    """A checkpoint is missing, torn or corrupt, or could not be written. The message names the
    path and what to do about it."""


@dataclass
class CheckpointInfo:
    """One `step_XXXXXXXX` directory as discovery sees it."""

    step: int
    path: Path
    complete: bool
    reason: str | None  # why it is not complete; None when complete
    meta: dict | None  # parsed meta.json when it parses, else None


# --------------------------------------------------------------------------- paths & hashing


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(
            f"checkpoint step must be a non-negative int, got {step!r}; pass the "
            "optimizer step count"
        )
    return step


def checkpoint_dir(run_dir: str | os.PathLike, step: int) -> Path:
    """`<run_dir>/checkpoints/step_<step zero-padded to 8 digits>`."""
    return Path(run_dir) / CHECKPOINTS_SUBDIR / f"step_{_check_step(step):08d}"


def step_of_dirname(name: str) -> int | None:
    """The step of a canonical checkpoint directory name, or None for anything else."""
    m = _STEP_DIR_RE.match(name)
    if m is None:
        return None
    step = int(m.group(1))
    # Only the canonical spelling, so `step_4000` and `step_00004000` cannot both claim a step.
    return step if name == f"step_{step:08d}" else None


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


def fsync_path(path: Path, directory: bool = False) -> None:
    """fsync a file's data, or with `directory=True` a directory's entries (renames)."""
    flags = os.O_RDONLY | (os.O_DIRECTORY if directory else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_dir(path: Path) -> None:
    """Rename aside to `.del-*`, make the rename durable, then delete. A crash mid-delete leaves
    only a `.del-*` directory, which discovery ignores and the next save removes."""
    aside = path.parent / f"{DEL_PREFIX}{path.name}-{os.getpid()}-{os.urandom(4).hex()}"
    os.rename(path, aside)
    fsync_path(path.parent, directory=True)
    shutil.rmtree(aside, ignore_errors=True)


def _remove_stale(root: Path) -> None:
    """Remove `.tmp-*` and `.del-*` left by a killed writer. Safe because one worker owns the run
    dir: nothing else can be writing here while this process saves."""
    for entry in os.scandir(root):
        if entry.name.startswith((TMP_PREFIX, DEL_PREFIX)):
            log.info("removing stale checkpoint leftover %s", entry.path)
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                Path(entry.path).unlink(missing_ok=True)


# --------------------------------------------------------------------------- verification


def _read_meta(path: Path) -> tuple[dict | None, str | None]:
    meta_path = path / META_FILE
    if not meta_path.is_file():
        return None, f"{META_FILE} missing (the writer stopped before finishing)"
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, f"{META_FILE} unreadable: {e}"
    if not isinstance(meta, dict):
        return None, f"{META_FILE} is a JSON {type(meta).__name__}, expected an object"
    return meta, None


def _check_meta(path: Path, meta: dict) -> str | None:
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        if isinstance(version, int) and version > FORMAT_VERSION:
            return (
                f"format_version {version} is newer than this m3run reads ({FORMAT_VERSION}); "
                "upgrade m3run"
            )
        return f"format_version {version!r} is not supported (expected {FORMAT_VERSION})"
    dir_step = step_of_dirname(path.name)
    if dir_step is not None and meta.get("step") != dir_step:
        return f"{META_FILE} says step {meta.get('step')!r} but the directory is {path.name}"
    files = meta.get("files")
    if not isinstance(files, dict):
        return f"{META_FILE} has no 'files' table"
    for name in DATA_FILES:
        rec = files.get(name)
        if (
            not isinstance(rec, dict)
            or not isinstance(rec.get("sha256"), str)
            or not isinstance(rec.get("bytes"), int)
        ):
            return f"{META_FILE} has no sha256/bytes record for {name}"
    return None


def _verify(path: Path, full: bool) -> tuple[dict | None, str | None]:
    if not path.is_dir():
        return None, "not a directory" if path.exists() else "does not exist"
    meta, reason = _read_meta(path)
    if meta is None:
        return None, reason
    reason = _check_meta(path, meta)
    if reason is not None:
        return meta, reason
    for name in DATA_FILES:
        rec = meta["files"][name]
        fpath = path / name
        try:
            size = fpath.stat().st_size
        except FileNotFoundError:
            return meta, f"{name} missing"
        if size != rec["bytes"]:
            return meta, f"{name} is {size} bytes, {META_FILE} records {rec['bytes']}"
        if full:
            try:
                digest = sha256_file(fpath)
            except FileNotFoundError:  # removed by retention while being read
                return meta, f"{name} vanished while being verified"
            if digest != rec["sha256"]:
                return meta, (
                    f"sha256 mismatch in {name} (recorded {rec['sha256'][:12]}…, "
                    f"found {digest[:12]}…)"
                )
    return meta, None


def verify_checkpoint(path: str | os.PathLike, full: bool = True) -> tuple[bool, str | None]:
    """(complete, reason). `full=False` checks meta.json and the file sizes only (no hashing);
    `full=True` also checks both sha256 digests. Never imports torch."""
    _, reason = _verify(Path(path), full)
    return reason is None, reason


# --------------------------------------------------------------------------- discovery


def _checkpoints_root(run_dir: str | os.PathLike) -> Path:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(
            f"run directory {run_dir} does not exist; pass the run directory "
            "(runs/<name>) that holds checkpoints/"
        )
    return run_dir / CHECKPOINTS_SUBDIR


def _step_dirs(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every canonical step directory, ascending; leftovers are ignored."""
    root = _checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for entry in os.scandir(root):
        step = step_of_dirname(entry.name)
        if step is not None and entry.is_dir(follow_symlinks=False):
            found.append((step, Path(entry.path)))
    return sorted(found)


def _info(step: int, path: Path, full: bool) -> CheckpointInfo:
    meta, reason = _verify(path, full)
    return CheckpointInfo(step=step, path=path, complete=reason is None, reason=reason, meta=meta)


def list_checkpoints(run_dir: str | os.PathLike, verify: bool = True) -> list[CheckpointInfo]:
    """Every step directory under `<run_dir>/checkpoints`, sorted by step, incomplete ones
    included with the reason. `verify=True` hashes both files of each checkpoint; `verify=False`
    checks meta.json and sizes only (fast, what `m3run status` uses). `.tmp-*` and `.del-*`
    leftovers are not listed."""
    return [_info(step, path, full=verify) for step, path in _step_dirs(run_dir)]


def latest_complete(
    run_dir: str | os.PathLike, before_step: int | None = None
) -> CheckpointInfo | None:
    """The newest fully verified checkpoint (with step < before_step if given), or None. Hashes
    newest first and stops at the first complete one."""
    for step, path in reversed(_step_dirs(run_dir)):
        if before_step is not None and step >= before_step:
            continue
        info = _info(step, path, full=True)
        if info.complete:
            return info
        log.warning("skipping incomplete checkpoint %s: %s", path, info.reason)
    return None


def _complete_steps_text(run_dir: str | os.PathLike) -> str:
    # Sizes only: this is an error message, and hashing every checkpoint could take minutes.
    steps = [i.step for i in list_checkpoints(run_dir, verify=False) if i.complete]
    return ", ".join(map(str, steps)) if steps else "none"


def find_step(run_dir: str | os.PathLike, step: int) -> CheckpointInfo:
    """The fully verified checkpoint for `step`; CheckpointError if it is missing or incomplete."""
    path = checkpoint_dir(run_dir, step)
    root = _checkpoints_root(run_dir)
    if not path.is_dir():
        raise CheckpointError(
            f"no checkpoint for step {step} in {root}; complete checkpoints: "
            f"{_complete_steps_text(run_dir)}. Resume from one of these, or omit the step to "
            "resume from the latest complete one"
        )
    info = _info(step, path, full=True)
    if not info.complete:
        raise CheckpointError(
            f"checkpoint {path} is incomplete: {info.reason}. Complete checkpoints: "
            f"{_complete_steps_text(run_dir)}. Resume from one of these, or omit the step to "
            "resume from the latest complete one"
        )
    return info


# --------------------------------------------------------------------------- retention


def apply_retention(
    run_dir: str | os.PathLike, keep_last: int, protect: Iterable[int] = frozenset()
) -> list[int]:
    """Delete complete checkpoints beyond the newest `keep_last` and incomplete step directories
    older than the newest complete one, never a step in `protect`. Returns the deleted steps.

    Completeness here is meta.json + sizes (no hashing): retention runs after every save and
    hashing every kept checkpoint each time would cost more than the save."""
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(
            f"keep_last must be an int >= 1, got {keep_last!r}; to keep every "
            "checkpoint, do not call apply_retention"
        )
    protect = set(protect)
    infos = list_checkpoints(run_dir, verify=False)
    complete = [i for i in infos if i.complete]
    if not complete:
        return []
    newest_complete = complete[-1].step
    doomed = [i for i in complete[:-keep_last] if i.step not in protect]
    doomed += [
        i for i in infos if not i.complete and i.step < newest_complete and i.step not in protect
    ]
    deleted = []
    for info in sorted(doomed, key=lambda i: i.step):
        _remove_dir(info.path)
        deleted.append(info.step)
    return deleted


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
    from safetensors.torch import save_file

    step = _check_step(step)
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
        _remove_stale(root)
        # Not mkdtemp: its 0700 mode would survive the rename; this one follows the umask.
        tmp = root / f"{TMP_PREFIX}{final.name}-{os.getpid()}-{os.urandom(4).hex()}"
        tmp.mkdir()

        # One metadata key only: safetensors writes its metadata map in no fixed order, and the
        # same state must always give the same bytes (and sha256).
        save_file(dict(cpu_model_state), tmp / MODEL_FILE, metadata={"format": "pt"})
        fsync_path(tmp / MODEL_FILE)
        with open(tmp / OPTIM_FILE, "wb") as f:
            torch.save(dict(cpu_optim_state), f)
            f.flush()
            os.fsync(f.fileno())
        if before_meta is not None:
            before_meta()
        # Hash what was written (read back from the page cache), not what we meant to write.
        files = {
            name: {"sha256": sha256_file(tmp / name), "bytes": (tmp / name).stat().st_size}
            for name in DATA_FILES
        }
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
    return SaveResult(step, path, time.perf_counter() - t0, _dir_bytes(path))


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
                raise CheckpointError(f"background checkpoint write failed: {error}") from error
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
    torch.load(weights_only=True)."""
    import pickle

    import torch
    from safetensors.torch import load_file

    path = Path(path)
    meta, reason = _verify(path, full=not hashes_checked)
    if reason is not None:
        raise CheckpointError(
            f"checkpoint {path} is not complete: {reason}. Pick a complete one "
            f"(`m3run checkpoints {path.parent.parent}` lists them) or delete this directory"
        )
    assert meta is not None
    device = str(map_location)
    try:
        model_state = load_file(str(path / MODEL_FILE), device=device)
        optim_state = torch.load(path / OPTIM_FILE, map_location=map_location, weights_only=True)
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


# --------------------------------------------------------------------------- display


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _dir_bytes(path: Path) -> int:
    try:
        return sum(e.stat().st_size for e in os.scandir(path) if e.is_file(follow_symlinks=False))
    except OSError:
        return 0


def format_checkpoint_table(infos: Iterable[CheckpointInfo]) -> str:
    """Plain-text table for `m3run checkpoints DIR`: step, status, size on disk, saved_at (UTC)."""
    rows = [("STEP", "STATUS", "SIZE", "SAVED_AT (UTC)")]
    for info in infos:
        status = "complete" if info.complete else f"torn: {info.reason}"
        saved = info.meta.get("saved_at") if info.meta else None
        saved_text = (
            time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(saved))
            if isinstance(saved, (int, float))
            else "-"
        )
        rows.append((str(info.step), status, _human_bytes(_dir_bytes(info.path)), saved_text))
    if len(rows) == 1:
        return "no checkpoints"
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(
        f"{r[0]:>{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}".rstrip()
        for r in rows
    )
