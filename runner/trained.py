"""A run's trained model as files, found and checked without torch: its frozen config, a
complete checkpoint and its tokenizer, and the folder an export may write to. `m3run generate`
and `m3run export` check all of this (and their arguments) before they import torch, so a
wrong argument fails at once.

The tokenizer is the run dir's own tokenizer.json, kept there at the first launch; a run dir
without one (trained by the worker alone, or launched before m3run kept it) falls back on the
data folder its config names."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from m3run.runner.checkpoint.layout import (
    CheckpointError,
    CheckpointInfo,
    find_step,
    latest_complete,
)
from m3run.runner.config import ConfigError, RunConfig, config_hash, load_frozen_config
from m3run.runner.data.manifest import DataError
from m3run.runner.data.tokenizer import Tokenizer, load_tokenizer
from m3run.runner.protocol import CONFIG_FILE, TOKENIZER_FILE

# The marker file of an export folder: only a folder holding it is one a later export replaces.
EXPORT_MARKER = "m3run-export.json"


class ExportError(Exception):
    """No checkpoint to read, or nothing to write: the message says what to pass instead."""


@dataclass
class TrainedRun:
    run_dir: Path
    config: RunConfig
    checkpoint: CheckpointInfo
    tokenizer: Tokenizer
    config_hash: str

    @property
    def context(self) -> int:
        """Tokens per training window (data.seq_len): how far the model was trained to look."""
        return self.config.data.seq_len


def find_trained(
    run_dir: Path,
    step: int | None = None,
    check: Callable[[RunConfig, Tokenizer], None] | None = None,
) -> TrainedRun:
    """The run's checkpoint at `step` (default: its newest complete one), its frozen config and
    its tokenizer. ExportError names what is missing and what to do. `check` sees the config
    and the tokenizer before the checkpoint is hashed (seconds for a large model): a caller's
    checks of its own arguments against the run fail at once."""
    run_dir = Path(run_dir)
    try:
        cfg = load_frozen_config(run_dir / CONFIG_FILE)
    except ConfigError as e:
        raise ExportError(str(e)) from None
    tokenizer = run_tokenizer(run_dir, cfg)
    if check is not None:
        check(cfg, tokenizer)
    try:
        info = find_step(run_dir, step) if step is not None else latest_complete(run_dir)
    except CheckpointError as e:
        raise ExportError(str(e)) from None
    if info is None:
        raise ExportError(
            f"{run_dir} has no complete checkpoint yet; train until one is saved "
            "(checkpoint.interval_steps), or pass another run"
        )
    return TrainedRun(run_dir, cfg, info, tokenizer, config_hash(cfg))


def _listing(out: Path, shown: int = 5) -> str:
    names = sorted(p.name for p in out.iterdir())
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def check_export_dir(out: Path) -> None:
    """Refuse an export folder OUT in which an export would overwrite someone else's files: a
    file, a symlink, or a non-empty directory without the marker of an earlier export."""
    if out.is_symlink():
        raise ExportError(
            f"{out} is a symlink (to {os.readlink(out)}), not a directory; "
            "pass a new or empty directory"
        )
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} is a file, not a directory; pass a new or empty directory")
    if out.is_dir() and not (out / EXPORT_MARKER).is_file() and any(out.iterdir()):
        raise ExportError(
            f"{out} is not an m3run export (no {EXPORT_MARKER}) and holds {_listing(out)}; "
            "pass a new or empty directory, or remove it"
        )


def run_tokenizer(run_dir: Path, cfg: RunConfig) -> Tokenizer:
    """The run dir's tokenizer.json; for a run dir without one, the tokenizer its data was
    prepared with."""
    kept = run_dir / TOKENIZER_FILE
    try:
        if kept.is_file():
            return Tokenizer.load("hf", str(kept))
        split = Path(cfg.data.train_paths()[0])
        if not split.is_dir():
            where = "" if split.is_absolute() else f" (from {Path.cwd()})"
            raise ExportError(
                f"{run_dir} has no {TOKENIZER_FILE} (`m3run launch` keeps one; this run dir was "
                f"made without it, or before it did) and the data folder its config names, "
                f"{split}{where}, is not there to read the "
                f"tokenizer from. Fix: run this from the directory the run was launched from, "
                f"copy the data's tokenizer.json into {run_dir} (for bpe:N data it is beside "
                f"train/), or relaunch the run once, which keeps it"
            )
        return load_tokenizer(split)
    except DataError as e:
        raise ExportError(f"cannot load the run's tokenizer: {e}") from None
