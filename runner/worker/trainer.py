"""The training loop: setup and resume, `train()` over `train_step()`, evaluation, and the
counters a checkpoint keeps. Saving, telemetry, the non-finite steps' policy (excursions.py),
the update (update.py) and building the parts are delegated to the sibling modules.

A step runs ahead: after queueing its update and before reading its loss and gradient norm (the
step's one host sync, update.GuardedUpdate), it queues the next step's first micro-batch's
forward, so the GPU has work while the host waits and then launches the rest of the next step
(without it a step begins with the GPU idle behind the batch's copy, the embedding, the first
block's entry and the scan's host path, all host work the GPU would wait for). Nothing a step
decides depends on that forward: it reads each layer's weights after that layer's update (on
CUDA the update runs on a stream of its own beside it, layer by layer, update.LayeredStep), and
the batch the next step reads first, peeked without being consumed, so a checkpoint taken
meanwhile saves the step's own data position; a non-finite step changes neither (its update is
skipped), so its retry on the next data uses the forward as it is; a rollback or a stop drops
it."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from pathlib import Path

import torch

from m3run.runner.config import ConfigError, RunConfig
from m3run.runner.data.loader import WindowStream, check_vocab, eval_batches
from m3run.runner.data.mixture import train_loader
from m3run.runner.files import PidLock
from m3run.runner.procs import create_time
from m3run.runner.protocol import EXIT_OK, WorkerPhase
from m3run.runner.schedule import lr_at

from . import standby
from .build import (
    autocast,
    build_model,
    build_optimizer,
    compile_for_training,
    compile_phases,
    freeze_config,
    resolve_device,
    resolve_precision,
    resolve_scan_backend,
    set_determinism,
)
from .checkpointing import Checkpointer
from .dist import Dist
from .excursions import Excursions
from .faults import Faults
from .ownership import claim_run_dir, keep_run_dir
from .preimport import DYNAMO, CompileStack, wait_imported
from .resume import Resume
from .telemetry import Pace, Telemetry
from .update import GuardedUpdate


class StopRequested(Exception):
    """SIGTERM or SIGINT reached a step boundary: save, then exit 75."""


class Trainer:
    """One worker rank's training run over `run_dir`: `setup()`, then `train()`, then
    `close()` on every path. The counters (step, tokens seen, the NaN-rollback state) round-trip
    through `state_dict()` / `load_state_dict()` inside each checkpoint."""

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path,
        resume: str = "latest",
        force: bool = False,
        lr_scale: float = 1.0,
        compile_stack: CompileStack | None = None,
        overlap: bool = True,
    ):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.resume = resume
        self.force = force
        self.lr_scale_arg = lr_scale
        # torch's compile stack being imported on a thread (preimport.py): the setup waits for
        # each part before its own first use of it.
        self.compile_stack = compile_stack
        # The next step's first forward queued before a step's host read (_runs_ahead) and, on
        # CUDA, the update beside it layer by layer (update.LayeredStep). Off, neither: the
        # plain order, which the tests and bench_train.py compare the overlapped one against.
        self.overlap = overlap
        self.faults = Faults.from_env()
        self.faults.stop_requested = lambda: self.stop_signal is not None
        self.stop_signal: int | None = None
        self.step = 0
        self.tokens_seen = 0
        # The next step's first micro-batch: its data position and its loss, the forward queued
        # before this step's read (_runs_ahead), or None.
        self._ahead: tuple[int, torch.Tensor] | None = None
        self.dist = Dist()
        self.excursions = Excursions(cfg.train, self.dist)  # non-finite steps, rollbacks
        # Built by setup(): close() and the exit paths cope with a setup that failed early.
        self.telemetry: Telemetry | None = None
        self.checkpointer: Checkpointer | None = None
        self.loader: WindowStream | None = None
        self.resumed_from: int | None = None
        self._ownership: PidLock | None = None  # worker.lock, held by writer ranks
        # Wall-clock marks of this process's way to its first step: the `startup_times` record.
        self.startup_times: dict[str, float | None] = {}

    # ---- counters ----

    def state_dict(self) -> dict:
        """The counters a checkpoint keeps in optim.pt, beside optimizer, data and RNG state."""
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "lr_scale": self.excursions.lr_scale,
            "nan_rollbacks": self.excursions.rollbacks,
            "skip_positions": list(self.excursions.skip_positions),
        }

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.excursions.lr_scale = float(state["lr_scale"])
        self.excursions.rollbacks = int(state["nan_rollbacks"])
        self.excursions.skip_positions = [int(p) for p in state["skip_positions"]]

    @property
    def last_checkpoint_step(self) -> int | None:
        """The newest step known complete on disk (None before setup built the checkpointer)."""
        return self.checkpointer.last_checkpoint_step if self.checkpointer else None

    def set_phase(self, phase: WorkerPhase) -> None:
        assert self.telemetry is not None, "setup() builds the telemetry"
        self.telemetry.set_phase(phase)

    # ---- setup ----

    def setup(self) -> None:
        cfg, t = self.cfg, self.cfg.train
        marks = self.startup_times
        # A warm spare's process started long before this worker did: it starts when handed
        # its arguments.
        marks["process_start"] = standby.activated_at() or create_time(os.getpid())
        marks["setup_start"] = time.time()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.dist.writer:
            self._ownership = claim_run_dir(self.run_dir)
            freeze_config(cfg, self.run_dir, self.force)
        if t.deterministic:
            wait_imported(self.compile_stack)  # its switches import inductor: the whole stack first
        determinism = set_determinism(t.deterministic)
        if determinism and self.dist.writer:
            print(determinism, flush=True)
        self.device = resolve_device(cfg, self.dist)
        self.dist.init(cfg, self.device)
        marks["device_ready"] = time.time()
        self.local_accum = self.dist.local_accumulation(cfg)
        self.scan_backend = resolve_scan_backend(cfg, self.device)
        self.telemetry = Telemetry(cfg, self.run_dir, self.dist, self.device, lambda: self.step)
        self.faults.while_held = lambda: self.telemetry.heartbeat(force=True)
        self.telemetry.heartbeat(force=True)
        self.faults.startup()
        self.autocast_dtype = resolve_precision(cfg, self.device)

        self.model = build_model(cfg, self.device)
        self.n_params = self.model.num_params()
        marks["model_init"] = time.time()
        wait_imported(self.compile_stack, DYNAMO)
        self.optimizer = build_optimizer(self.model, self.device, t, lr=t.lr, eps=t.eps)
        # The update beside the next forward, layer by layer (update.LayeredStep): where the
        # forward's layers run eagerly between compiled blocks and without DDP.
        whole_graph = t.compile and t.compile_scope == "model"
        layered = self.overlap and not (self.dist.enabled or whole_graph)
        layers = self.model.layer_params() if layered else None
        self.update = GuardedUpdate(self.optimizer, self.device, layers)
        if self.update.side is not None:
            self.model.before_layer = self.update.side.wait
        marks["model_built"] = time.time()
        self.loader = train_loader(
            cfg.data.train_path,
            cfg.data.sources,
            cfg.data.seq_len,
            t.micro_batch_size,
            t.seed,
            rank=self.dist.rank,
            world_size=self.dist.world_size,
            prefetch=cfg.data.prefetch,
            pin_memory=self.device.type == "cuda",
            force=self.force,
        )
        check_vocab(self.loader, cfg.model.vocab_size)
        # data.reset_at_eos: the scan state restarts after every EOS, in training and eval.
        self.eos_id = self.loader.eos_id if cfg.data.reset_at_eos else None
        # The scan's kernels compile on a pool of threads from here on, beside the checkpoint
        # load and torch.compile's work, rather than one by one at their first launch.
        precompile = self.model.precompile_scan(
            t.micro_batch_size,
            cfg.data.seq_len,
            self.autocast_dtype or torch.float32,
            reset=self.eos_id is not None,
        )
        if precompile is not None and self.dist.writer:
            precompile.add_done_callback(_say_precompiled)
        self.val_batches = None
        if cfg.eval.interval_steps and cfg.data.val_path:
            self.val_batches = eval_batches(
                cfg.data.val_path, cfg.data.seq_len, t.micro_batch_size, cfg.eval.steps
            )
        self.checkpointer = Checkpointer(
            cfg,
            self.run_dir,
            self.dist,
            self.faults,
            self.telemetry,
            model=self.model,
            optimizer=self.optimizer,
            loader=self.loader,
            counters=self,
            force=self.force,
        )
        self.telemetry.saves = self.checkpointer.status
        resumer = Resume(
            self.run_dir, self.resume, self.force, self.dist, self.checkpointer, self.telemetry
        )
        marks["resume_start"] = time.time()
        self.resumed_from = self.checkpointer.resumed_from = resumer.run()
        marks["resume_end"] = time.time()
        self.excursions.lr_scale *= self.lr_scale_arg
        wait_imported(self.compile_stack)  # DDP and torch.compile reach into inductor
        self.ddp_model = self.model
        if self.dist.enabled:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            self.ddp_model = DistributedDataParallel(self.model, device_ids=ids)
        # Under compile_scope=blocks the blocks compile in place; DDP's hooks stay eager.
        self.step_model = compile_for_training(self.model, t, self.ddp_model)
        marks["compile_wrapped"] = time.time()
        self.tokens_per_step = t.micro_batch_size * t.grad_accum_steps * cfg.data.seq_len
        self.telemetry.start_tracker(resumed=self.resumed_from is not None)
        if self.faults.asked:  # tests only (M3RUN_FAULT): crash, hang, hold or poison a step
            self.faults.wrap_step(self)
        marks["setup_end"] = time.time()

    # ---- the loop ----

    def _keep_ownership(self) -> None:
        """worker.lock deleted or replaced: take it again (ownership.keep_run_dir), or, with a
        second writer holding it, stop as on SIGTERM (a checkpoint, then exit 75)."""
        if self._ownership is None:
            return
        try:
            note = keep_run_dir(self._ownership)
        except ConfigError as e:
            print(f"error: {e}", flush=True)
            self.stop_signal = signal.SIGTERM
            self._ownership = None  # the lock at the path is the other writer's
            return
        if note is not None:
            print(note, flush=True)

    def _on_signal(self, signum, frame) -> None:
        # Only set the flag: a print here could re-enter a stdout write the signal interrupted
        # and lose the stop. The training loop reports it at the next step boundary.
        self.stop_signal = signum

    def train_step(self) -> dict:
        """One optimizer step over grad_accum_steps micro-batches. Returns the step's loss,
        grad norm and lr, or, when the step was skipped as non-finite (weights and moments
        untouched), {"bad": True, ...} with the data position it started at."""
        t = self.cfg.train
        step = self.step + 1
        lr = lr_at(self.cfg, step) * self.excursions.lr_scale
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.excursions.skip_windows(self.loader, self.local_accum)
        start_pos = self.loader.windows_consumed
        loss_sum = torch.zeros((), device=self.device)
        amp = autocast(self.device, self.autocast_dtype)
        ahead, self._ahead = self._ahead, None
        for i in range(self.local_accum):
            # DDP all-reduces gradients only on the last micro-batch of the window.
            sync = i == self.local_accum - 1 or not self.dist.enabled
            with amp, contextlib.nullcontext() if sync else self.ddp_model.no_sync():
                if i == 0 and ahead is not None:
                    pos, loss = ahead
                    if pos != start_pos:  # only a rollback moves the data, and it drops it
                        raise RuntimeError(f"forward run ahead at position {pos}, not {start_pos}")
                    self.loader.next_batch()  # the batch that forward read, consumed now
                else:
                    loss = self._forward(self.loader.next_batch())
                # Divide before backward so the summed gradients are those of the mean loss.
                (loss / self.local_accum).backward()
            loss_sum += loss.detach()
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.get_total_norm(grads)
        # The logged loss is the mean over every micro-batch of the step, on every rank.
        mean = self.dist.all_sum(loss_sum) / t.grad_accum_steps
        # Clipped to train.grad_clip as the update runs; no update when either number is
        # non-finite; the gradients are dropped either way. The update overwrites the state a
        # checkpoint's copy may still be reading.
        self.checkpointer.before_update()
        queued = self.update.queue(mean, grad_norm, t.grad_clip)
        if self._runs_ahead(step):
            self.excursions.skip_windows(self.loader, self.local_accum)
            with amp:
                pos = self.loader.windows_consumed
                self._ahead = pos, self._forward(self.loader.peek_batch())
        mean_loss, gnorm = self.update.read(queued)  # the step's one host sync
        if not (math.isfinite(mean_loss) and math.isfinite(gnorm)):
            return {"bad": True, "start_pos": start_pos, "loss": mean_loss, "grad_norm": gnorm}
        self.step = step
        self.tokens_seen += self.tokens_per_step
        return {"loss": mean_loss, "grad_norm": gnorm, "lr": lr}

    def _forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = (part.to(self.device, non_blocking=True) for part in batch)
        return self.step_model(x, y, eos_id=self.eos_id)

    def _runs_ahead(self, step: int) -> bool:
        """Whether step ``step`` queues the next one's first forward before its host read
        (module docstring): not after the last step, before an eval (whose forwards would run
        beside the activations kept), once a stop is asked, or under DDP (a forward readies a
        gradient reduction that a dropped one would leave pending)."""
        eval_next = self.val_batches is not None and self._eval_due(step)
        return (
            self.overlap
            and not self.dist.enabled
            and step < self.cfg.train.total_steps
            and not eval_next
            and self.stop_signal is None
        )

    def _eval_due(self, step: int) -> bool:
        """Every eval.interval_steps, and at the last step whatever its number, so a run
        always ends with its validation loss."""
        every = self.cfg.eval.interval_steps
        return bool(every) and (step % every == 0 or step == self.cfg.train.total_steps)

    def eval(self) -> float | None:
        if self.val_batches is None or not self.dist.writer:
            return None
        self.set_phase(WorkerPhase.EVAL)
        self.model.eval()
        total = 0.0
        with torch.no_grad():
            for x, y in self.val_batches:
                x, y = x.to(self.device), y.to(self.device)
                with autocast(self.device, self.autocast_dtype):
                    total += self.model(x, y, eos_id=self.eos_id).item()
        self.model.train()
        self.set_phase(WorkerPhase.TRAINING)
        loss = total / len(self.val_batches)
        self.telemetry.log_eval(self.step, loss)
        return loss

    def train(self) -> int:
        cfg, t = self.cfg, self.cfg.train
        saves, telemetry = self.checkpointer, self.telemetry
        self.model.train()
        self.set_phase(WorkerPhase.TRAINING)
        # Step time excludes evals and checkpoint saves (they are reported on their own).
        window_t0, window_steps, paused = time.perf_counter(), 0, 0.0
        pace = Pace()
        while self.step < t.total_steps:
            saves.poll_save()  # a finished background save is reported, a failed one raised
            self._keep_ownership()
            if self._stop_agreed():
                raise StopRequested
            out = self.train_step()
            if out.get("bad"):
                if self.excursions.bad_step(self.step + 1, out, telemetry):
                    self._ahead = None  # computed on the weights the rollback replaces
                    self.excursions.rollback(self.step + 1, self.run_dir, saves, telemetry)
                telemetry.heartbeat()
                continue
            self.excursions.good_step()
            if "first_step_end" not in self.startup_times:
                self._record_startup()
                saves.prepare()  # the optimizer's state exists now
            window_steps += 1
            telemetry.last.update(out)
            if self.step % cfg.log.interval_steps == 0 or self.step == t.total_steps:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                wall = time.perf_counter() - window_t0
                elapsed = wall - paused
                pace.add(wall, window_steps)
                telemetry.log_train(
                    self.step,
                    out,
                    step_time_s=elapsed / max(1, window_steps),
                    tokens_per_step=self.tokens_per_step,
                    tokens_seen=self.tokens_seen,
                    tokens_by_source=self.loader.tokens_by_source(),
                    n_params=self.n_params,
                    eta_s=pace.eta_s(t.total_steps - self.step),
                )
                window_t0, window_steps, paused = time.perf_counter(), 0, 0.0
            t_aside = time.perf_counter()
            if self._eval_due(self.step):
                self.eval()
            if self.step % cfg.checkpoint.interval_steps == 0 or self.step == t.total_steps:
                saves.save()
            paused += time.perf_counter() - t_aside
            telemetry.heartbeat()
        saves.finish_saves()  # the final checkpoint is complete on disk before "finished"
        return EXIT_OK

    def _record_startup(self) -> None:
        """Once per process, at its first completed optimizer step: a `startup_times` record
        of when the process started, began setup, had built the model, optimizer and loader,
        started and finished resuming (checkpoint choice, verification and load), ended setup
        and completed that step (compilation and autotuning included), all Unix seconds; with
        train.compile, also where torch.compile's time went (`compile_phases`, seconds)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the step's kernels, optimizer included, ran
        self.startup_times["first_step_end"] = time.time()
        if self.dist.writer:
            phases = compile_phases() if self.cfg.train.compile else {}
            self.telemetry.record(
                {
                    "kind": "startup_times",
                    "step": self.step,
                    "pid": os.getpid(),
                    "resumed_from": self.resumed_from,
                    "time": time.time(),
                    **self.startup_times,
                    **({"compile_phases": phases} if phases else {}),
                }
            )

    def _stop_agreed(self) -> bool:
        """Every rank stops at the same step boundary: a signal seen by any rank stops all."""
        if not self.dist.enabled:
            stop = self.stop_signal is not None
        else:
            flag = torch.tensor([0 if self.stop_signal is None else 1], device=self.device)
            stop = bool(self.dist.all_sum(flag).item())
        if stop:
            self._ahead = None  # no step will use it
        if stop and self.dist.writer:
            why = signal.Signals(self.stop_signal).name if self.stop_signal else "another rank"
            print(f"stop requested ({why}): saving at step {self.step}", flush=True)
        return stop

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()
        self.dist.close()
        if self.loader is not None:
            self.loader.close()
        if self.telemetry is not None:
            self.telemetry.close()
        if self._ownership is not None:
            self._ownership.release()


def _say_precompiled(job) -> None:
    """The scan kernels' precompile in the worker's log, said by the thread that ended it."""
    try:
        print(f"precompile: {job.result()}", flush=True)
    except Exception as e:
        print(
            f"precompile: compiling the scan kernels ahead failed ({e}); each compiles at its "
            "first launch instead",
            flush=True,
        )
