"""A trained model out of a run dir: sampling text from a checkpoint (`m3run generate`) and a
self-contained export (`m3run export`) that loads back with `Mamba3LM.from_export(dir)`.

An export is a directory of three files: `model.safetensors` (the weights, with the run's step,
config hash and m3run version as metadata), `config.json` (the ModelConfig) and, for a
tokenizer that is a file, `tokenizer.json` (a GPT-2 tiktoken tokenizer is named in config.json
instead: it ships with tiktoken). Torch is imported here; the CLI imports this module only
inside the two commands.
"""

from __future__ import annotations

import json
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


class ExportError(Exception):
    """No checkpoint to read, or nothing to write: the message says what to pass instead."""


@dataclass
class Trained:
    model: Mamba3LM
    tokenizer: Tokenizer
    checkpoint: CheckpointInfo
    config_hash: str


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
    return Trained(model.eval(), load_tokenizer(_train_split(cfg)), info, config_hash(cfg))


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


def export(trained: Trained, out: Path) -> Path:
    """Write the export directory `out` (created; an existing export there is replaced)."""
    out = Path(out)
    if out.exists() and not (out / EXPORT_CONFIG).is_file() and any(out.iterdir()):
        raise ExportError(f"{out} exists and is not an m3run export: pass a new or empty directory")
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in trained.model.state_dict().items()}
    meta = {
        "step": str(trained.checkpoint.step),
        "config_hash": trained.config_hash,
        "m3run_version": __version__,
    }
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
        config["tokenizer"]["source"] = trained.tokenizer.source
    (out / EXPORT_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out
