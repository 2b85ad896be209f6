"""What the supervisor is told: its section of the run config, the worker's heartbeat cadence
and the checkpoint mirror, plus two knobs that are not in the config (tests tighten them).

Defaults are not spelled here: each config-backed field takes its default from the schema in
runner.config, so the two cannot drift apart.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from m3run.runner.config import CheckpointConfig, LogConfig, SupervisorConfig, TrainConfig


def _default(section: type, name: str) -> Any:
    return field(default=section.model_fields[name].default)


@dataclass(frozen=True)
class SupervisorSettings:
    """The supervisor section of the run config (same names), plus:

    * ``heartbeat_interval_s`` (log.heartbeat_interval_s): a training worker writes
      heartbeat.json this often at most;
    * ``train_device`` (train.device): where the run asks to train, which the health gate's
      line on a host without a GPU follows;
    * ``mirror_url``, ``mirror_keep_last``, ``mirror_flush_s`` (checkpoint.mirror_url,
      .keep_last, .mirror_flush_s): the object-storage mirror the supervisor keeps up to date
      (None: no mirror), how many checkpoints it keeps there, and how long it waits at the end
      of the run for the newest checkpoint to reach it;
    * ``min_heartbeat_timeout_s``, ``min_startup_timeout_s``, ``poll_s``: not in the config.
      Floors under the calibrated hang allowances of a training and of a starting worker
      (scheduler jitter, page-cache flushes and GC pauses must never look like a hang; see
      runner.supervisor.hang) and the watch loop's poll period;
    * ``gpu_release_timeout_s``, ``health_timeout_s``: how long to wait for a dead worker's GPU
      memory to be released before a relaunch, and for the NVML probe.
    """

    max_restarts: int = _default(SupervisorConfig, "max_restarts")
    restart_window_s: float = _default(SupervisorConfig, "restart_window_s")
    no_progress_restarts: int = _default(SupervisorConfig, "no_progress_restarts")
    backoff_initial_s: float = _default(SupervisorConfig, "backoff_initial_s")
    backoff_max_s: float = _default(SupervisorConfig, "backoff_max_s")
    startup_timeout_s: float = _default(SupervisorConfig, "startup_timeout_s")
    heartbeat_timeout_s: float | None = _default(SupervisorConfig, "heartbeat_timeout_s")
    heartbeat_safety_factor: float = _default(SupervisorConfig, "heartbeat_safety_factor")
    stop_grace_s: float = _default(SupervisorConfig, "stop_grace_s")
    nan_lr_factor: float = _default(SupervisorConfig, "nan_lr_factor")
    preemption_provider: str = _default(SupervisorConfig, "preemption_provider")
    preemption_poll_s: float = _default(SupervisorConfig, "preemption_poll_s")
    metadata_url: str | None = _default(SupervisorConfig, "metadata_url")
    smoke: bool = _default(SupervisorConfig, "smoke")
    vram_warn_fraction: float = _default(SupervisorConfig, "vram_warn_fraction")
    warm_spare: bool | str = _default(SupervisorConfig, "warm_spare")
    heartbeat_interval_s: float = _default(LogConfig, "heartbeat_interval_s")
    train_device: str = _default(TrainConfig, "device")
    mirror_url: str | None = _default(CheckpointConfig, "mirror_url")
    mirror_keep_last: int = _default(CheckpointConfig, "keep_last")
    mirror_flush_s: float = _default(CheckpointConfig, "mirror_flush_s")
    min_heartbeat_timeout_s: float = 30.0
    min_startup_timeout_s: float = 60.0
    poll_s: float = 0.2
    gpu_release_timeout_s: float = 60.0
    health_timeout_s: float = 30.0

    @classmethod
    def from_config(cls, cfg: Any, **extra: Any) -> SupervisorSettings:
        sup = cfg.supervisor
        # Every field the config's supervisor section also has, by name: a new config key
        # reaches the supervisor without a second list to keep in step.
        names = [f.name for f in dataclasses.fields(cls) if f.name in type(sup).model_fields]
        values = {n: getattr(sup, n) for n in names}
        values["heartbeat_interval_s"] = cfg.log.heartbeat_interval_s
        values["train_device"] = cfg.train.device
        values["mirror_url"] = cfg.checkpoint.mirror_url
        values["mirror_keep_last"] = cfg.checkpoint.keep_last
        values["mirror_flush_s"] = cfg.checkpoint.mirror_flush_s
        values.update(extra)
        return cls(**values)
