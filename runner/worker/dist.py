"""This process's place in a torchrun job: ranks, the process group, the collectives the
trainer uses, and how the global batch splits over the ranks."""

from __future__ import annotations

import datetime
import os

import torch

from m3run.runner.config import ConfigError, RunConfig


class Dist:
    """This process's place in a torchrun job (world size 1 without torchrun).

    Every host's local rank 0 writes that host's run dir (checkpoints, metrics, heartbeat.json),
    so no shared filesystem is needed: DDP keeps every replica identical.
    """

    def __init__(self) -> None:
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.enabled = self.world_size > 1
        self.device = torch.device("cpu")  # this rank's device, set by init()

    @property
    def writer(self) -> bool:
        return self.local_rank == 0

    def init(self, cfg: RunConfig, device: torch.device) -> None:
        self.device = device
        if not self.enabled:
            return
        import torch.distributed as td

        backend = cfg.distributed.backend
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "nccl" and device.type != "cuda":
            raise ConfigError(
                "distributed.backend=nccl needs CUDA; set it to gloo (or auto) on CPU"
            )
        td.init_process_group(
            backend, timeout=datetime.timedelta(seconds=cfg.distributed.timeout_s)
        )

    def local_accumulation(self, cfg: RunConfig) -> int:
        """Micro-batches per rank per optimizer step. The global batch (micro_batch_size ×
        grad_accum_steps sequences) is the same for every world size; accumulation adjusts."""
        accum, world = cfg.train.grad_accum_steps, self.world_size
        if accum % world:
            raise ConfigError(
                f"train.grad_accum_steps={accum} cannot be split evenly over {world} processes "
                "(the global batch is micro_batch_size × grad_accum_steps sequences for every "
                f"world size). Fix: make grad_accum_steps a multiple of {world}, e.g. "
                f"{-(-accum // world) * world}, adjusting micro_batch_size to keep the batch."
            )
        if world > 1 and self.rank == 0:
            print(
                f"global batch {cfg.train.micro_batch_size * accum} sequences = "
                f"{cfg.train.micro_batch_size} × {accum // world} accumulation × {world} "
                "processes",
                flush=True,
            )
        return accum // world

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            import torch.distributed as td

            td.all_reduce(t, op=td.ReduceOp.SUM)
        return t

    def all_min(self, value: int) -> int:
        if not self.enabled:
            return value
        import torch.distributed as td

        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        td.all_reduce(t, op=td.ReduceOp.MIN)
        return int(t.item())

    def barrier(self) -> None:
        if self.enabled:
            import torch.distributed as td

            td.barrier()

    def close(self) -> None:
        if self.enabled:
            import torch.distributed as td

            if td.is_initialized():
                td.destroy_process_group()
