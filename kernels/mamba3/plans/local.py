"""Launch plans tuned on this machine: `m3run tune-scan` writes them, every scan reads them.

The checked-in table (``table.py``) holds plans for the GPUs the kernels were tuned on; a GPU it
lacks runs the safe defaults. ``m3run tune-scan`` times the candidates on the machine's own GPU,
outside any training process, and stores the best plan here: a JSON file at
``$M3RUN_SCAN_PLANS``, else ``$XDG_CACHE_HOME/m3run/scan_plans.json`` (``~/.cache`` without it).
The image and the systemd unit put XDG_CACHE_HOME on storage that survives restarts, so a
restarted worker reads the plan at once and never tunes.

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
import secrets
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

PLANS_ENV = "M3RUN_SCAN_PLANS"
TUNE_COMMAND = "m3run tune-scan CONFIG"

# The sources a plan's timing depends on: the kernels and the launchers that size their grids.
_SOURCES = (
    "triton_common.py",
    "triton_fwd.py",
    "triton_bwd.py",
    "triton_bwd_chunk.py",
    "triton_sums.py",
)
_KERNELS_DIR = Path(__file__).resolve().parent.parent


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
    for name in _SOURCES:
        h.update(name.encode())
        h.update((_KERNELS_DIR / name).read_bytes())
    return h.hexdigest()[:16]


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, fsync it and rename it over ``path``:
    a reader (another worker starting) sees the old file or the new one, never half of it. The
    kernels keep their own copy of this rather than import the runner's."""
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class LocalPlans:
    """This machine's plans file, read once, on first use (a lookup), and again after a store
    or :meth:`reload`. Its entries are held by (architecture, shape key); ``validate`` says why
    an entry makes no plan (None: it does), and such an entry is skipped with a warning."""

    def __init__(self, validate: Callable[[dict], str | None] = lambda entry: None) -> None:
        self._validate = validate
        self._entries: dict[tuple[str, str], dict] | None = None  # None: not read yet
        self._warned: set[tuple[Path, str]] = set()

    def entries(self) -> dict[tuple[str, str], dict]:
        """The usable entries, read from the file at the first call: a plan tuned later by
        another process applies from the next process on (or after :meth:`reload`). A new dict
        after every read, so callers may keep what they derived from one beside it."""
        if self._entries is None:
            self.reload()
        return self._entries

    def lookup(self, arch: str, key: str) -> dict | None:
        """This machine's tuned entry for the architecture and shape key, or None."""
        return self.entries().get((arch, key))

    def reload(self) -> None:
        """Read the file again now (after a tune, or with another ``M3RUN_SCAN_PLANS``)."""
        self._entries = self._read(plans_path())

    def store(
        self, arch: str, keys: list[str], entry: dict, about: dict, path: Path | None = None
    ) -> Path:
        """Merge ``entry`` under ``arch`` for each shape key into the plans file, written
        atomically and fsynced, then read it again. Plans of the file tuned on other kernels
        are dropped. ``about`` (the GPU, when, the shape timed) is kept beside each entry for
        people. Returns the path."""
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
        write_atomically(path, json.dumps(doc, indent=1, sort_keys=True) + "\n")
        self.reload()
        return path

    def _warn_once(self, path: Path, why: str) -> None:
        if (path, why) not in self._warned:
            self._warned.add((path, why))
            log.warning("mamba3 scan: ignoring the tuned launch plans in %s: %s", path, why)

    def _read(self, path: Path) -> dict[tuple[str, str], dict]:
        """The file's usable entries ({} when there is no usable file)."""
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            self._warn_once(path, f"cannot read it ({e}); run `{TUNE_COMMAND}` again to rewrite it")
            return {}
        if not isinstance(doc, dict) or not isinstance(doc.get("plans"), dict):
            self._warn_once(
                path, f"it is not a plans file; run `{TUNE_COMMAND}` again to rewrite it"
            )
            return {}
        if doc.get("fingerprint") != fingerprint():
            self._warn_once(
                path,
                "they were tuned on other kernels or another Triton version; "
                f"run `{TUNE_COMMAND}` again on this GPU",
            )
            return {}
        entries = {}
        for arch, shapes in doc["plans"].items():
            for key, entry in shapes.items() if isinstance(shapes, dict) else ():
                why = self._validate(entry) if isinstance(entry, dict) else "not a mapping"
                if why is None:
                    entries[(arch, key)] = entry
                else:
                    self._warn_once(
                        path,
                        f"the plan for {arch} {key} is not usable ({why}); "
                        f"run `{TUNE_COMMAND}` again",
                    )
        return entries
