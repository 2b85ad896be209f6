"""A trained model out of a run dir: sampling text from a checkpoint (`m3run generate`) and a
self-contained export (`m3run export`) that loads back with `Mamba3LM.from_export(dir)`.

An export is a directory of `model.safetensors` (the weights, with the run's step, config hash
and m3run version as metadata), `config.json` (the ModelConfig), for a tokenizer that is a file
`tokenizer.json` (a GPT-2 tiktoken tokenizer is named in config.json instead: it ships with
tiktoken), and the marker file `EXPORT_MARKER` (the run and step exported). Only the marker
makes a directory an export that a later export may replace: a `config.json` alone does not,
since a Hugging Face model folder has one too. Torch is imported here; the CLI imports this
module only inside the two commands.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from m3run.model import Mamba3LM
from m3run.runner import __version__
from m3run.runner.checkpoint.io import load_checkpoint
from m3run.runner.checkpoint.layout import (
    CheckpointError,
    CheckpointInfo,
    find_step,
    latest_complete,
)
from m3run.runner.config import ConfigError, config_hash, load_frozen_config
from m3run.runner.data.tokenizer import Tokenizer, load_tokenizer
from m3run.runner.files import apply_umask
from m3run.runner.protocol import CONFIG_FILE

EXPORT_WEIGHTS = "model.safetensors"
EXPORT_CONFIG = "config.json"
EXPORT_TOKENIZER = "tokenizer.json"
EXPORT_MARKER = "m3run-export.json"


class ExportError(Exception):
    """No checkpoint to read, or nothing to write: the message says what to pass instead."""


@dataclass
class Trained:
    model: Mamba3LM
    tokenizer: Tokenizer
    checkpoint: CheckpointInfo
    config_hash: str
    run_dir: Path


def _train_split(cfg) -> Path:
    data = cfg.data
    return Path(data.train_path if data.train_path else data.sources[0].path)


def load_trained(run_dir: Path, step: int | None = None) -> Trained:
    """The run's model at `step` (default: its newest complete checkpoint) and its tokenizer."""
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
    model = Mamba3LM(cfg.model)
    model.load_state_dict(load_checkpoint(info.path, hashes_checked=True)[0])
    tokenizer = load_tokenizer(_train_split(cfg))
    return Trained(model.eval(), tokenizer, info, config_hash(cfg), run_dir)


def generate(
    trained: Trained,
    prompt: str,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    seed: int,
) -> str:
    """The prompt's continuation (decoded, prompt excluded)."""
    ids = trained.tokenizer.encode(prompt)
    if not ids:
        raise ExportError("--prompt is empty after tokenisation; give at least one character")
    torch.manual_seed(seed)
    out = trained.model.generate(
        torch.tensor([ids]), max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p
    )
    return trained.tokenizer.decode(out[0, len(ids) :].tolist())


def _listing(out: Path, shown: int = 5) -> str:
    names = sorted(p.name for p in out.iterdir())
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _check_out(out: Path) -> None:
    """Refuse an OUT that an export would overwrite someone else's files in."""
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


def export(trained: Trained, out: Path) -> Path:
    """Write the export directory `out`: created when missing, refused when it holds anything
    but an earlier export (which is replaced)."""
    out = Path(out)
    _check_out(out)
    try:
        _write(trained, out)
    except OSError as e:
        raise ExportError(
            f"cannot write the export to {out}: {e.strerror or e}; pass a directory you can write"
        ) from None
    return out


def _write(trained: Trained, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "step": str(trained.checkpoint.step),
        "config_hash": trained.config_hash,
        "m3run_version": __version__,
    }
    # The marker goes first: an export killed half-way is still ours to replace on the retry.
    marker = {"run": str(trained.run_dir.resolve()), "step": trained.checkpoint.step}
    (out / EXPORT_MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
    state = {k: v.contiguous() for k, v in trained.model.state_dict().items()}
    save_file(state, out / EXPORT_WEIGHTS, metadata=meta)
    apply_umask(out / EXPORT_WEIGHTS)
    config = {
        "model": trained.model.config.model_dump(mode="json"),
        "tokenizer": {
            "kind": trained.tokenizer.kind,
            "source": Path(trained.tokenizer.source).name,
        },
        **meta,
    }
    if trained.tokenizer.kind == "hf":
        shutil.copyfile(trained.tokenizer.source, out / EXPORT_TOKENIZER)
        config["tokenizer"]["source"] = EXPORT_TOKENIZER
    else:
        # A tokenizer.json left by an earlier export of another run would contradict config.json.
        (out / EXPORT_TOKENIZER).unlink(missing_ok=True)
        config["tokenizer"]["source"] = trained.tokenizer.source
    (out / EXPORT_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
