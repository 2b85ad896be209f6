"""The run configuration's schema: one typed, validated section per part of a run (train,
data, checkpoint, eval, log; the supervisor and distributed sections are in `runtime`) and the
whole `RunConfig`. Every field says what it is; validation lives here. Torch-free: the
supervisor and the light CLI commands import it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import yaml
from pydantic import (
    Field,
    PrivateAttr,
    field_serializer,
    field_validator,
    model_validator,
)

from m3run.model.config import PRESETS, ModelConfig
from m3run.runner.config.base import (
    ConfigError,
    _Section,
    check_preset_name,
    did_you_mean,
)
from m3run.runner.config.runtime import DistributedConfig, SupervisorConfig

# torch.compile's documented modes that the training step can run; a typo here would otherwise
# surface only after the worker's (possibly long) startup.
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
# torch.compile's modes that capture CUDA graphs. The step cannot replay one: with gradient
# accumulation it reads a graph's outputs (the gradients it accumulates, the tied embedding's)
# after the next replay has overwritten them, and under compile_scope=blocks one graph serves
# every layer. On a GPU the first backward fails.
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")

# fsspec protocols a checkpoint mirror may use (s3fs / gcsfs provide the remote ones).
MIRROR_SCHEMES = ("s3", "gs", "gcs", "file")


class TrainConfig(_Section):
    """Optimisation, schedule, numerics and NaN handling of the training worker."""

    total_steps: int = Field(ge=1, description="Optimizer steps in the whole run.")
    micro_batch_size: int = Field(ge=1, description="Sequences per forward/backward pass.")
    grad_accum_steps: int = Field(
        1, ge=1, description="Micro-batches accumulated into one optimizer step."
    )
    lr: float = Field(gt=0, description="Peak learning rate (AdamW), reached at the end of warmup.")
    min_lr_ratio: float = Field(
        0.1,
        ge=0,
        le=1,
        description="Final learning rate = lr · min_lr_ratio, reached at total_steps.",
    )
    warmup_steps: int = Field(
        ge=1,
        description=(
            "Steps of linear warmup from near 0 to lr. Must be ≥ 1 (0 is rejected, never "
            "silently reinterpreted). It may reach or exceed total_steps: the run then ends "
            "during warmup, which is what a short smoke run of a long recipe wants."
        ),
    )
    schedule: Literal["cosine", "wsd"] = Field(
        "cosine",
        description=(
            "After warmup: `cosine` decays from lr to lr·min_lr_ratio at total_steps; `wsd` "
            "(warmup-stable-decay) holds lr, then decays to lr·min_lr_ratio over the final "
            "decay_fraction of total_steps."
        ),
    )
    decay_fraction: float = Field(
        0.2, gt=0, le=1, description="wsd only: fraction of total_steps spent in the final decay."
    )
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW β₁.")
    beta2: float = Field(0.95, ge=0, lt=1, description="AdamW β₂.")
    eps: float = Field(1e-8, gt=0, description="AdamW ε.")
    weight_decay: float = Field(
        0.1,
        ge=0,
        description="AdamW decoupled weight decay (applied to matrices, not norms/biases).",
    )
    grad_clip: float = Field(1.0, gt=0, description="Clip the global gradient L2 norm to this.")
    seed: int = Field(
        0,
        ge=0,
        description="Seed of the model init, the data order and every other RNG of the worker.",
    )
    precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto",
        description=(
            "bf16: bf16 autocast, fp32 weights and optimizer state; fp32: no autocast; "
            "auto: bf16 on CUDA, fp32 on CPU."
        ),
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where to train; auto = cuda when a CUDA device is visible, else cpu."
    )
    compile: bool = Field(False, description="Wrap the model in torch.compile.")
    compile_scope: Literal["blocks", "model"] = Field(
        "blocks",
        description=(
            "What torch.compile compiles: blocks = each residual block alone, one compiled "
            "graph that every layer reuses (a cold start compiles one layer, not the stack; "
            "embedding, final norm and loss run eager); model = the whole model as one graph."
        ),
    )
    compile_mode: str | None = Field(
        None,
        description=(
            f"torch.compile mode ({', '.join(COMPILE_MODES)}); null = torch's default. "
            "Ignored when compile is false, so `train.compile=false` alone turns compilation off."
        ),
    )
    deterministic: bool = Field(
        False,
        description=(
            "Deterministic kernels and settings where PyTorch offers them "
            "(torch.use_deterministic_algorithms, cuDNN, a fixed cuBLAS workspace, inductor's "
            "deterministic mode; the Triton scan always is): one seed on one GPU model and "
            "software stack gives bitwise-equal losses, and a run killed and resumed reproduces "
            "the uninterrupted one. Slower; an op with no deterministic kernel is named in a "
            "warning in worker.log."
        ),
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute block activations in backward to save memory."
    )
    nan_max_consecutive: int = Field(
        3,
        ge=1,
        description=(
            "Non-finite (skipped) steps in a row before the worker rolls back in-process to "
            "its last good state."
        ),
    )
    nan_lr_factor: float = Field(
        0.5, gt=0, le=1, description="Learning-rate scale applied on each in-process NaN rollback."
    )
    nan_max_rollbacks: int = Field(
        3,
        ge=1,
        description="In-process NaN rollbacks allowed; one more and the worker exits 76.",
    )

    @field_validator("compile_mode")
    @classmethod
    def _known_compile_mode(cls, mode: str | None) -> str | None:
        if mode in CUDAGRAPH_MODES:
            raise ValueError(
                f"train.compile_mode={mode} captures CUDA graphs, which the training step cannot "
                "replay (gradient accumulation reads a graph's outputs after its next replay has "
                "overwritten them) (fix: set train.compile_mode to default, or to "
                "max-autotune-no-cudagraphs for max-autotune's kernel search)"
            )
        if mode is not None and mode not in COMPILE_MODES:
            hint = did_you_mean(mode, COMPILE_MODES)
            raise ValueError(
                f"train.compile_mode must be one of {', '.join(COMPILE_MODES)} or null, "
                f"got {mode!r}{hint} (fix: set train.compile_mode to one of those)"
            )
        return mode

    def resolve_device(self, cuda_available: bool) -> Literal["cpu", "cuda"]:
        """The concrete device; `cuda` without a visible CUDA device is a ConfigError."""
        if self.device == "auto":
            return "cuda" if cuda_available else "cpu"
        if self.device == "cuda" and not cuda_available:
            raise ConfigError(
                "train.device is cuda but no CUDA device is visible "
                "(fix: expose a GPU to the process, or set train.device=cpu or auto)"
            )
        return self.device

    def resolve_precision(self, device: Literal["cpu", "cuda"]) -> Literal["bf16", "fp32"]:
        """The concrete precision for `device`: auto = bf16 on CUDA, fp32 on CPU."""
        if self.precision == "auto":
            return "bf16" if device == "cuda" else "fp32"
        return self.precision


class DataSourceConfig(_Section):
    """One prepared split in a token-weighted mixture (an item of `data.sources`)."""

    path: str = Field(min_length=1, description="A prepared split (<out>/train of prepare-data).")
    weight: float = Field(gt=0, description="Its share of the tokens, relative to the others'.")
    max_epochs: float | None = Field(
        None, gt=0, description="Passes after which it leaves the mix; null = it repeats."
    )
    name: str | None = Field(
        None, min_length=1, description="Label in tokens_by_source; default: the folder of train/."
    )


class DataConfig(_Section):
    """Where the token streams live and how they are cut into samples."""

    train_path: str | None = Field(
        None, min_length=1, description="One prepared split; or `sources`, not both."
    )
    sources: list[DataSourceConfig] | None = Field(
        None,
        description=(
            "A token-weighted mix of prepared splits, in an order fixed by train.seed; the "
            "positions are checkpointed, and resuming under another mix needs --force."
        ),
    )
    val_path: str | None = Field(
        None, description="Prepared validation token data; required when eval is on."
    )
    seq_len: int = Field(ge=2, description="Tokens per training sequence (context length).")
    prefetch: int = Field(2, ge=0, description="Batches prepared ahead of the training step.")
    reset_at_eos: bool = Field(
        True,
        description=(
            "Zero the scan state at each document start of a packed window (the token after an "
            "EOS), in training and eval, so no document is conditioned on the one before it. "
            "A run frozen before this key existed reads it as false and trains on without "
            "resets, also when relaunched with a recipe that leaves the key unset; turning it on "
            "there is a config change (--force)."
        ),
    )

    @model_validator(mode="after")
    def _one_kind_of_source(self) -> DataConfig:
        paths = [s.path for s in self.sources or []]
        twice = sorted({p for p in paths if paths.count(p) > 1})
        if (self.train_path is None) == (not self.sources) or twice:
            got = f"train_path={self.train_path!r}, sources={paths or self.sources}"
            raise ValueError(
                f"data needs exactly one of train_path and a non-empty sources with distinct "
                f"paths, got {got} (fix: train_path: /data/fineweb/train, or sources: [{{path: "
                "/data/fineweb-edu/train, weight: 0.8}, {path: /data/arxiv/train, weight: 0.2}])"
            )
        return self

    def train_paths(self) -> list[str]:
        """The prepared training splits: train_path, or each source's path in order."""
        return [s.path for s in self.sources] if self.sources else [self.train_path]

    def split_paths(self) -> list[str]:
        """Every prepared split the run reads: the training split or sources, then val."""
        return [p for p in (*self.train_paths(), self.val_path) if p is not None]


class CheckpointConfig(_Section):
    """When checkpoints are written, how many are kept, and where they are mirrored."""

    interval_steps: int = Field(ge=1, description="Save a checkpoint every this many steps.")
    keep_last: int = Field(
        3, ge=1, description="Complete checkpoints kept; older ones are deleted after a save."
    )
    save_on_exit: bool = Field(
        True,
        description=(
            "Save on a graceful stop (SIGTERM, preemption). The final step is always saved; "
            "with false a stop keeps only the last interval checkpoint."
        ),
    )
    async_save: bool = Field(
        True,
        description=(
            "Write checkpoints on a background thread. Training stalls only to queue a copy of "
            "the model and optimizer state into host buffers allocated once (on CUDA the copy "
            "runs on a stream of its own beside the next step, and only that step's optimizer "
            "update waits for it); the files are written, fsync'd and renamed into place while "
            "training goes on. A checkpoint is reported (heartbeat last_checkpoint_step, the "
            "'saved checkpoint' line) only once complete on disk; a failed write stops the "
            "worker with exit 1 at the next step, so the supervisor restarts from the latest "
            "complete checkpoint. The end of the run and a NaN rollback wait for the writes in "
            "flight; a stop cancels them when its own save supersedes them. false: the whole "
            "write stalls training."
        ),
    )
    snapshot_buffers: int = Field(
        2,
        ge=1,
        le=2,
        description=(
            "Host copies of the model and optimizer state kept for async_save, each the size "
            "of a checkpoint (about 12 bytes per parameter with AdamW; page-locked on CUDA for "
            "the life of the worker). 2: a checkpoint step arriving while the previous one is "
            "still being written copies into the other buffer at once, and its write follows; "
            "1: half the host memory, and such a checkpoint step waits for the write in flight "
            "(reported as stall)."
        ),
    )
    mirror_url: str | None = Field(
        None,
        description=(
            "Object-storage copy of the run's checkpoints and history (fsspec URL: "
            "s3://bucket/prefix, gs://bucket/prefix or file:///absolute/path; null = no "
            "mirror). The launch checks that it can list and write there (exit 78 if not). The "
            "supervisor uploads each complete checkpoint in the background (meta.json last) "
            "with metrics, events, TensorBoard files and the config, keeps the newest keep_last "
            "there, and at each launch resumes from the newest complete checkpoint, local or "
            "mirrored, bringing the history back with it. Credentials and endpoints come from "
            "the environment (AWS_*, GOOGLE_APPLICATION_CREDENTIALS, AWS_ENDPOINT_URL)."
        ),
    )
    mirror_flush_s: float = Field(
        60.0,
        ge=0,
        description=(
            "When the run ends (finished, stopped, preempted), seconds the supervisor waits for "
            "the newest checkpoint and the run's history to reach mirror_url before it exits "
            "(failed uploads are retried with the supervisor's backoff meanwhile); 0 = do not "
            "wait. Add it to the container's stop timeout on top of supervisor.stop_grace_s."
        ),
    )

    @field_validator("mirror_url")
    @classmethod
    def _mirror_scheme(cls, url: str | None) -> str | None:
        if url is None:
            return None
        examples = (
            "e.g. s3://my-bucket/runs/pretrain, gs://my-bucket/runs/pretrain or "
            "file:///mnt/shared/runs/pretrain, or null for no mirror"
        )
        scheme, sep, rest = url.partition("://")
        if not sep or scheme not in MIRROR_SCHEMES:
            raise ValueError(
                f"checkpoint.mirror_url must be an s3://, gs:// (gcs://) or file:// URL, got "
                f"{url!r} (fix: {examples})"
            )
        if scheme == "file":
            if not rest.startswith("/") or not rest.strip("/"):
                raise ValueError(
                    f"checkpoint.mirror_url {url!r} must name an absolute directory other than "
                    "/ (fix: write three slashes and the path, e.g. file:///mnt/shared/runs/x)"
                )
        elif not rest.strip("/"):
            raise ValueError(f"checkpoint.mirror_url {url!r} names no bucket (fix: {examples})")
        return url


class EvalConfig(_Section):
    """Periodic validation loss."""

    interval_steps: int = Field(
        0,
        ge=0,
        description=(
            "Evaluate every this many steps and at the last step; 0 turns evaluation off."
        ),
    )
    steps: int = Field(20, ge=1, description="Validation batches per evaluation.")


class LogConfig(_Section):
    """Metrics and heartbeat cadence, and the experiment tracker."""

    interval_steps: int = Field(
        10, ge=1, description="Append a metrics.jsonl record every this many steps."
    )
    heartbeat_interval_s: float = Field(
        2.0,
        gt=0,
        description=(
            "heartbeat.json is rewritten after optimizer steps at most this often (seconds), "
            "and always on a phase change."
        ),
    )

    tracker: Literal["none", "wandb", "tensorboard"] = Field(
        "none",
        description=(
            "Experiment tracker beside metrics.jsonl: wandb (extra m3run[wandb]; project from "
            "WANDB_PROJECT) or tensorboard (extra m3run[tensorboard]; RUN_DIR/tensorboard/). "
            "M3RUN_TRACKER overrides it, and WANDB_PROJECT alone selects wandb."
        ),
    )


class RunConfig(_Section):
    """Everything one run needs; its resolved form is frozen into runs/<name>/config.yaml."""

    model: ModelConfig = Field(
        description=(
            "The Mamba-3-Lite model. In YAML: `{preset: <name>, <field>: <value>, ...}` expands "
            "the preset and then applies the other keys, or give the fields explicitly."
        )
    )
    train: TrainConfig = Field(description="Optimisation, schedule, numerics, NaN handling.")
    data: DataConfig = Field(description="Training and validation data.")
    checkpoint: CheckpointConfig = Field(description="Checkpoint cadence and retention.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Periodic validation.")
    log: LogConfig = Field(default_factory=LogConfig, description="Metrics and heartbeat cadence.")
    supervisor: SupervisorConfig = Field(
        default_factory=SupervisorConfig, description="Restart, hang, stop and preemption policy."
    )
    distributed: DistributedConfig = Field(
        default_factory=DistributedConfig, description="Processes and hosts (torchrun, DDP)."
    )

    # The preset the model section was expanded from (None: explicit fields). Kept so the dump
    # says where the model came from; part of equality and of the hash.
    _model_preset: str | None = PrivateAttr(None)

    @model_validator(mode="wrap")
    @classmethod
    def _expand_model_preset(cls, data: Any, handler):
        if not isinstance(data, Mapping):
            return handler(data)
        preset, model = None, data.get("model")
        if isinstance(model, str):  # `model: tiny` is shorthand for `model: {preset: tiny}`
            model = {"preset": model}
        if isinstance(model, Mapping) and "preset" in model:
            fields = dict(model)
            preset = fields.pop("preset")
            if preset is not None:
                check_preset_name(preset)
                # Same result as ModelConfig.preset(preset, **fields), but validated as a
                # nested dict so errors keep their `model.<field>` location.
                fields = {**PRESETS[preset], **fields}
            data = {**data, "model": fields}
        cfg = handler(data)
        cfg._model_preset = preset
        return cfg

    @model_validator(mode="after")
    def _cross_section(self) -> RunConfig:
        if self.eval.interval_steps > 0 and self.data.val_path is None:
            raise ValueError(
                f"eval.interval_steps is {self.eval.interval_steps} but data.val_path is not set "
                "(fix: set data.val_path, or set eval.interval_steps=0 to turn evaluation off)"
            )
        timeout = self.supervisor.heartbeat_timeout_s
        if timeout is not None and timeout <= self.log.heartbeat_interval_s:
            raise ValueError(
                f"supervisor.heartbeat_timeout_s ({timeout}) must exceed "
                f"log.heartbeat_interval_s ({self.log.heartbeat_interval_s}), or a healthy "
                "worker is killed as hung (fix: raise heartbeat_timeout_s, or null to calibrate)"
            )
        return self

    @field_serializer("model")
    def _dump_model(self, model: ModelConfig, info) -> dict[str, Any]:
        fields = model.model_dump(mode=info.mode)
        if self._model_preset is None:
            return fields
        return {"preset": self._model_preset, **fields}

    @property
    def model_preset(self) -> str | None:
        """The model preset name the config was built from, or None for explicit fields."""
        return self._model_preset

    @property
    def global_batch_tokens(self) -> int:
        """Tokens per optimizer step: micro_batch_size · grad_accum_steps · seq_len."""
        t = self.train
        return t.micro_batch_size * t.grad_accum_steps * self.data.seq_len

    def to_yaml(self) -> str:
        """The resolved config as YAML: every field, sections in schema order, preset kept."""
        return yaml.safe_dump(
            self.model_dump(mode="json"), sort_keys=False, allow_unicode=True, width=100
        )

    def flat(self) -> dict[str, Any]:
        """Every field as "section.key": value, nested mappings dotted further (what a config
        diff lists, and a tracker records as the run's hyperparameters)."""

        def walk(value: Any, prefix: str) -> dict[str, Any]:
            if not isinstance(value, dict):
                return {prefix: value}
            out: dict[str, Any] = {}
            for k, v in value.items():
                out.update(walk(v, f"{prefix}.{k}" if prefix else str(k)))
            return out

        return walk(self.model_dump(mode="json"), "")

    def warnings(self) -> list[str]:
        """Legal but probably unintended settings, one sentence each, for the CLI to show."""
        t, out = self.train, []
        if t.warmup_steps >= t.total_steps:
            out.append(
                f"train.warmup_steps ({t.warmup_steps}) ≥ train.total_steps ({t.total_steps}): "
                "the run ends during warmup and never reaches the peak learning rate"
            )
        elif t.schedule == "wsd":
            decay = math.ceil(t.decay_fraction * t.total_steps)
            if t.warmup_steps > t.total_steps - decay:
                out.append(
                    f"train.warmup_steps ({t.warmup_steps}) runs into the wsd decay, which "
                    f"starts at step {t.total_steps - decay}: there is no stable phase"
                )
        if t.compile_mode is not None and not t.compile:
            out.append(f"train.compile_mode={t.compile_mode} is ignored: train.compile is false")
        if t.precision == "bf16" and t.device == "cpu":
            out.append("train.precision=bf16 on train.device=cpu: CPU bf16 autocast is slow")
        if self.data.val_path is not None and self.eval.interval_steps == 0:
            out.append("data.val_path is set but eval.interval_steps is 0: no evaluation will run")
        if self.eval.interval_steps > t.total_steps:
            out.append(
                f"eval.interval_steps ({self.eval.interval_steps}) > train.total_steps "
                f"({t.total_steps}): evaluation never runs"
            )
        if self.checkpoint.interval_steps > t.total_steps and not self.checkpoint.save_on_exit:
            out.append(
                "checkpoint.interval_steps > train.total_steps and save_on_exit is false: "
                "only the final step is ever saved, so a stop or crash loses the whole run"
            )
        return out
