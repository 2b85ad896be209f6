"""Loading a verified checkpoint back into a running worker: the model, the optimizer, the
trainer's counters, the data position and the RNG state, for a resume at start and for a NaN
rollback alike."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from m3run.runner.checkpoint import layout as ckpt
from m3run.runner.checkpoint.io import load_checkpoint
from m3run.runner.config import ConfigError, RunConfig, config_hash
from m3run.runner.data.manifest import DataError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful

    from m3run.runner.data.loader import BatchLoader


def restore(
    path: Path,
    *,
    cfg: RunConfig,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    counters: Stateful,
    loader: BatchLoader,
    device: torch.device,
    force: bool,
) -> int:
    """Restore the model, the optimizer, the trainer's `counters`, the data position and the
    RNG state from a checkpoint whose hashes were just verified; its step. ConfigError when its
    tensors do not fit this config's model (exit 78); UnloadableCheckpoint when its contents
    cannot be read back (another structure, a refused unpickle). `force`: a checkpoint of
    another config loads without a warning."""
    try:
        model_state, state, meta = load_checkpoint(path, hashes_checked=True)
    except ckpt.CheckpointError as e:
        raise UnloadableCheckpoint(str(e)) from e
    _check_fits(path, model_state, model.state_dict())
    if meta.get("config_hash") not in (None, config_hash(cfg)) and not force:
        print(
            f"warning: checkpoint {path.name} was written under a different config "
            "(model or schedule changes apply from here on)"
        )
    try:
        model.load_state_dict(model_state)
        optimizer.load_state_dict(state["optimizer"])
        counters.load_state_dict(state)
        loader.load_state_dict(state["data"])
        torch.set_rng_state(state["rng"]["torch"])
        if device.type == "cuda" and state["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(state["rng"]["cuda"], device)
        return int(state["step"])
    except (ConfigError, DataError):
        raise
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise UnloadableCheckpoint(
            f"{path / ckpt.OPTIM_FILE} does not hold what this m3run writes "
            f"({type(e).__name__}: {e})"
        ) from e


class UnloadableCheckpoint(Exception):
    """A checkpoint whose digests match but whose contents cannot be loaded back."""


def _check_fits(path: Path, saved: dict, model: dict) -> None:
    """ConfigError naming every tensor of `saved` that does not fit the model."""
    problems = [f"{k}: missing from the checkpoint" for k in sorted(set(model) - set(saved))]
    problems += [f"{k}: not in the model" for k in sorted(set(saved) - set(model))]
    problems += [
        f"{k}: {tuple(saved[k].shape)} in the checkpoint, {tuple(model[k].shape)} in the model"
        for k in sorted(set(model) & set(saved))
        if tuple(saved[k].shape) != tuple(model[k].shape)
    ]
    if problems:
        shown = "; ".join(problems[:6]) + (
            f"; … {len(problems) - 6} more" if len(problems) > 6 else ""
        )
        raise ConfigError(
            f"checkpoint {path} does not fit the model this config builds ({shown}). Fix: "
            "resume with the config it was written with, or start over with "
            "--resume none --force"
        )
