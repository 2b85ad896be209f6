"""Checkpoint mirror: a copy of the run's complete checkpoints and of its history in object
storage, so a run can resume on a node whose local disk is new (spot preemption, a replaced node)
and still read as one run there.

Remote layout, the same as the run dir's::

    <mirror_url>/checkpoints/step_00004000/{model.safetensors, optim.pt, meta.json}
    <mirror_url>/{config.yaml, metrics.jsonl, events.jsonl, tokenizer.json, tensorboard/…}

``mirror_url`` is any fsspec URL with a scheme in runner.config.MIRROR_SCHEMES: ``s3://`` (s3fs),
``gs://`` (gcsfs) or ``file://`` (a shared filesystem). fsspec imports the backend lazily; a
missing one is a `MirrorError` that names the package. Credentials and endpoints come from the
environment (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, ``GOOGLE_APPLICATION_CREDENTIALS``, …).
The launch's probe (runner.supervisor.mirror_probe) lists the mirror and writes and deletes a
small object, so a missing bucket or an unwritable mirror is named at launch instead of being
read as an empty mirror.

Upload protocol (one uploader per run, so one writer per remote prefix):
  1. if the remote step already holds a byte-identical meta.json (and the files it lists, at the
     recorded sizes), nothing is sent;
  2. a remote step that holds a different complete checkpoint (other sha256 digests) is replaced
     only when the caller allows it (`replaceable`: the uploader allows only one found corrupt);
     otherwise `MirrorConflict`, and nothing changes;
  3. a remote meta.json that is replaced is deleted first, so the remote step stops being
     complete before any of its files change;
  4. model.safetensors and optim.pt are streamed up while being hashed; a digest that differs
     from meta.json (the local file changed or rotted) aborts the upload;
  5. meta.json is written LAST. A remote checkpoint is complete only when meta.json parses and
     both files are present at the sizes it records, so an upload cut at any instant leaves a
     remote checkpoint that restore skips.
Remote retention keeps the newest ``keep_last`` complete checkpoints (deleting meta.json first)
and removes incomplete step directories older than the newest complete one; steps of another
history (`apply_retention`'s ``others``) are never deleted and do not count.

Restore downloads a complete remote checkpoint into ``checkpoints/.tmp-…`` (a name the worker's
save cleans up if we are killed), checks both sha256 digests against meta.json, fsyncs, then
renames it into place. Which one, and when, is runner.supervisor.mirror_reconcile's: at
(re)start the newest complete checkpoint wins, local or mirrored.

`MirrorUploader` (in runner.supervisor.mirror_upload) is the background thread the supervisor
runs: it uploads the newest complete checkpoint whenever one appears, and the run's history
with it (runner.supervisor.mirror_history), retries failures with exponential backoff, never
raises, and records its progress in ``<run_dir>/mirror.json`` so `m3run status` can show the
mirror's lag without touching the network (`read_lag`, here).

Torch-free: the supervisor imports this module.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from m3run.runner.checkpoint.layout import (
    DATA_FILES,
    DEL_PREFIX,
    META_FILE,
    TMP_PREFIX,
    CheckpointError,
    CheckpointInfo,
    checkpoint_dir,
    list_checkpoints,
    step_of_dirname,
    verify_checkpoint,
)
from m3run.runner.files import fsync_path, read_json
from m3run.runner.protocol import CHECKPOINTS_DIR

log = logging.getLogger(__name__)

MIRROR_FILE = "mirror.json"  # the uploader's progress in the run dir, read by `m3run status`
_BLOCK = 8 << 20  # local read/write chunk
# Remote buffer: one multipart part per 64 MiB (s3fs needs >= 5 MiB; fewer, larger parts keep a
# 5 GB checkpoint to ~80 requests).
_PART = 64 << 20
_BACKENDS = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}
Identity = tuple[str, str]  # sha256 of (model.safetensors, optim.pt): what a checkpoint holds


class MirrorError(RuntimeError):
    """The mirror cannot be used, or a transfer failed. The message names the URL, the problem
    and what to do."""


class MirrorConflict(MirrorError):
    """The mirror holds a different complete checkpoint of the step being uploaded (another
    history's), which the uploader must not replace."""

    def __init__(self, message: str, step: int, local: Identity, remote: Identity):
        super().__init__(message)
        self.step, self.local, self.remote = step, local, remote


def identity(meta: dict) -> Identity:
    """What a checkpoint holds, by its meta.json: two with the same digests are the same
    checkpoint, whatever else their meta.json says (when it was saved)."""
    files = meta["files"]
    return files[DATA_FILES[0]]["sha256"], files[DATA_FILES[1]]["sha256"]


def short(ident: Identity) -> str:
    """An identity in a message: the digests' first 12 hex digits."""
    return "/".join(d[:12] for d in ident)


@dataclass
class RemoteCheckpoint:
    """One ``step_XXXXXXXX`` directory under the mirror's checkpoints/."""

    step: int
    path: str  # fsspec path (no protocol) of the step directory
    complete: bool
    reason: str | None  # why it is not complete; None when complete
    meta: dict | None  # parsed meta.json when it parses
    meta_bytes: bytes | None  # meta.json exactly as stored


def _meta_problem(meta: Any, step: int) -> str | None:
    """Why a parsed meta.json cannot describe checkpoint `step`, or None."""
    if not isinstance(meta, dict):
        return f"{META_FILE} is not a JSON object"
    if meta.get("step") != step:
        return f"{META_FILE} says step {meta.get('step')!r}, the directory is step {step}"
    files = meta.get("files")
    for name in DATA_FILES:
        rec = files.get(name) if isinstance(files, dict) else None
        if not (
            isinstance(rec, dict)
            and isinstance(rec.get("sha256"), str)
            and isinstance(rec.get("bytes"), int)
        ):
            return f"{META_FILE} has no sha256/bytes record for {name}"
    return None


class Mirror:
    """The remote copy of one run's checkpoints at ``url`` (see the module docstring).

    ``storage_options`` go to the fsspec filesystem (e.g. ``{"client_kwargs":
    {"endpoint_url": ...}}`` for s3fs); by default everything comes from the environment."""

    def __init__(self, url: str, storage_options: dict | None = None):
        import fsspec

        self.url = url.rstrip("/")
        scheme = self.url.partition("://")[0] if "://" in self.url else "file"
        try:
            self.fs, root = fsspec.core.url_to_fs(
                self.url, skip_instance_cache=True, **(storage_options or {})
            )
        except ImportError as e:
            pkg = _BACKENDS.get(scheme, f"the fsspec backend for {scheme}://")
            raise MirrorError(
                f"checkpoint.mirror_url {url!r} needs the {pkg} package, which is not "
                f"installed ({e}) (fix: pip install {pkg} in the image, or set "
                "checkpoint.mirror_url=null)"
            ) from e
        except ValueError as e:
            raise MirrorError(
                f"checkpoint.mirror_url {url!r} is not a usable fsspec URL: {e} (fix: use "
                "s3://bucket/prefix, gs://bucket/prefix or file:///absolute/path)"
            ) from e
        self.root = root.rstrip("/")
        self.scheme = scheme
        self._local = "file" in (
            self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        )

    def __repr__(self) -> str:
        return f"Mirror({self.url!r})"

    # ----------------------------------------------------------------- paths & listing

    @property
    def _ckroot(self) -> str:
        return f"{self.root}/{CHECKPOINTS_DIR}"

    def remote_path(self, step: int) -> str:
        """fsspec path (no protocol) of the remote directory of checkpoint `step`."""
        return f"{self._ckroot}/step_{step:08d}"

    @property
    def is_local(self) -> bool:
        """A file:// mirror: directories exist and a rename is atomic."""
        return self._local

    def list_remote(self) -> list[RemoteCheckpoint]:
        """Every remote step directory, sorted by step, incomplete ones with the reason. One
        listing request plus one read per meta.json; never hashes (downloads are verified)."""
        self.fs.invalidate_cache()
        # A missing prefix lists as empty; FileNotFoundError here is a missing bucket, which
        # must never read as an empty mirror.
        found = self.fs.find(self._ckroot, detail=True)
        sizes: dict[int, dict[str, int]] = {}
        prefix = self._ckroot.lstrip("/") + "/"
        for name, info in found.items():
            rel = name.lstrip("/")
            if not rel.startswith(prefix):
                continue
            parts = rel[len(prefix) :].split("/")
            step = step_of_dirname(parts[0])
            if step is None or len(parts) != 2:
                continue
            sizes.setdefault(step, {})[parts[1]] = int(info.get("size") or 0)
        out = []
        for step in sorted(sizes):
            out.append(self._remote_info(step, sizes[step]))
        return out

    def _remote_info(self, step: int, files: dict[str, int]) -> RemoteCheckpoint:
        path = self.remote_path(step)

        def torn(reason: str, meta: dict | None = None, raw: bytes | None = None):
            return RemoteCheckpoint(step, path, False, reason, meta, raw)

        if META_FILE not in files:
            return torn(f"{META_FILE} missing (the upload did not finish)")
        try:
            raw = self.fs.cat_file(f"{path}/{META_FILE}")
        except FileNotFoundError:
            return torn(f"{META_FILE} vanished while listing (retention or a new upload)")
        try:
            meta = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            return torn(f"{META_FILE} unreadable: {e}", None, raw)
        problem = _meta_problem(meta, step)
        if problem is not None:
            return torn(problem, meta if isinstance(meta, dict) else None, raw)
        for name in DATA_FILES:
            want = meta["files"][name]["bytes"]
            if name not in files:
                return torn(f"{name} missing", meta, raw)
            if files[name] != want:
                return torn(f"{name} is {files[name]} bytes, {META_FILE} records {want}", meta, raw)
        return RemoteCheckpoint(step, path, True, None, meta, raw)

    def latest_remote(self) -> RemoteCheckpoint | None:
        """The newest complete remote checkpoint, or None."""
        complete = [c for c in self.list_remote() if c.complete]
        return complete[-1] if complete else None

    # ----------------------------------------------------------------- upload

    def upload_checkpoint(
        self, local_path: str | os.PathLike, replaceable: Collection[Identity] | None = None
    ) -> bool:
        """Copy one complete local checkpoint directory to the mirror (protocol: module
        docstring). Returns False when the mirror already holds it byte for byte, True after an
        upload. A different complete checkpoint of the same step is replaced only if its
        identity is in `replaceable` (None: any), else MirrorConflict. MirrorError if the local
        checkpoint is not complete or changed during the upload; transport errors (OSError, the
        backend's own) propagate for the caller to retry."""
        local = Path(local_path)
        try:
            meta_bytes = (local / META_FILE).read_bytes()
            meta = json.loads(meta_bytes)
        except FileNotFoundError as e:
            raise MirrorError(
                f"cannot upload {local}: {META_FILE} is missing (the checkpoint is incomplete or "
                "was deleted by retention); only complete checkpoints are mirrored"
            ) from e
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise MirrorError(f"cannot upload {local}: {META_FILE} is unreadable ({e})") from e
        step = meta.get("step") if isinstance(meta, dict) else None
        problem = _meta_problem(meta, step) if isinstance(step, int) else "no step in meta.json"
        if problem is not None:
            raise MirrorError(f"cannot upload {local}: {problem}")

        remote = self.remote_path(step)
        existing = self._remote_meta(remote)
        if existing == meta_bytes and self._remote_sizes_match(remote, meta):
            return False
        if existing is not None:
            self._check_replace(step, meta, replaceable)
            # The step was saved again locally: make the remote copy incomplete before any of
            # its files change, so no reader can pair the new meta with old data or vice versa.
            self.fs.rm_file(f"{remote}/{META_FILE}")
        if self._local:
            self.fs.makedirs(remote, exist_ok=True)
        for name in DATA_FILES:
            rec = meta["files"][name]
            try:
                src = open(local / name, "rb")  # noqa: SIM115 (closed by the with below)
            except FileNotFoundError as e:
                raise MirrorError(
                    f"cannot upload {local}: {name} vanished before its upload (a newer "
                    "checkpoint replaced it); the newest one is uploaded next"
                ) from e
            with src:
                digest, size = self._send(src, f"{remote}/{name}")
            if digest != rec["sha256"] or size != rec["bytes"]:
                raise MirrorError(
                    f"cannot upload {local}: {name} does not match {META_FILE} (sha256 "
                    f"{digest[:12]}…, {size} bytes; recorded {rec['sha256'][:12]}…, "
                    f"{rec['bytes']} bytes). It changed during the upload or is corrupt; "
                    "`m3run checkpoints RUN` shows its state"
                )
        if not self._remote_sizes_match(remote, meta):
            raise MirrorError(
                f"upload of step {step} to {self.url}: the stored files do not have the sizes "
                f"{META_FILE} records; the upload is retried"
            )
        self.fs.pipe_file(f"{remote}/{META_FILE}", meta_bytes)  # LAST: completes the checkpoint
        return True

    def _check_replace(
        self, step: int, meta: dict, replaceable: Collection[Identity] | None
    ) -> None:
        """MirrorConflict when the remote step holds a complete checkpoint other than the local
        one that `replaceable` does not list. An incomplete remote step is no checkpoint."""
        info = self._remote_info(step, self._sizes(self.remote_path(step)))
        if not info.complete or info.meta is None:
            return
        theirs, ours = identity(info.meta), identity(meta)
        if theirs == ours or replaceable is None or theirs in replaceable:
            return
        raise MirrorConflict(
            f"the mirror's step {step} ({self.url}) is another checkpoint than the run dir's "
            f"step {step} (sha256 {short(theirs)} there, {short(ours)} here): the mirror's is "
            f"kept, and the run dir's step {step} is not mirrored",
            step,
            ours,
            theirs,
        )

    def _sizes(self, remote: str) -> dict[str, int]:
        sizes = {}
        self.fs.invalidate_cache(remote)
        for name in (*DATA_FILES, META_FILE):
            with contextlib.suppress(FileNotFoundError):
                sizes[name] = int(self.fs.size(f"{remote}/{name}") or 0)
        return sizes

    def _remote_meta(self, remote: str) -> bytes | None:
        try:
            return self.fs.cat_file(f"{remote}/{META_FILE}")
        except FileNotFoundError:
            return None

    def _remote_sizes_match(self, remote: str, meta: dict) -> bool:
        self.fs.invalidate_cache(remote)
        for name in DATA_FILES:
            try:
                size = self.fs.size(f"{remote}/{name}")
            except FileNotFoundError:
                return False
            if size != meta["files"][name]["bytes"]:
                return False
        return True

    def _send(self, f: Any, dst: str) -> tuple[str, int]:
        """Stream an open local file to the mirror; (sha256, bytes) of exactly what was sent.
        Errors are the mirror's own (the local file is open already)."""
        h, n = hashlib.sha256(), 0
        try:
            with self.fs.open(dst, "wb", block_size=_PART) as out:
                while block := f.read(_BLOCK):
                    h.update(block)
                    out.write(block)
                    n += len(block)
        except BaseException:
            # meta.json is not there, so this file is already ignored; tidy up if we can.
            with contextlib.suppress(Exception):
                self.fs.rm_file(dst)
            raise
        return h.hexdigest(), n

    # ----------------------------------------------------------------- retention

    def apply_retention(
        self, keep_last: int, protect: Iterable[int] = (), others: Iterable[int] = ()
    ) -> list[int]:
        """Delete remote complete checkpoints beyond the newest `keep_last`, and incomplete step
        directories older than the newest complete one, never a step in `protect`. Steps in
        `others` (another history's, newer than where the run resumed) are never deleted and
        do not count. meta.json goes first, so a deletion cut short leaves an incomplete
        (ignored) directory. Returns the deleted steps."""
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(
                f"keep_last must be an int >= 1, got {keep_last!r} (fix: pass checkpoint.keep_last)"
            )
        protect, others = set(protect), set(others)
        infos = [c for c in self.list_remote() if c.step not in others]
        complete = [c for c in infos if c.complete]
        if not complete:
            return []
        newest = complete[-1].step
        doomed = [c for c in complete[:-keep_last] if c.step not in protect]
        doomed += [c for c in infos if not c.complete and c.step < newest and c.step not in protect]
        deleted = []
        for c in sorted(doomed, key=lambda c: c.step):
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(f"{c.path}/{META_FILE}")
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(c.path, recursive=True)
            deleted.append(c.step)
        return deleted

    # ----------------------------------------------------------------- restore

    def download(self, c: RemoteCheckpoint, run_dir: Path) -> Path:
        """Restore remote checkpoint `c` into `run_dir` (verified, then renamed into place over
        a local copy of the same step). CorruptRemote when its bytes do not match its meta.json;
        transport and local write errors propagate."""
        assert c.meta is not None and c.meta_bytes is not None
        final = checkpoint_dir(run_dir, c.step)
        root = final.parent
        root.mkdir(exist_ok=True)
        tmp = root / f"{TMP_PREFIX}{final.name}-{os.getpid()}-{os.urandom(4).hex()}"
        tmp.mkdir()
        try:
            for name in DATA_FILES:
                rec = c.meta["files"][name]
                digest, size = self._fetch(f"{c.path}/{name}", tmp / name)
                if digest != rec["sha256"] or size != rec["bytes"]:
                    raise CorruptRemote(
                        f"{name}: sha256 {digest[:12]}…, {size} bytes; {META_FILE} records "
                        f"{rec['sha256'][:12]}…, {rec['bytes']} bytes"
                    )
            with open(tmp / META_FILE, "wb") as f:  # last, as in a local save
                f.write(c.meta_bytes)
                f.flush()
                os.fsync(f.fileno())
            fsync_path(tmp, directory=True)
            ok, reason = verify_checkpoint(tmp, full=False)
            if not ok:
                raise CorruptRemote(str(reason))
            if final.exists():  # a torn local copy of the same step
                aside = root / f"{DEL_PREFIX}{final.name}-{os.getpid()}-{os.urandom(4).hex()}"
                os.rename(final, aside)
                shutil.rmtree(aside, ignore_errors=True)
            os.rename(tmp, final)
            fsync_path(root, directory=True)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return final

    def _fetch(self, src: str, dst: Path) -> tuple[str, int]:
        h, n = hashlib.sha256(), 0
        with self.fs.open(src, "rb", block_size=_PART) as f, open(dst, "wb") as out:
            while block := f.read(_BLOCK):
                h.update(block)
                out.write(block)
                n += len(block)
            out.flush()
            os.fsync(out.fileno())
        return h.hexdigest(), n

    # ----------------------------------------------------------------- lag

    def lag(self, run_dir: str | os.PathLike, now: float | None = None) -> dict:
        """How far the mirror is behind the run dir, asking the mirror itself (network): the
        newest local and remote complete steps, steps and seconds behind, and the uploader's
        last error from mirror.json. `read_lag` gives the same without the network."""
        remote = self.latest_remote()
        state = read_json(Path(run_dir) / MIRROR_FILE) or {}
        saved = remote.meta.get("saved_at") if remote is not None and remote.meta else None
        return _lag(self.url, Path(run_dir), remote.step if remote else None, saved, state, now)


class CorruptRemote(MirrorError):
    """A remote checkpoint whose bytes do not match its meta.json."""


def local_complete(run_dir: Path) -> list[CheckpointInfo]:
    """The run dir's complete checkpoints by meta.json and sizes (no hashing); [] on a race."""
    try:
        return [i for i in list_checkpoints(run_dir, verify=False) if i.complete]
    except (CheckpointError, OSError):  # no run dir yet, or a listing race with retention
        return []


def _lag(
    url: str,
    run_dir: Path,
    remote_step: int | None,
    remote_saved_at: Any,
    state: dict,
    now: float | None,
) -> dict:
    now = time.time() if now is None else now
    local = local_complete(run_dir)
    local_step = local[-1].step if local else None
    missing = [i for i in local if remote_step is None or i.step > remote_step]
    saved = [
        i.meta.get("saved_at")
        for i in missing
        if i.meta and isinstance(i.meta.get("saved_at"), (int, float))
    ]
    return {
        "url": url,
        "local_step": local_step,
        "remote_step": remote_step,
        "remote_saved_at": remote_saved_at,
        "steps_behind": (local_step - (remote_step or 0)) if missing else 0,
        # Age of the oldest local checkpoint the mirror lacks: how much work a lost disk costs.
        "seconds_behind": max(0.0, now - min(saved)) if saved else 0.0,
        "last_upload_at": state.get("last_upload_at"),
        "last_error": state.get("last_error"),
        "last_error_at": state.get("last_error_at"),
        "failures": state.get("failures", 0),
    }


def read_lag(run_dir: str | os.PathLike, now: float | None = None) -> dict | None:
    """The mirror's lag as the uploader last recorded it in mirror.json, against the run dir's
    checkpoints now; None when no uploader has run here. Reads files only (for `m3run status`)."""
    state = read_json(Path(run_dir) / MIRROR_FILE)
    if state is None:
        return None
    return _lag(
        str(state.get("url")),
        Path(run_dir),
        state.get("remote_step"),
        state.get("remote_saved_at"),
        state,
        now,
    )


def format_lag(lag: dict | None) -> str:
    """One line for `m3run status`."""
    if lag is None:
        return "-"
    where = "empty" if lag["remote_step"] is None else f"step {lag['remote_step']}"
    if lag["steps_behind"]:
        where += f", {lag['steps_behind']} steps / {lag['seconds_behind']:.0f}s behind"
    else:
        where += ", up to date"
    if lag.get("last_error"):
        where += f"; last error: {lag['last_error']}"
    return f"{lag['url']} ({where})"
