"""Saving and loading checkpoints (torch): `save_checkpoint` (a snapshot, then the write of
:mod:`m3run.runner.checkpoint.write`) and `load_checkpoint`. The layout, discovery and
verification are :mod:`m3run.runner.checkpoint.layout`'s (torch-free); saving without stalling
training is :mod:`~m3run.runner.checkpoint.snapshot`'s and
:mod:`~m3run.runner.checkpoint.background`'s.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from m3run.runner.checkpoint.layout import (
    MODEL_FILE,
    OPTIM_FILE,
    CheckpointError,
    read_and_verify,
)
from m3run.runner.checkpoint.snapshot import snapshot
from m3run.runner.checkpoint.write import write_checkpoint

if TYPE_CHECKING:
    import torch


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
