"""What the user named, resolved into inputs: files, folders, globs, HF datasets, `stdlib`.

An input is written `LOCATION` or `LOCATION:FIELD` (the text field of its records, dotted for
nested ones), or listed in an inputs file. `resolve_inputs` turns each into an `Input`: the files
to read in a deterministic order and the counts reading fills in. Torch-free.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sysconfig
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from m3run.runner.data.manifest import DataError
from m3run.runner.data.readers import file_format
from m3run.runner.formatting import count

__all__ = ["Input", "read_inputs_file", "resolve_inputs"]

_STDLIB_SKIP_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)
_FIELD = re.compile(r"[A-Za-z_][\w\-]*(\.[A-Za-z_][\w\-]*)*")
_GLOB_CHARS = frozenset("*?[")
HF_PREFIX = "hf:"
_WHAT = (
    "text files, .jsonl(.gz/.zst), .json arrays, parquet or Arrow files, folders or globs of "
    "them, HF `save_to_disk` folders, hf:<dataset folder>, or `stdlib`"
)


@dataclass
class Input:
    """One named input: the files it resolved to and what reading them found."""

    label: str  # as the user wrote it
    kind: str  # "stdlib" | "folder" | "glob" | "file" | "hf-disk" | "hf"
    root: Path
    files: list[Path]
    text_field: str
    documents: int = 0
    tokens: int = 0
    empty: int = 0  # documents dropped: empty, whitespace-only, or a null text
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (file, reason)
    notes: list[str] = field(default_factory=list)

    @property
    def split_text(self) -> bool:
        """A lone text file is one corpus, split into documents; folder members stay whole."""
        return self.kind == "file" and file_format(self.root)[0] == "text"

    def describe(self) -> str:
        extra = ""
        if self.empty:
            extra += f", {self.empty} empty or whitespace-only dropped"
        if self.skipped:
            extra += f", {count(len(self.skipped), 'file')} skipped"
        n_files = len(self.files)
        if self.kind == "stdlib":
            return (
                f"stdlib (Python stdlib .py files under {self.root}): "
                f"{count(self.documents, 'document')} from {count(n_files, 'file')}{extra}"
            )
        what = {"folder": "folder", "glob": "glob", "hf-disk": "HF save_to_disk", "hf": "HF"}
        if self.kind in what:
            return (
                f"{self.label} ({what[self.kind]}): "
                f"{count(self.documents, 'document')} from {count(n_files, 'file')}{extra}"
            )
        fmt = file_format(self.root)[0]
        return f"{self.label} ({fmt}): {count(self.documents, 'document')}{extra}"

    def record(self) -> dict:
        """What the manifest keeps of this input."""
        return {
            "input": self.label,
            "kind": self.kind,
            "text_field": self.text_field,
            "files": len(self.files),
            "documents": self.documents,
            "tokens": self.tokens,
            "empty_dropped": self.empty,
            "skipped": [{"file": f, "reason": r} for f, r in self.skipped],
        }


def split_field(item: str, default_field: str | None) -> tuple[str, str | None]:
    """`LOCATION[:FIELD]` → (location, field). A location that exists is never split."""
    if item == "stdlib" or Path(item).exists():
        return item, default_field
    prefix, body = (HF_PREFIX, item[len(HF_PREFIX) :]) if item.startswith(HF_PREFIX) else ("", item)
    location, sep, name = body.rpartition(":")
    if sep and location and _FIELD.fullmatch(name):
        return prefix + location, name
    return item, default_field


def read_inputs_file(path: str | Path) -> list[tuple[str, str | None]]:
    """An inputs file: a YAML list whose items are `LOCATION[:FIELD]` strings or
    `{path: LOCATION, text_field: FIELD}` mappings; relative paths are taken from its folder."""
    import yaml

    path = Path(path)
    fix = (
        "write a YAML list, e.g.\n  - path: data/fineweb/*.parquet\n    text_field: text\n"
        "  - data/papers.jsonl.gz:body"
    )
    try:
        items = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise DataError(f"cannot read the inputs file {path} ({e}): {fix}") from e
    if not isinstance(items, list) or not items:
        raise DataError(f"the inputs file {path} is not a non-empty YAML list: {fix}")
    out: list[tuple[str, str | None]] = []
    for i, item in enumerate(items):
        if isinstance(item, dict) and set(item) <= {"path", "text_field"} and "path" in item:
            location, text_field = str(item["path"]), item.get("text_field")
        elif isinstance(item, str):
            location, text_field = item, None
        else:
            raise DataError(f"the inputs file {path}: item {i} ({item!r}) is not valid: {fix}")
        prefix = HF_PREFIX if location.startswith(HF_PREFIX) else ""
        rest = location[len(prefix) :]
        if location != "stdlib" and not Path(rest).is_absolute():
            rest = str(path.parent / rest)
        if isinstance(item, str):
            location, text_field = split_field(prefix + rest, None)
        else:
            location = prefix + rest
        out.append((location, None if text_field is None else str(text_field)))
    return out


def _walk_files(root: Path, skip_dir: Callable[[str], bool], exclude: Path | None) -> list[Path]:
    """All files under root in a deterministic (sorted, depth-first) order; an HF
    `save_to_disk` folder below contributes its data files, not its metadata."""
    found = []
    for here, dirs, files in os.walk(root):
        here_path = Path(here)
        dirs[:] = sorted(d for d in dirs if not skip_dir(d))
        if exclude is not None and here_path.resolve() == exclude:
            dirs[:] = []
            continue
        hf_files = hf_disk_files(here_path)
        if hf_files is not None:
            dirs[:] = []
            found.extend(hf_files)
            continue
        found.extend(here_path / f for f in sorted(files) if not f.startswith("."))
    return found


def hf_disk_files(folder: Path) -> list[Path] | None:
    """The Arrow files of a folder written by `datasets`' save_to_disk, in order; None when
    the folder is not one. A DatasetDict folder gives every split's files, splits in order."""
    if (folder / "dataset_dict.json").is_file():
        meta = _read_json(folder / "dataset_dict.json")
        splits = meta.get("splits") if isinstance(meta, dict) else None
        if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
            raise DataError(f"{folder / 'dataset_dict.json'} lists no splits: re-save the dataset")
        files: list[Path] = []
        for split in splits:
            split_files = hf_disk_files(folder / split)
            if split_files is None:
                raise DataError(
                    f"split {split!r} of the HF dataset {folder} is missing its state.json: "
                    "re-save the dataset with save_to_disk"
                )
            files.extend(split_files)
        return files
    if not ((folder / "state.json").is_file() and (folder / "dataset_info.json").is_file()):
        return None
    state = _read_json(folder / "state.json")
    data_files = state.get("_data_files") if isinstance(state, dict) else None
    names = [d.get("filename") for d in data_files or [] if isinstance(d, dict)]
    if not names or not all(isinstance(n, str) and Path(n).name == n for n in names):
        raise DataError(
            f"{folder / 'state.json'} lists no data files: the HF dataset at {folder} is "
            "incomplete; re-save it with save_to_disk"
        )
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise DataError(
            f"the HF dataset at {folder} is missing {', '.join(missing)} (listed in its "
            "state.json): copy the whole folder, or re-save it with save_to_disk"
        )
    return [folder / n for n in names]


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"cannot read {path} ({e}): the HF dataset folder is damaged") from e


def _stdlib_files() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = _walk_files(root, lambda d: d in _STDLIB_SKIP_DIRS or d.startswith("."), exclude=None)
    return root, [f for f in files if f.suffix == ".py"]


def _hidden_or_cache(d: str) -> bool:
    return d.startswith(".") or d == "__pycache__"


def _resolve_one(location: str, text_field: str, exclude: Path) -> Input:
    path = Path(location)
    if location == "stdlib" and not path.exists():
        root, files = _stdlib_files()
        if not files:
            raise DataError(
                f"input `stdlib`: found no .py files under {root}: this Python has no "
                "standard library sources; pass text files or folders instead"
            )
        return Input(location, "stdlib", root, files, text_field)
    if location.startswith(HF_PREFIX):
        folder = Path(location[len(HF_PREFIX) :])
        if not folder.is_dir():
            raise DataError(
                f"input {location}: {folder} is not a folder: hf: takes a local dataset "
                "folder (data files, optionally a README with configs)"
            )
        return Input(location, "hf", folder, [folder], text_field)
    if path.is_dir():
        hf_files = hf_disk_files(path)
        if hf_files is not None:
            return Input(location, "hf-disk", path, hf_files, text_field)
        files = _walk_files(path, _hidden_or_cache, exclude=exclude)
        if not files:
            raise DataError(f"input folder {location} has no files: pass a folder with text")
        return Input(location, "folder", path, files, text_field)
    if path.is_file():
        return Input(location, "file", path, [path], text_field)
    if _GLOB_CHARS & set(location):
        files = []
        for match in sorted(glob.glob(location, recursive=True)):
            m = Path(match)
            if m.is_dir():
                files.extend(_walk_files(m, _hidden_or_cache, exclude=exclude))
            elif not m.name.startswith("."):
                files.append(m)
        if not files:
            raise DataError(f"input glob {location} matches no files: check the pattern")
        return Input(location, "glob", Path(location), files, text_field)
    raise DataError(f"input not found: {location}: pass {_WHAT}")


def resolve_inputs(
    inputs: Sequence[str | tuple[str, str | None]], default_field: str, exclude: Path
) -> list[Input]:
    """Each item is `LOCATION[:FIELD]`, or a (location, field or None) pair from an inputs file."""
    if not inputs:
        raise DataError(f"no inputs given: pass {_WHAT} (this Python's sources, no download)")
    resolved = []
    for item in inputs:
        if isinstance(item, tuple):
            location, text_field = item[0], item[1] or default_field
        else:
            location, text_field = split_field(str(item), default_field)
        resolved.append(_resolve_one(location, text_field, exclude))
    return resolved
