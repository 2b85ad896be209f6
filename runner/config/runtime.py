"""The run configuration's sections for how a run is kept alive and spread: the supervisor
(watching, restarts, stops, preemption) and the distributed launch. Torch-free."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from m3run.runner.config.base import _Section


class SupervisorConfig(_Section):
    """How the supervisor watches, restarts and stops the worker."""

    max_restarts: int = Field(
        10, ge=0, description="Worker restarts allowed within restart_window_s before giving up."
    )
    restart_window_s: float = Field(
        3600.0, gt=0, description="Sliding window (seconds) over which max_restarts is counted."
    )
    no_progress_restarts: int = Field(
        3,
        ge=1,
        description="Consecutive restarts without a new checkpoint before giving up (exit 70).",
    )
    backoff_initial_s: float = Field(
        2.0,
        gt=0,
        description="Delay before the second restart in a row without a new complete "
        "checkpoint, from the worker's exit (the supervisor's check of the checkpoints it left "
        "counts toward it); doubles on each further one. The first restart, of the launch or "
        "since a new checkpoint, is immediate.",
    )
    backoff_max_s: float = Field(300.0, gt=0, description="Upper bound of the restart delay.")
    startup_timeout_s: float = Field(
        900.0,
        gt=0,
        description="Seconds a new worker may take to its first heartbeat (covers compilation).",
    )
    heartbeat_timeout_s: float | None = Field(
        None,
        gt=0,
        description=(
            "A heartbeat older than this (seconds) means a hung worker; null = calibrated as "
            "heartbeat_safety_factor × the observed step time."
        ),
    )
    heartbeat_safety_factor: float = Field(
        5.0, ge=1, description="Multiplier of the observed step time for the calibrated timeout."
    )
    stop_grace_s: float = Field(
        120.0,
        gt=0,
        description=(
            "Seconds between SIGTERM to the worker (save and exit) and SIGKILL. Set Docker "
            "--stop-timeout / Kubernetes terminationGracePeriodSeconds above it."
        ),
    )
    nan_lr_factor: float = Field(
        0.5,
        gt=0,
        le=1,
        description=(
            "After a worker exit 76 (NaN) the supervisor restarts it at this times the learning "
            "rate the failing worker ran at (compounding over repeated exits)."
        ),
    )
    preemption_provider: Literal["auto", "none", "aws", "gcp", "azure"] = Field(
        "auto",
        description="Cloud whose preemption notices are polled; auto detects it, none disables.",
    )
    preemption_poll_s: float = Field(
        5.0, gt=0, description="Seconds between preemption-notice polls."
    )
    metadata_url: str | None = Field(
        None,
        description="Override of the provider's metadata endpoint base URL (tests, proxies).",
    )
    smoke: bool = Field(
        True, description="Run the preflight smoke test (a few real steps) before the first launch."
    )
    tune_scan: bool = Field(
        True,
        description="On a GPU with no tuned launch plan for the scan kernels (neither this "
        "machine's, from `m3run tune-scan`, nor the checked-in table's: an A100, say), the smoke "
        "test tunes one first (a minute or two, once per machine and m3run version) and stores "
        "it where every worker reads it; false runs the slower defaults until you tune.",
    )
    warm_spare: bool | Literal["auto"] = Field(
        "auto",
        description="Keep the next worker started and imported while one trains (and a "
        "launch's first worker while the smoke test runs), so a restart skips process start "
        "and imports (runner/supervisor/spare.py); auto = on a GPU host.",
    )
    vram_warn_fraction: float = Field(
        0.95, gt=0, le=1, description="Warn when used GPU memory exceeds this fraction of total."
    )

    @field_validator("metadata_url")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        if url is not None and not re.match(r"https?://[^/\s]+", url):
            raise ValueError(
                f"supervisor.metadata_url must be an http(s) URL, got {url!r} "
                "(fix: write it like http://169.254.169.254, or null for the provider default)"
            )
        return url

    @model_validator(mode="after")
    def _backoff_order(self) -> SupervisorConfig:
        if self.backoff_initial_s > self.backoff_max_s:
            raise ValueError(
                f"supervisor.backoff_initial_s ({self.backoff_initial_s}) must be ≤ "
                f"supervisor.backoff_max_s ({self.backoff_max_s}) "
                "(fix: lower backoff_initial_s or raise backoff_max_s)"
            )
        return self


class DistributedConfig(_Section):
    """More than one worker process: the supervisor launches the worker through torchrun."""

    nproc_per_node: int = Field(
        1, ge=1, description="Worker processes on this host (one per GPU); 1 = no torchrun."
    )
    nnodes: int = Field(1, ge=1, description="Hosts in the job (each runs its own supervisor).")
    node_rank: int = Field(0, ge=0, description="This host's rank, 0 … nnodes-1.")
    rdzv_endpoint: str | None = Field(
        None,
        description="host:port of the c10d rendezvous (node 0); required when nnodes > 1.",
    )
    rdzv_id: str | None = Field(
        None, description="Job id shared by all hosts of a job (default: the run dir's name)."
    )
    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="torch.distributed backend: auto = nccl on CUDA, gloo on CPU."
    )
    timeout_s: float = Field(
        600.0, gt=0, description="Collective timeout; a rank that stalls longer is an error."
    )

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @model_validator(mode="after")
    def _check_multinode(self) -> DistributedConfig:
        if self.node_rank >= self.nnodes:
            raise ValueError(
                f"distributed.node_rank must be < distributed.nnodes = {self.nnodes}, got "
                f"{self.node_rank} (fix: number hosts 0 … nnodes-1)"
            )
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError(
                f"distributed.rdzv_endpoint is required when distributed.nnodes = {self.nnodes} "
                "(fix: set it to node 0's host:port, e.g. 10.0.0.1:29500)"
            )
        if self.rdzv_endpoint is not None and not re.fullmatch(r"[^\s:]+:\d+", self.rdzv_endpoint):
            raise ValueError(
                f"distributed.rdzv_endpoint must be host:port, got {self.rdzv_endpoint!r}"
            )
        return self
