"""Data paths in a frozen config: made absolute when a run dir's config is frozen, so that the
run dir names its data wherever a later command (a relaunch, `generate`, `export`) runs from.
Torch-free."""

from __future__ import annotations

import os

from m3run.runner.config.base import ConfigError
from m3run.runner.config.schema import RunConfig


def _absolute(path: str) -> str:
    """`path` against the working directory (the one the worker reads it from). A URL is kept;
    symlinks are kept too, so a data folder that is a link to the current version still
    follows the link."""
    if "://" in path or os.path.isabs(path):
        return path
    return os.path.abspath(path)


def _kept(path: str, frozen: str | None) -> str:
    """The absolute `path`, or the frozen config's relative spelling of the same place: a run
    frozen before paths were resolved keeps its config text, and so its hash."""
    resolved = _absolute(path)
    if frozen is not None and not os.path.isabs(frozen) and _absolute(frozen) == resolved:
        return frozen
    return resolved


def resolve_data_paths(cfg: RunConfig, frozen: RunConfig | None = None) -> RunConfig:
    """`cfg` with every relative data path (train_path, val_path, each source's path) made
    absolute against the working directory. `frozen` is the run dir's config on a relaunch: a
    path it holds relative (frozen before m3run resolved paths) that names the same place is
    kept as it is, so the old run is no config change."""
    data = cfg.data
    old = frozen.data if frozen is not None else None
    update: dict = {}
    if data.train_path is not None:
        update["train_path"] = _kept(data.train_path, old.train_path if old else None)
    if data.val_path is not None:
        update["val_path"] = _kept(data.val_path, old.val_path if old else None)
    if data.sources:
        old_sources = old.sources if old is not None and old.sources else []
        paired = (
            old_sources if len(old_sources) == len(data.sources) else [None] * len(data.sources)
        )
        update["sources"] = [
            s.model_copy(update={"path": _kept(s.path, o.path if o is not None else None)})
            for s, o in zip(data.sources, paired, strict=True)
        ]
    if all(getattr(data, k) == v for k, v in update.items()):
        return cfg
    paths = [s.path for s in update.get("sources", [])]
    twice = sorted({p for p in paths if paths.count(p) > 1})
    if twice:
        raise ConfigError(
            f"data.sources: two sources name the same folder {twice[0]} (spelled two ways, "
            "e.g. a/train and ./a/train) (fix: list each prepared split once)"
        )
    return cfg.model_copy(update={"data": data.model_copy(update=update)})
