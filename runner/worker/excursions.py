"""Non-finite steps, one rank's policy. A step whose mean loss or gradient norm is not finite is
skipped as it comes (update.GuardedUpdate leaves the weights and moments as they were) and the
next step trains on the next data; train.nan_max_consecutive such steps in a row roll the run
back, in this process, to the latest complete checkpoint, with the learning rate scaled by
train.nan_lr_factor and the data windows the streak read never trained on again; past
train.nan_max_rollbacks rollbacks the worker gives up (NaNExcursion: it exits with
protocol.EXIT_NAN, and the supervisor decides)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from m3run.runner.checkpoint import layout as ckpt
from m3run.runner.config import TrainConfig

from .dist import Dist

if TYPE_CHECKING:
    from m3run.runner.data.loader import WindowStream

    from .checkpointing import Checkpointer
    from .telemetry import Telemetry


class NaNExcursion(RuntimeError):
    """Non-finite steps the in-process rollback could not heal (the worker's EXIT_NAN)."""


class Excursions:
    """What the rollbacks decided (how many there were, the data positions never to train on
    again, the learning-rate scale), which every checkpoint keeps through the trainer's
    ``state_dict``, and the streak of non-finite steps in a row, which none does."""

    def __init__(self, cfg: TrainConfig, dist: Dist):
        self.cfg = cfg
        self.dist = dist
        self.rollbacks = 0
        self.skip_positions: list[int] = []  # data positions of windows that produced NaN
        self.lr_scale = 1.0
        self.streak: list[int] = []  # the first data position of each step of the streak

    def skip_windows(self, loader: WindowStream, windows: int) -> None:
        """Past every window a rollback marked at the loader's position, ``windows`` (a step's
        micro-batches) at a time."""
        while loader.windows_consumed in self.skip_positions:
            pos = loader.windows_consumed
            loader.skip(windows)
            if self.dist.writer:
                print(f"skipping the data window at position {pos} (it gave NaN earlier)")

    def bad_step(self, step: int, out: dict, telemetry: Telemetry) -> bool:
        """Step ``step`` was skipped as non-finite (``out``: train_step's result): reported,
        and added to the streak. Whether the streak now calls for a rollback."""
        self.streak.append(out["start_pos"])
        if self.dist.writer:
            print(
                f"step {step}: non-finite loss {out['loss']} / grad norm {out['grad_norm']}: "
                f"step skipped ({len(self.streak)} in a row)",
                flush=True,
            )
            telemetry.record({"kind": "nonfinite", "step": step, "time": time.time()})
        return len(self.streak) >= self.cfg.nan_max_consecutive

    def good_step(self) -> None:
        """A finite step: the streak, if any, is over."""
        self.streak = []

    def rollback(
        self, step: int, run_dir: Path, checkpointer: Checkpointer, telemetry: Telemetry
    ) -> None:
        """In-process recovery from the streak that failed at step ``step``: back to the latest
        complete checkpoint (on every rank the same one), never again on the streak's data,
        with the learning rate scaled down. The checkpoint restores the trainer's counters,
        these among them; what the rollback decided outlives it."""
        self.rollbacks += 1
        if self.rollbacks > self.cfg.nan_max_rollbacks:
            raise NaNExcursion(
                f"{self.rollbacks - 1} in-process rollbacks did not heal the non-finite "
                f"loss/gradients at step {step}"
            )
        checkpointer.finish_saves()  # a checkpoint still being written is the one to use
        info = ckpt.latest_complete(run_dir, trust_verified=True)
        if self.dist.enabled:
            agreed = self.dist.all_min(info.step if info is not None else -1)
            info = ckpt.find_step(run_dir, agreed, trust_verified=True) if agreed >= 0 else None
        if info is None:
            raise NaNExcursion(
                f"non-finite loss/gradients at step {step} and no complete checkpoint to roll "
                "back to"
            )
        skip = sorted(set(self.skip_positions) | set(self.streak))
        rollbacks = self.rollbacks
        scale = self.lr_scale * self.cfg.nan_lr_factor
        checkpointer.load(info.path)
        self.skip_positions, self.rollbacks, self.lr_scale = skip, rollbacks, scale
        self.streak = []
        if not self.dist.writer:
            return
        telemetry.record(
            {
                "kind": "rollback",
                "step": info.step,
                "lr_scale": scale,
                "time": time.time(),
                "skipped_positions": skip,
            },
        )
        print(
            f"NaN rollback #{rollbacks}: restored step {info.step}, lr scale {scale:g}, "
            f"skipping {len(skip)} data window(s)",
            flush=True,
        )
