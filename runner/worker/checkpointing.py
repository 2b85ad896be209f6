"""Saving the trainer's state and restoring it: synchronous and background checkpoint writes,
their reporting (a step is announced only once it is complete on disk), the write-hang rule,
and loading a verified checkpoint back into the model, the optimizer, the data loader and the
trainer's counters. The file format is runner.checkpoint's."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from m3run.runner import __version__
from m3run.runner.checkpoint import io as ckpt_io
from m3run.runner.checkpoint import layout as ckpt
from m3run.runner.config import ConfigError, RunConfig, config_hash
from m3run.runner.data.loader import BatchLoader
from m3run.runner.data.manifest import DataError
from m3run.runner.protocol import WorkerPhase

from .dist import Dist
from .faults import Faults
from .telemetry import SaveStatus, Telemetry

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful

# A background checkpoint write running longer than max(this, 10 × the longest one so far) is
# treated as stuck: waiting for it no longer refreshes the heartbeat (see _wait_for_save).
_WRITE_HANG_S = 600.0


class Checkpointer:
    """Checkpoints of one run dir. `counters` (the trainer) round-trips the step, tokens seen
    and the NaN-rollback state through state_dict()/load_state_dict(); the step in
    `resumed_from` is never deleted by retention. Writer ranks write; the other ranks take part
    in the barriers and learn that a background write completed from the next save or
    finish_saves()."""

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path,
        dist: Dist,
        faults: Faults,
        telemetry: Telemetry,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loader: BatchLoader,
        counters: Stateful,
        force: bool,
    ):
        self.cfg = cfg
        self.run_dir = run_dir
        self.dist = dist
        self.faults = faults
        self.telemetry = telemetry
        self.model = model
        self.optimizer = optimizer
        self.loader = loader
        self.counters = counters
        self.force = force  # --force: a checkpoint of another config loads without a warning
        self.resumed_from: int | None = None
        self.last_checkpoint_step: int | None = None  # complete on disk: never one being written
        self.checkpoint_time_s: float | None = None  # training stall of the latest save
        self.checkpoint_write_s: float | None = None  # write time of the latest complete save
        # checkpoint.async_save: the background writer (writer ranks), its reused host buffers,
        # and on non-writer ranks the step whose write is not yet known to be complete.
        self._writer = ckpt_io.BackgroundWriter()
        self._snapshot_buffers = ckpt_io.SnapshotBuffers()
        self._unconfirmed_step: int | None = None
        self._longest_write_s = 0.0
        faults.before_crash = self._writer.join

    def status(self) -> SaveStatus:
        """What the heartbeat says about checkpoints."""
        return SaveStatus(
            last_checkpoint_step=self.last_checkpoint_step,
            checkpoint_time_s=self.checkpoint_time_s,
            checkpoint_write_s=self.checkpoint_write_s,
            in_flight_step=self._writer.pending_step,
        )

    # ---- saving ----

    def save(self) -> Path | None:
        """Checkpoint the current step.

        checkpoint.async_save=false: write it here (training stalls for the whole write) and
        return its directory. async_save=true (the default): wait for the previous background
        write if it is still running (that wait is stall too), copy model and optimizer state
        into the reused host buffers, hand the write to the background thread and return None.
        Either way the step is reported (heartbeat `last_checkpoint_step`, the "saved checkpoint"
        line) only once the checkpoint is complete on disk: `poll_save()` reports a finished
        background write before the next step, `finish_saves()` waits for it."""
        telemetry = self.telemetry
        prev_phase = telemetry.phase
        telemetry.set_phase(WorkerPhase.CHECKPOINTING)
        t0 = time.perf_counter()
        background = self.cfg.checkpoint.async_save
        if background:
            self._wait_for_save()  # at most one write in flight: its buffers are reused below
        step, path, result = self.counters.state_dict()["step"], None, None
        if self.dist.writer:
            state, meta = self._checkpoint_state()
            model_state = self.model.state_dict()
            if background:
                cpu_model, cpu_optim = ckpt_io.snapshot(
                    model_state, state, buffers=self._snapshot_buffers
                )
                self._writer.submit(step, self._write_job(step, cpu_model, cpu_optim, meta))
            else:
                cpu_model, cpu_optim = ckpt_io.snapshot(model_state, state)
                result = ckpt_io.timed_write(
                    step, self._write_job(step, cpu_model, cpu_optim, meta)
                )
                path = result.path
        # Synchronous: no rank runs ahead of a checkpoint that is not on disk yet. Background:
        # the other ranks only need this snapshot taken (and, by the wait above, the previous
        # write complete); the write itself is not waited for here.
        self.dist.barrier()
        self.checkpoint_time_s = time.perf_counter() - t0
        if not self.dist.writer:
            if background:  # the writers finished the previous write before that barrier
                if self._unconfirmed_step is not None:
                    self.last_checkpoint_step = self._unconfirmed_step
                self._unconfirmed_step = step
            else:
                self.last_checkpoint_step = step
        telemetry.set_phase(prev_phase)
        if result is not None:
            self._report_saved(result)
        return path

    def _checkpoint_state(self) -> tuple[dict, dict]:
        """(optim.pt state, meta.json fields) of the current step. The tensors in the state are
        the live ones: `ckpt_io.snapshot` copies them before training goes on."""
        device = self.dist.device
        rng = {"torch": torch.get_rng_state()}
        if device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(device)
        counters = self.counters.state_dict()
        state = {
            "optimizer": self.optimizer.state_dict(),
            **counters,
            "data": self.loader.state_dict(),
            "rng": rng,
        }
        meta = {
            "tokens_seen": counters["tokens_seen"],
            "data_state": state["data"],
            "config_hash": config_hash(self.cfg),
            # The LR-schedule multiplier this checkpoint trains at (NaN cuts); the supervisor
            # reads it to cut relative to the run's real LR, never compounding a cut twice.
            "lr_scale": counters["lr_scale"],
            "versions": {
                "m3run": __version__,
                "torch": torch.__version__,
                "python": sys.version.split()[0],
            },
            "loss": self.telemetry.last.get("loss"),
        }
        return state, meta

    def _write_job(self, step: int, cpu_model: dict, cpu_optim: dict, meta: dict):
        """The disk half of a save, on the writer thread or inline: the atomic triple, then
        retention. Reads only the snapshot and values captured here, never the live trainer."""
        run_dir, keep = self.run_dir, self.cfg.checkpoint.keep_last
        protect = {self.resumed_from} if self.resumed_from is not None else set()
        faults = self.faults

        def job() -> Path:
            path = ckpt_io.write_checkpoint(
                run_dir,
                step,
                cpu_model,
                cpu_optim,
                meta,
                before_meta=lambda: faults.during_save(step),
            )
            try:
                ckpt.apply_retention(run_dir, keep, protect=protect)
            except OSError as e:
                raise ckpt.CheckpointError(
                    f"checkpoint step {step} is complete at {path}, but deleting older "
                    f"checkpoints (checkpoint.keep_last={keep}) failed: {e}. Check write "
                    f"permission and free space under {path.parent}"
                ) from e
            return path

        return job

    def _report_saved(self, result: ckpt_io.SaveResult) -> None:
        """The checkpoint of `result.step` is complete on disk: now, and only now, say so."""
        self.last_checkpoint_step = result.step
        self.checkpoint_write_s = result.write_s
        self._longest_write_s = max(self._longest_write_s, result.write_s)
        if self.dist.writer:
            size = f"{result.bytes / 2**20:.1f} MiB"
            if self.cfg.checkpoint.async_save:
                print(
                    f"saved checkpoint step {result.step} ({size}): training stalled "
                    f"{self.checkpoint_time_s or 0.0:.2f}s, written in the background in "
                    f"{result.write_s:.2f}s",
                    flush=True,
                )
            else:
                print(
                    f"saved checkpoint step {result.step} in {self.checkpoint_time_s or 0.0:.2f}s "
                    f"({size})",
                    flush=True,
                )
        self.telemetry.heartbeat(force=True)

    def poll_save(self) -> None:
        """Report a background write that finished since the last call; re-raise its failure
        (CheckpointError) here, in the training loop, before the next step."""
        if self._writer.finished():
            self._report_saved(self._writer.result())

    def _wait_for_save(self) -> None:
        """Block until the background write in flight (if any) is complete on disk and report
        it; CheckpointError if it failed. A slow disk is not a hung worker, so the heartbeat goes
        on while waiting, but only up to max(10 min, 10 × the longest write so far): a write
        stuck longer than that stops the heartbeat and the supervisor's hang detection acts."""
        w, telemetry = self._writer, self.telemetry
        if w.pending_step is None:
            return
        prev_phase = telemetry.phase
        if w.running():
            print(
                f"waiting for checkpoint step {w.pending_step} to finish writing "
                f"({w.elapsed_s:.1f}s so far)",
                flush=True,
            )
            if prev_phase == WorkerPhase.TRAINING:
                telemetry.set_phase(WorkerPhase.CHECKPOINTING)
        poll_s = max(0.05, self.cfg.log.heartbeat_interval_s)
        bound_s = max(_WRITE_HANG_S, 10 * self._longest_write_s)
        while not w.join(timeout=poll_s):
            if w.elapsed_s < bound_s:
                telemetry.heartbeat(force=True)
        if telemetry.phase != prev_phase:
            telemetry.set_phase(prev_phase)
        self._report_saved(w.result())

    def finish_saves(self) -> None:
        """Wait until no checkpoint write is in flight: the stop path, the end of training and a
        NaN rollback call this. Under DDP every rank then waits at a barrier for the writer
        ranks, so no rank exits (torchrun would tear the job down, write included) or reads
        checkpoints before the writes are complete."""
        self._wait_for_save()
        if self.dist.enabled:
            self.dist.barrier()
        if self._unconfirmed_step is not None:  # non-writer ranks: the writers are done
            self.last_checkpoint_step, self._unconfirmed_step = self._unconfirmed_step, None

    def close(self) -> None:
        """Exiting on an error with a write in flight: finish it, the state it holds is good."""
        if self._writer.pending_step is None:
            return
        try:
            self._writer.join()
            self._report_saved(self._writer.result())
        except ckpt.CheckpointError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)

    # ---- restoring ----

    def load(self, path: Path) -> None:
        """Restore everything from a checkpoint whose hashes were just verified. ConfigError
        when its tensors do not fit this config's model (exit 78); UnloadableCheckpoint when
        its contents cannot be read back (another structure, a refused unpickle)."""
        try:
            model_state, state, meta = ckpt_io.load_checkpoint(path, hashes_checked=True)
        except ckpt.CheckpointError as e:
            raise UnloadableCheckpoint(str(e)) from e
        _check_fits(path, model_state, self.model.state_dict())
        if meta.get("config_hash") not in (None, config_hash(self.cfg)) and not self.force:
            print(
                f"warning: checkpoint {path.name} was written under a different config "
                "(model or schedule changes apply from here on)"
            )
        try:
            self.model.load_state_dict(model_state)
            self.optimizer.load_state_dict(state["optimizer"])
            self.counters.load_state_dict(state)
            self.loader.load_state_dict(state["data"])
            torch.set_rng_state(state["rng"]["torch"])
            device = self.dist.device
            if device.type == "cuda" and state["rng"].get("cuda") is not None:
                torch.cuda.set_rng_state(state["rng"]["cuda"], device)
            self.last_checkpoint_step = int(state["step"])
        except (ConfigError, DataError):
            raise
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise UnloadableCheckpoint(
                f"{path / ckpt.OPTIM_FILE} does not hold what this m3run writes "
                f"({type(e).__name__}: {e})"
            ) from e


class UnloadableCheckpoint(Exception):
    """A checkpoint whose digests match but whose contents cannot be loaded back."""


def _check_fits(path: Path, saved: dict, model: dict) -> None:
    """ConfigError naming every tensor of `saved` that does not fit the model."""
    problems = [f"{k}: missing from the checkpoint" for k in sorted(set(model) - set(saved))]
    problems += [f"{k}: not in the model" for k in sorted(set(saved) - set(model))]
    problems += [
        f"{k}: {tuple(saved[k].shape)} in the checkpoint, {tuple(model[k].shape)} in the model"
        for k in sorted(set(model) & set(saved))
        if tuple(saved[k].shape) != tuple(model[k].shape)
    ]
    if problems:
        shown = "; ".join(problems[:6]) + (
            f"; … {len(problems) - 6} more" if len(problems) > 6 else ""
        )
        raise ConfigError(
            f"checkpoint {path} does not fit the model this config builds ({shown}). Fix: "
            "resume with the config it was written with, or start over with "
            "--resume none --force"
        )
