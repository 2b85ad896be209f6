"""Launch plans tuned on this machine: `m3run tune-scan` writes them, every scan reads them.

The checked-in table (``launch_table.py``) holds plans for the GPUs the kernels were tuned on; a
GPU it lacks (an A100 where the table has sm90 only) runs the safe defaults. ``m3run tune-scan``
times the candidates on the machine's own GPU, outside any training process, and stores the best
plan here: a JSON file at ``$M3RUN_SCAN_PLANS``, else ``$XDG_CACHE_HOME/m3run/scan_plans.json``
(``~/.cache`` without it). The image and the systemd unit put XDG_CACHE_HOME on storage that
survives restarts, so a restarted worker reads the plan at once and never tunes.

A plan is only as good as the kernels it was timed on: the file records a fingerprint of the
kernels' source and of Triton's version, and a file with another fingerprint is ignored (logged
once, with the command that refreshes it). So is a file that cannot be read or parsed: training
runs on the table or the defaults rather than fail on a cache.

File layout::

    {"fingerprint": "<16 hex>", "plans": {"sm80": {"c32-p64-n64-bf16": {<entry>}}},
     "tuned": {"sm80": {"c32-p64-n64-bf16": {"gpu": "...", "at": "<ISO time>", ...}}}}

An entry is what the checked-in table holds for a shape: ``chunk`` and each kernel's launch.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

from m3run.runner.files import atomic_write_text

log = logging.getLogger(__name__)

PLANS_ENV = "M3RUN_SCAN_PLANS"
TUNE_COMMAND = "m3run tune-scan CONFIG"

# The sources a plan's timing depends on: the kernels and the launchers that size their grids.
_SOURCES = ("triton_common.py", "triton_fwd.py", "triton_bwd.py", "triton_bwd_chunk.py",
            "triton_sums.py")  # fmt: skip

# (arch, shape key) → entry, read from the file once a process (None: not read yet). Read when
# launching is imported (:func:`load`), so that torch.compile, which traces the scan's
# callers through ``plan_for``, only ever sees a dict here, never a file read.
_entries: dict[tuple[str, str], dict] | None = None
_validate: Callable[[dict], str | None] = lambda entry: None  # noqa: E731
_warned: set[tuple[Path, str]] = set()


def plans_path() -> Path:
    """Where this machine's tuned plans live (see the module docstring)."""
    explicit = os.environ.get(PLANS_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "m3run" / "scan_plans.json"


def fingerprint() -> str:
    """A digest of the kernels' source and Triton's version: plans timed on other kernels do
    not apply."""
    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = "none"
    h = hashlib.sha256()
    h.update(triton_version.encode())
    here = Path(__file__).resolve().parent
    for name in _SOURCES:
        h.update(name.encode())
        h.update((here / name).read_bytes())
    return h.hexdigest()[:16]


def _warn_once(path: Path, why: str) -> None:
    if (path, why) not in _warned:
        _warned.add((path, why))
        log.warning("mamba3 scan: ignoring the tuned launch plans in %s: %s", path, why)


def _read(path: Path) -> dict[tuple[str, str], dict]:
    """The file's usable entries ({} when there is no usable file)."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        _warn_once(path, f"cannot read it ({e}); run `{TUNE_COMMAND}` again to rewrite it")
        return {}
    if not isinstance(doc, dict) or not isinstance(doc.get("plans"), dict):
        _warn_once(path, f"it is not a plans file; run `{TUNE_COMMAND}` again to rewrite it")
        return {}
    if doc.get("fingerprint") != fingerprint():
        _warn_once(path, "they were tuned on other kernels or another Triton version; run "
                         f"`{TUNE_COMMAND}` again on this GPU")  # fmt: skip
        return {}
    entries = {}
    for arch, shapes in doc["plans"].items():
        for key, entry in shapes.items() if isinstance(shapes, dict) else ():
            why = _validate(entry) if isinstance(entry, dict) else "not a mapping"
            if why is None:
                entries[(arch, key)] = entry
            else:
                _warn_once(path, f"the plan for {arch} {key} is not usable ({why}); run "
                                 f"`{TUNE_COMMAND}` again")  # fmt: skip
    return entries


def load(validate: Callable[[dict], str | None] | None = None) -> None:
    """Read the file now (``validate`` says why an entry makes no plan, or None; kept for later
    reads). launching calls it once, when imported."""
    global _entries, _validate
    if validate is not None:
        _validate = validate
    _entries = _read(plans_path())


def entries() -> dict[tuple[str, str], dict]:
    """This machine's tuned entries by (architecture, shape key), read from the file once a
    process: a plan tuned meanwhile applies from the next process on (a worker's next restart).
    A new dict after every read, so callers may keep what they derived from one beside it."""
    if _entries is None:
        load()
    return _entries


def lookup(arch: str, key: str) -> dict | None:
    """This machine's tuned entry for the architecture and shape key, or None."""
    return entries().get((arch, key))


def reload() -> None:
    """Read the file again now (after a tune, or with another ``M3RUN_SCAN_PLANS``)."""
    load()


def store(arch: str, keys: list[str], entry: dict, about: dict,
          path: Path | None = None) -> Path:  # fmt: skip
    """Merge ``entry`` under ``arch`` for each shape key into the plans file (runner.files'
    atomic write, fsynced: a reader sees the old file or the new one).
    Plans of the file tuned on other kernels are dropped. ``about`` (the GPU, when, the shape
    timed) is kept beside each entry for people. Returns the path."""
    path = plans_path() if path is None else path
    fp = fingerprint()
    doc: dict = {"fingerprint": fp, "plans": {}, "tuned": {}}
    try:
        old = json.loads(path.read_text())
        if isinstance(old, dict) and old.get("fingerprint") == fp:
            doc["plans"] = dict(old.get("plans") or {})
            doc["tuned"] = dict(old.get("tuned") or {})
    except (OSError, ValueError):
        pass  # no file, or one that is rewritten whole
    for key in keys:
        doc["plans"].setdefault(arch, {})[key] = entry
        doc["tuned"].setdefault(arch, {})[key] = about
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(doc, indent=1, sort_keys=True) + "\n", fsync=True)
    reload()
    return path
