"""A run's trained model as files, found and checked without torch: its frozen config, a
complete checkpoint and its tokenizer. `m3run generate` and `m3run export` check all of this
(and their arguments) before they import torch, so a wrong argument fails at once.

The tokenizer is the run dir's own tokenizer.json, kept there at the first launch; a run dir
launched before m3run kept one falls back on the data folder its config names."""

from __future__ import annotations

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


def find_trained(run_dir: Path, step: int | None = None) -> TrainedRun:
    """The run's checkpoint at `step` (default: its newest complete one), its frozen config and
    its tokenizer. ExportError names what is missing and what to do."""
    run_dir = Path(run_dir)
    try:
        cfg = load_frozen_config(run_dir / CONFIG_FILE)
        info = find_step(run_dir, step) if step is not None else latest_complete(run_dir)
    except (ConfigError, CheckpointError) as e:
        raise ExportError(str(e)) from None
    if info is None:
        raise ExportError(
            f"{run_dir} has no complete checkpoint yet; train until one is saved "
            "(checkpoint.interval_steps), or pass another run"
        )
    return TrainedRun(run_dir, cfg, info, run_tokenizer(run_dir, cfg), config_hash(cfg))


def run_tokenizer(run_dir: Path, cfg: RunConfig) -> Tokenizer:
    """The run dir's tokenizer.json; for a run dir without one, the tokenizer its data was
    prepared with."""
    kept = run_dir / TOKENIZER_FILE
    try:
        if kept.is_file():
            return Tokenizer.load("hf", str(kept))
        split = Path(cfg.data.train_path or cfg.data.sources[0].path)
        if not split.is_dir():
            where = "" if split.is_absolute() else f" (from {Path.cwd()})"
            raise ExportError(
                f"{run_dir} has no {TOKENIZER_FILE} (it was launched before m3run kept one) and "
                f"the data folder its config names, {split}{where}, is not there to read the "
                f"tokenizer from. Fix: run this from the directory the run was launched from, "
                f"copy the data's tokenizer.json into {run_dir} (for bpe:N data it is beside "
                f"train/), or relaunch the run once, which keeps it"
            )
        return load_tokenizer(split)
    except DataError as e:
        raise ExportError(f"cannot load the run's tokenizer: {e}") from None
