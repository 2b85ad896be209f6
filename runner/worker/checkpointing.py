"""Saving the trainer's state: synchronous and background checkpoint writes, their reporting (a
step is announced only once it is complete on disk), the write-hang rule and the stop's save.
The file format is runner.checkpoint's; restoring a checkpoint is resume.py's."""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import torch

from m3run.runner import __version__
from m3run.runner.checkpoint import background as ckpt_bg
from m3run.runner.checkpoint import layout as ckpt
from m3run.runner.checkpoint.snapshot import (
    Snapshot,
    SnapshotBuffers,
    leaves_of,
    nbytes,
    snapshot,
)
from m3run.runner.checkpoint.write import WriteCancelled, write_checkpoint
from m3run.runner.config import RunConfig, config_hash
from m3run.runner.data.loader import BatchLoader
from m3run.runner.protocol import WorkerPhase

from .dist import Dist
from .faults import Faults
from .restore import restore
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
    in the barriers and learn that a background write completed from a later save or
    finish_saves().

    Background saves (checkpoint.async_save) copy the state into one of
    checkpoint.snapshot_buffers host buffers and queue its write behind the writes pending; a
    buffer is free again once the write reading it has ended. On CUDA the copy is queued on a
    stream of its own, and the trainer calls before_update() ahead of each optimizer update, so
    the update that would overwrite the state waits for the copy on the GPU, while the steps
    before it run beside the copy."""

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
        self.last_saved_step: int | None = None  # the newest step save() was called for
        # Background saves: the writer, the host buffers and which pending write reads which
        # (oldest first, as the writer holds them), each save's stall by step, and on non-writer
        # ranks the steps whose writes are not yet known to be complete.
        self._writer = ckpt_bg.BackgroundWriter()
        self._buffers = [SnapshotBuffers() for _ in range(cfg.checkpoint.snapshot_buffers)]
        self._reading: deque[tuple[int, int]] = deque()  # (step, buffer index)
        self._prepared: list[Future[None] | None] | None = None  # per buffer, from prepare()
        self._stall_s: dict[int, float] = {}
        self._unconfirmed: deque[int] = deque()
        self._longest_write_s = 0.0
        self._told_slow_disk = False
        self._told_unpinned = False
        device = dist.device
        self._copy_stream = (
            torch.cuda.Stream(device)
            if device.type == "cuda" and cfg.checkpoint.async_save
            else None
        )
        self._copied = None  # the CUDA event of the latest snapshot's copies
        faults.before_crash = self._writer.join_all

    def status(self) -> SaveStatus:
        """What the heartbeat says about checkpoints."""
        return SaveStatus(
            last_checkpoint_step=self.last_checkpoint_step,
            checkpoint_time_s=self.checkpoint_time_s,
            checkpoint_write_s=self.checkpoint_write_s,
            in_flight_step=self._writer.pending_step,
        )

    # ---- saving ----

    def prepare(self) -> None:
        """Allocate (and on CUDA page-lock) the background saves' host buffers on a thread,
        once the optimizer's state exists (after the first step), so the first checkpoint does
        not wait for gigabytes of host memory."""
        if not (self.cfg.checkpoint.async_save and self.dist.writer) or self._prepared is not None:
            return
        state, _ = self._checkpoint_state()
        leaves = leaves_of(self.model.state_dict(), state)
        self._say_host_memory(nbytes(leaves))
        self._prepared = [Future() for _ in self._buffers]

        def run() -> None:
            # In order: the first save needs only the first buffer.
            for buffers, done in zip(self._buffers, self._prepared, strict=True):
                try:
                    buffers.prepare(leaves)
                    done.set_result(None)
                except BaseException as e:  # told by the save that uses it, which allocates
                    done.set_exception(e)

        threading.Thread(target=run, name="m3run-checkpoint-buffers", daemon=True).start()

    def _say_host_memory(self, state_bytes: int) -> None:
        """What the buffers cost, and a warning when the host has not that much memory free."""
        n = len(self._buffers)
        locked = " page-locked" if self.dist.device.type == "cuda" else ""
        need = n * state_bytes
        print(
            f"checkpoint buffers: {n} × {state_bytes / 2**20:,.0f} MiB of{locked} host memory "
            f"for background saves (checkpoint.snapshot_buffers={n})",
            flush=True,
        )
        free = psutil.virtual_memory().available
        if need > free:
            fix = "set checkpoint.snapshot_buffers=1 or " if n > 1 else ""
            print(
                f"warning: the checkpoint buffers need {need / 2**30:.1f} GiB of host memory and "
                f"{free / 2**30:.1f} GiB is available: the worker may be killed for memory at "
                f"its first checkpoint. Fix: {fix}give the worker more host memory",
                flush=True,
            )

    def load(self, path: Path) -> None:
        """Restore everything this checkpoints from the verified checkpoint at `path`
        (restore.restore: ConfigError or UnloadableCheckpoint when it cannot)."""
        self.last_checkpoint_step = restore(
            path,
            cfg=self.cfg,
            model=self.model,
            optimizer=self.optimizer,
            counters=self.counters,
            loader=self.loader,
            device=self.dist.device,
            force=self.force,
        )

    def before_update(self) -> None:
        """Make the optimizer update about to be queued wait (on the GPU) for the copies of the
        latest snapshot: the state it overwrites is the state that snapshot holds."""
        if self._copied is not None:
            torch.cuda.current_stream(self.dist.device).wait_event(self._copied)
            self._copied = None

    def save(self) -> Path | None:
        """Checkpoint the current step.

        checkpoint.async_save=false: write it here (training stalls for the whole write) and
        return its directory. async_save=true (the default): copy model and optimizer state into
        a free host buffer (waiting for the oldest write in flight when every buffer is still
        being read: that wait is stall too), queue its write and return None. Either way the
        step is reported (heartbeat `last_checkpoint_step`, the "saved checkpoint" line) only
        once the checkpoint is complete on disk: `poll_save()` reports a finished background
        write before the next step, `finish_saves()` waits for them."""
        telemetry = self.telemetry
        prev_phase = telemetry.phase
        telemetry.set_phase(WorkerPhase.CHECKPOINTING)
        t0 = time.perf_counter()
        background = self.cfg.checkpoint.async_save
        step, path, result = self.counters.state_dict()["step"], None, None
        if self.dist.writer:
            state, meta = self._checkpoint_state()
            model_state = self.model.state_dict()
            if background:
                self._save_in_background(step, model_state, state, meta)
            else:
                cpu_model, cpu_optim = snapshot(model_state, state)
                snap = Snapshot(cpu_model, cpu_optim)
                result = ckpt_bg.timed_write(
                    step, lambda: self._write_job(step, snap, meta)(threading.Event())
                )
                path = result.path
        # Synchronous: no rank runs ahead of a checkpoint that is not on disk yet. Background:
        # the other ranks only need this snapshot taken; the write is not waited for here.
        self.dist.barrier()
        self.checkpoint_time_s = time.perf_counter() - t0
        if self.dist.writer:
            self._stall_s[step] = self.checkpoint_time_s
        self.last_saved_step = step
        if not self.dist.writer:
            if background:
                # The writers hold at most one write in flight per buffer besides this one:
                # every older one is complete.
                self._unconfirmed.append(step)
                while len(self._unconfirmed) > len(self._buffers):
                    self.last_checkpoint_step = self._unconfirmed.popleft()
            else:
                self.last_checkpoint_step = step
        telemetry.set_phase(prev_phase)
        if result is not None:
            self._report_saved(result)
        return path

    def _save_in_background(self, step: int, model_state: dict, state: dict, meta: dict) -> None:
        while len(self._reading) >= len(self._buffers):  # every buffer is being read
            self._say_disk_is_behind(step)
            self._wait_for_save()
        busy = {index for _, index in self._reading}
        index = min(i for i in range(len(self._buffers)) if i not in busy)
        buffers = self._buffers[index]
        if self._prepared is not None and self._prepared[index] is not None:
            try:
                self._prepared[index].result()  # its allocation, if still under way
            except Exception as e:
                print(
                    f"warning: allocating checkpoint buffer {index + 1} ahead failed ({e}); "
                    "this save allocates it",
                    flush=True,
                )
            self._prepared[index] = None
        snap = buffers.fill(model_state, state, stream=self._copy_stream)
        if buffers.pin_error and not self._told_unpinned:
            self._told_unpinned = True
            print(
                f"warning: the checkpoint buffers could not be page-locked "
                f"({buffers.pin_error}); copies off the GPU run slower and stall training longer",
                flush=True,
            )
        self._copied = snap.ready
        self._writer.submit(step, self._write_job(step, snap, meta))
        self._reading.append((step, index))

    def _say_disk_is_behind(self, step: int) -> None:
        """Once a run: checkpoint steps come faster than the disk writes them."""
        oldest = self._writer.pending_step
        if self._told_slow_disk or not self._longest_write_s or self._writer.cancelled(oldest):
            return
        self._told_slow_disk = True
        n = len(self._buffers)
        more = "set checkpoint.snapshot_buffers=2, " if n == 1 else ""
        print(
            f"warning: checkpoints come faster than this disk writes them: one took "
            f"{self._longest_write_s:.1f}s to write, and at step {step} "
            f"{'both host buffers were' if n == 2 else 'the host buffer was'} still being "
            f"written (checkpoint.interval_steps={self.cfg.checkpoint.interval_steps}), so "
            f"training waits for the disk. Fix: raise checkpoint.interval_steps, {more}or put "
            "the run dir on a faster disk",
            flush=True,
        )

    def _checkpoint_state(self) -> tuple[dict, dict]:
        """(optim.pt state, meta.json fields) of the current step. The tensors in the state are
        the live ones: a snapshot copies them before training goes on."""
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

    def _write_job(self, step: int, snap: Snapshot, meta: dict) -> ckpt_bg.Job:
        """The disk half of a save, on the writer thread or inline: the atomic triple, then
        retention. Reads only the snapshot (once its copies are complete) and values captured
        here, never the live trainer."""
        run_dir, keep = self.run_dir, self.cfg.checkpoint.keep_last
        protect = {self.resumed_from} if self.resumed_from is not None else set()
        faults = self.faults

        def job(cancel: threading.Event) -> Path:
            snap.wait()
            path = write_checkpoint(
                run_dir,
                step,
                snap.model,
                snap.optim,
                meta,
                before_meta=lambda: faults.during_save(step, cancel),
                cancel=cancel,
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

    def _report_saved(self, result: ckpt_bg.SaveResult) -> None:
        """The checkpoint of `result.step` is complete on disk: now, and only now, say so."""
        self.last_checkpoint_step = result.step
        self.checkpoint_write_s = result.write_s
        self._longest_write_s = max(self._longest_write_s, result.write_s)
        stall = self._stall_s.pop(result.step, self.checkpoint_time_s) or 0.0
        if self.dist.writer:
            size = f"{result.bytes / 2**20:.1f} MiB"
            if self.cfg.checkpoint.async_save:
                print(
                    f"saved checkpoint step {result.step} ({size}): training stalled "
                    f"{stall:.2f}s, written in the background in {result.write_s:.2f}s",
                    flush=True,
                )
            else:
                print(f"saved checkpoint step {result.step} in {stall:.2f}s ({size})", flush=True)
        self.telemetry.heartbeat(force=True)

    def _collect(self) -> None:
        """Hand over the oldest pending write, which has ended: report it complete, or say that
        it was cancelled; CheckpointError when it failed. Its buffer is free again either way."""
        step, _ = self._reading.popleft()
        try:
            result = self._writer.result()
        except WriteCancelled:
            self._stall_s.pop(step, None)
            print(
                f"checkpoint step {step} was not written: its write was cancelled, superseded "
                f"by the save of step {self.last_saved_step}",
                flush=True,
            )
            return
        self._report_saved(result)

    def poll_save(self) -> None:
        """Report the background writes that finished since the last call; re-raise a failure
        (CheckpointError) here, in the training loop, before the next step."""
        while self._writer.finished():
            self._collect()

    def _wait_for_save(self) -> None:
        """Block until the oldest background write in flight (if any) has ended and collect it;
        CheckpointError if it failed. A slow disk is not a hung worker, so the heartbeat goes
        on while waiting, but only up to max(10 min, 10 × the longest write so far): a write
        stuck longer than that stops the heartbeat and the supervisor's hang detection acts."""
        w, telemetry = self._writer, self.telemetry
        if w.pending_step is None:
            return
        prev_phase = telemetry.phase
        if not w.finished() and not w.cancelled(w.pending_step):
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
        self._collect()

    def finish_saves(self) -> None:
        """Wait until no checkpoint write is in flight: the stop path, the end of training and a
        NaN rollback call this. Under DDP every rank then waits at a barrier for the writer
        ranks, so no rank exits (torchrun would tear the job down, write included) or reads
        checkpoints before the writes are complete."""
        while self._writer.pending_step is not None:
            self._wait_for_save()
        if self.dist.enabled:
            self.dist.barrier()
        if self._unconfirmed:  # non-writer ranks: the writers are done
            self.last_checkpoint_step = self._unconfirmed[-1]
            self._unconfirmed.clear()

    def save_for_stop(self) -> None:
        """A stop (SIGTERM, preemption): leave with the current step complete on disk, as soon
        as the disk allows. A pending write of an older step is cancelled, since the stop's own
        save supersedes it and would otherwise wait for it; with checkpoint.save_on_exit=false
        the pending writes are finished instead and nothing new is saved."""
        step = self.counters.state_dict()["step"]
        if not self.cfg.checkpoint.save_on_exit:
            self.finish_saves()
            return
        saved = step in (self.last_checkpoint_step, self.last_saved_step)
        for older in self._writer.pending_steps:
            if older != step and self._writer.cancel(older):
                print(
                    f"stop: cancelling the write of checkpoint step {older}, superseded by "
                    f"step {step}",
                    flush=True,
                )
        if not saved:
            self.save()
        self.finish_saves()

    def close(self) -> None:
        """Exiting on an error with writes in flight: finish them, the state they hold is good."""
        while self._writer.pending_step is not None:
            try:
                self._writer.join()
                self._collect()
            except ckpt.CheckpointError as e:
                print(f"error: {e}", file=sys.stderr, flush=True)
