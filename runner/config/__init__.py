"""The run configuration: one typed, validated schema for a whole training run.

A run is described by a YAML file with one mapping per section::

    model:      {preset: tiny, d_model: 96}   # a ModelConfig; `preset` expands, other keys override
    train:      {total_steps: 300, micro_batch_size: 8, lr: 3.0e-3, warmup_steps: 30, ...}
    data:       {train_path: runs/demo-data/train, seq_len: 256, ...}
    checkpoint: {interval_steps: 50}
    eval / log / supervisor: optional, every key has a default

`load_config(path, overrides)` reads, applies ``section.key=value`` overrides and validates;
every problem comes back as one `ConfigError` whose lines name the key, the bad value and the
fix. `RunConfig.to_yaml()` writes the fully resolved config (every field, the preset name kept)
and loading that text gives an equal config; `config_hash` fingerprints it. A run dir's frozen
config.yaml is read with `load_frozen_config`: a key added after the run was frozen
(`LEGACY_VALUES`) reads at the value that keeps the run's behaviour. Data paths come back
absolute (loading.py says against what), so a frozen config names its data from anywhere.

This module must stay torch-free: the supervisor and the light CLI commands import it.
"""

from m3run.runner.config.base import ConfigError
from m3run.runner.config.loading import (
    LEGACY_VALUES,
    apply_overrides,
    check_config_file,
    config_hash,
    keep_legacy_values,
    load_config,
    load_frozen_config,
    parse_config,
)
from m3run.runner.config.runtime import DistributedConfig, SupervisorConfig
from m3run.runner.config.schema import (
    CheckpointConfig,
    DataConfig,
    DataSourceConfig,
    EvalConfig,
    LogConfig,
    RunConfig,
    TrainConfig,
)

__all__ = [
    "LEGACY_VALUES",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "DataSourceConfig",
    "DistributedConfig",
    "EvalConfig",
    "LogConfig",
    "RunConfig",
    "SupervisorConfig",
    "TrainConfig",
    "apply_overrides",
    "check_config_file",
    "config_hash",
    "keep_legacy_values",
    "load_config",
    "load_frozen_config",
    "parse_config",
]
