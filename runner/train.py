"""The training worker: `m3run train CONFIG --run-dir DIR` / `python -m runner.train ...`.

Builds the model, the optimizer, the schedule and the data stream from a `RunConfig`, resumes
from a checkpoint when asked, trains, and leaves everything the supervisor watches in the run
directory (heartbeat.json, metrics.jsonl, checkpoints/). Exit codes are the protocol in
runner/protocol.py: 0 finished, 75 stopped after a saved checkpoint, 76 NaN excursion not healed,
78 bad config or data, anything else a crash.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import math
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.mamba3 import BackendUnavailableError, resolve_backend
from model import Mamba3LM
from model.lm import param_groups
from runner.checkpoint import io as ckpt_io
from runner.checkpoint import layout as ckpt
from runner.files import append_jsonl, atomic_write_json

from . import __version__
from .config import ConfigError, RunConfig, config_hash, load_config
from .data.loader import BatchLoader, check_vocab, eval_batches
from .data.manifest import DataError
from .protocol import (
    CONFIG_FILE,
    EXIT_CONFIG,
    EXIT_NAN,
    EXIT_OK,
    EXIT_STOPPED,
    FAULT_ENV,
    METRICS_FILE,
    heartbeat_file,
)
from .runstate import format_duration

# A background checkpoint write running longer than max(this, 10 × the longest one so far) is
# treated as stuck: waiting for it no longer refreshes the heartbeat (see Trainer._wait_for_save).
_WRITE_HANG_S = 600.0
# Exit code of a worker whose checkpoint could not be written: a crash, so the supervisor
# restarts it from the latest complete checkpoint (any code outside the protocol's is a crash).
EXIT_SAVE_FAILED = 1

# Dense bf16 tensor-core peaks (FLOP/s) by device name, for MFU when no measured peak is given.
_BF16_PEAK = {"A100": 312e12, "H100": 989e12, "H200": 989e12, "H20": 148e12, "L40S": 362e12}


class NaNExcursion(RuntimeError):
    """Non-finite steps the in-process rollback could not heal (worker exit 76)."""


class StopRequested(Exception):
    pass


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

    @property
    def writer(self) -> bool:
        return self.local_rank == 0

    def init(self, cfg: RunConfig, device_type: str) -> None:
        if not self.enabled:
            return
        import datetime

        import torch.distributed as td

        backend = cfg.distributed.backend
        if backend == "auto":
            backend = "nccl" if device_type == "cuda" else "gloo"
        if backend == "nccl" and device_type != "cuda":
            raise ConfigError(
                "distributed.backend=nccl needs CUDA; set it to gloo (or auto) on CPU"
            )
        td.init_process_group(
            backend, timeout=datetime.timedelta(seconds=cfg.distributed.timeout_s)
        )

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            import torch.distributed as td

            td.all_reduce(t, op=td.ReduceOp.SUM)
        return t

    def all_min(self, value: int) -> int:
        if not self.enabled:
            return value
        import torch.distributed as td

        t = torch.tensor([value], dtype=torch.int64, device=self._device)
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


# -- schedule ----------------------------------------------------------------------------------


def lr_at(cfg: RunConfig, step: int) -> float:
    """Learning rate for optimizer step ``step`` (1-based), before the NaN-rollback scale.

    Linear warmup over ``warmup_steps`` (step 1 gets lr/warmup, never 0), then cosine to
    ``lr·min_lr_ratio`` at ``total_steps``, or WSD: constant, then a linear decay over the last
    ``decay_fraction`` of the steps (Hu et al., MiniCPM 2024).
    """
    t = cfg.train
    peak, floor = t.lr, t.lr * t.min_lr_ratio
    if step <= t.warmup_steps:
        return peak * step / t.warmup_steps
    if t.schedule == "cosine":
        span = max(1, t.total_steps - t.warmup_steps)
        progress = min(1.0, (step - t.warmup_steps) / span)
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    decay_start = max(t.warmup_steps, round(t.total_steps * (1.0 - t.decay_fraction)))
    if step <= decay_start:
        return peak
    progress = min(1.0, (step - decay_start) / max(1, t.total_steps - decay_start))
    return peak + (floor - peak) * progress


# -- fault injection (tests only) ---------------------------------------------------------------


@dataclass
class Faults:
    """Parsed from M3RUN_FAULT (see runner/protocol.py). Empty in production."""

    spec: dict[str, str]
    fired: list[str]
    # Run before a crash fault exits: the trainer finishes a checkpoint write in flight, as any
    # crash that unwinds Python does (Trainer.close); SIGKILL is what loses an in-flight write.
    before_crash: Callable[[], object] | None = None

    @classmethod
    def from_env(cls) -> Faults:
        spec = {}
        for part in filter(None, os.environ.get(FAULT_ENV, "").split(",")):
            key, _, value = part.partition("=")
            spec[key.strip()] = value.strip()
        return cls(spec, [])

    def _once(self, key: str, step: int) -> bool:
        """True for the first N attempts at a step ≥ the fault's step ("7" or "7x3")."""
        if key not in self.spec:
            return False
        at, _, count = self.spec[key].partition("x")
        if step < int(at) or self.fired.count(key) >= int(count or 1):
            return False
        self.fired.append(key)
        return True

    def before_step(self, step: int) -> None:
        if self._once("crash_at_step", step):
            print(f"[fault] crash before step {step}", flush=True)
            if self.before_crash is not None:
                self.before_crash()
            os._exit(1)
        if self._once("hang_at_step", step):
            print(f"[fault] hang before step {step}", flush=True)
            while True:
                time.sleep(3600)

    def poison(self, step: int) -> bool:
        if "nan_from_step" in self.spec and step >= int(self.spec["nan_from_step"]):
            return True
        return self._once("nan_at_step", step)

    def startup(self) -> None:
        if "crash_at_startup" in self.spec:
            print("[fault] crash at startup", flush=True)
            os._exit(1)

    @property
    def slow_save(self) -> float:
        return float(self.spec.get("slow_save", 0.0))

    def during_save(self, step: int) -> None:
        """Called mid-write (data files written, meta.json not yet), on the writer's thread."""
        if self.slow_save:
            time.sleep(self.slow_save)
        if self._once("save_error_at_step", step):
            print(f"[fault] checkpoint write error at step {step}", flush=True)
            raise OSError(errno.EIO, f"injected write error (M3RUN_FAULT) for step {step}")


# -- the worker --------------------------------------------------------------------------------


def _fmt_tokens(n: float) -> str:
    return f"{n / 1e3:.1f}k" if n < 1e6 else f"{n / 1e6:.2f}M"


class Trainer:
    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path,
        resume: str = "latest",
        force: bool = False,
        lr_scale: float = 1.0,
    ):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.resume = resume
        self.force = force
        self.lr_scale_arg = lr_scale
        self.faults = Faults.from_env()
        self.stop_signal: int | None = None
        self._last_heartbeat = 0.0
        self.phase = "startup"
        self.step = 0
        self.tokens_seen = 0
        self.lr_scale = 1.0
        self.nan_rollbacks = 0
        self.skip_positions: list[int] = []  # data positions of windows that produced NaN
        self.last_checkpoint_step: int | None = None  # complete on disk: never one being written
        self.checkpoint_time_s: float | None = None  # training stall of the latest save
        self.checkpoint_write_s: float | None = None  # write time of the latest complete save
        # checkpoint.async_save: the background writer (writer ranks), its reused host buffers,
        # and on non-writer ranks the step whose write is not yet known to be complete.
        self._writer = ckpt_io.BackgroundWriter()
        self._snapshot_buffers = ckpt_io.SnapshotBuffers()
        self._unconfirmed_step: int | None = None
        self._longest_write_s = 0.0
        self.faults.before_crash = self._writer.join
        self.step_time_s: float | None = None
        self.last: dict = {}
        self.tracker = None
        self.dist = Dist()

    # ---- setup ----

    def setup(self) -> None:
        cfg, t = self.cfg, self.cfg.train
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.dist.writer:
            self._freeze_config()
        self.device = self._resolve_device()
        self.dist._device = self.device
        self.dist.init(cfg, self.device.type)
        self.local_accum = self._local_accumulation()
        try:
            self.scan_backend = resolve_backend(cfg.model.scan_backend, self.device)
        except BackendUnavailableError as e:
            raise ConfigError(
                f"model.scan_backend={cfg.model.scan_backend}: {e}. "
                "Fix: set model.scan_backend=auto or pytorch, or run on a CUDA machine with triton."
            ) from e
        self.heartbeat(force=True)
        self.faults.startup()
        self.autocast_dtype = self._resolve_precision()

        torch.manual_seed(t.seed)
        model = Mamba3LM(cfg.model)
        model.activation_checkpointing = t.activation_checkpointing
        self.model = model.to(self.device)
        self.n_params = self.model.num_params()
        self.optimizer = torch.optim.AdamW(
            param_groups(self.model, t.weight_decay),
            lr=t.lr,
            betas=(t.beta1, t.beta2),
            eps=t.eps,
            fused=self.device.type == "cuda",
        )
        self.loader = BatchLoader(
            cfg.data.train_path,
            cfg.data.seq_len,
            t.micro_batch_size,
            t.seed,
            rank=self.dist.rank,
            world_size=self.dist.world_size,
            prefetch=cfg.data.prefetch,
            pin_memory=self.device.type == "cuda",
        )
        check_vocab(self.loader, cfg.model.vocab_size)
        self.val_batches = None
        if cfg.eval.interval_steps and cfg.data.val_path:
            self.val_batches = eval_batches(
                cfg.data.val_path, cfg.data.seq_len, t.micro_batch_size, cfg.eval.steps
            )
        self.resumed_from = self._resume()
        self.lr_scale *= self.lr_scale_arg
        self.ddp_model = self.model
        if self.dist.enabled:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            self.ddp_model = DistributedDataParallel(self.model, device_ids=ids)
        self.step_model = self.ddp_model
        if t.compile:
            mode = os.environ.get("TORCH_COMPILE_MODE") or t.compile_mode
            self.set_phase("compiling")
            self.step_model = torch.compile(self.ddp_model, mode=mode)
        self.tokens_per_step = t.micro_batch_size * t.grad_accum_steps * cfg.data.seq_len
        self.peak_flops = self._peak_flops()
        self._start_tracker()

    def _freeze_config(self) -> None:
        path = self.run_dir / CONFIG_FILE
        if path.exists():
            if config_hash(load_config(path)) == config_hash(self.cfg):
                return
            if not self.force:
                raise ConfigError(
                    f"the config differs from the one frozen in {path} at the first launch. "
                    "Fix: relaunch with the same config, or pass --force to replace it."
                )
        tmp = path.with_suffix(".yaml.tmp")
        tmp.write_text(self.cfg.to_yaml())
        os.replace(tmp, path)

    def _resolve_device(self) -> torch.device:
        kind = self.cfg.train.resolve_device(torch.cuda.is_available())
        if kind == "cuda" and self.dist.enabled:
            torch.cuda.set_device(self.dist.local_rank)
            return torch.device("cuda", self.dist.local_rank)
        return torch.device(kind)

    def _local_accumulation(self) -> int:
        """Micro-batches per rank per optimizer step. The global batch (micro_batch_size ×
        grad_accum_steps sequences) is the same for every world size; accumulation adjusts."""
        accum, world = self.cfg.train.grad_accum_steps, self.dist.world_size
        if accum % world:
            raise ConfigError(
                f"train.grad_accum_steps={accum} cannot be split evenly over {world} processes "
                "(the global batch is micro_batch_size × grad_accum_steps sequences for every "
                f"world size). Fix: make grad_accum_steps a multiple of {world}, e.g. "
                f"{-(-accum // world) * world}, adjusting micro_batch_size to keep the batch."
            )
        if world > 1 and self.dist.rank == 0:
            print(
                f"global batch {self.cfg.train.micro_batch_size * accum} sequences = "
                f"{self.cfg.train.micro_batch_size} × {accum // world} accumulation × {world} "
                "processes",
                flush=True,
            )
        return accum // world

    def _resolve_precision(self):
        precision = self.cfg.train.resolve_precision(self.device.type)
        if precision == "bf16" and self.device.type == "cpu":
            raise ConfigError(
                "train.precision=bf16 on CPU would be slow and inexact. "
                "Fix: set train.precision=fp32 (or auto)."
            )
        return torch.bfloat16 if precision == "bf16" else None

    def _peak_flops(self) -> float | None:
        if self.device.type != "cuda":
            return None
        if os.environ.get("M3RUN_PEAK_FLOPS"):
            return float(os.environ["M3RUN_PEAK_FLOPS"])
        name = torch.cuda.get_device_name(self.device)
        for key, peak in _BF16_PEAK.items():
            if key in name:
                return peak
        return None

    def _start_tracker(self) -> None:
        project = os.environ.get("WANDB_PROJECT")
        if not project:
            return
        resumed = self.resumed_from is not None
        try:
            import wandb  # optional: only when WANDB_PROJECT is set

            self.tracker = wandb.init(
                project=project,
                name=self.run_dir.name,
                dir=str(self.run_dir),
                config=self.cfg.model_dump(mode="json"),
                resume="allow",
                id=f"m3run-{config_hash(self.cfg)[:12]}",
            )
        except Exception as e:
            if not resumed:
                raise ConfigError(
                    f"WANDB_PROJECT={project} is set but the experiment tracker failed to start: "
                    f"{type(e).__name__}: {e}. Fix: install and log in to wandb "
                    "(`pip install wandb; wandb login`), or unset WANDB_PROJECT."
                ) from e
            print(f"warning: experiment tracker unavailable on resume ({e}); training goes on")
            self.tracker = None

    def _track(self, record: dict) -> None:
        if self.tracker is None:
            return
        try:
            self.tracker.log({k: v for k, v in record.items() if k != "kind"}, step=self.step)
        except Exception as e:  # a tracker outage must never kill a running job
            print(f"warning: experiment tracker failed ({e}); disabling it for this process")
            self.tracker = None

    # ---- resume ----

    def _resume(self) -> int | None:
        resume = self.resume
        infos = ckpt.list_checkpoints(self.run_dir, verify=False)
        if resume == "none":
            if infos and not self.force:
                raise ConfigError(
                    f"--resume none but {self.run_dir / 'checkpoints'} already holds "
                    f"{len(infos)} checkpoint(s). Fix: use --resume latest to continue, "
                    "or --force to start over (the old checkpoints are moved aside, not deleted)."
                )
            if infos and self.dist.writer:
                aside = self.run_dir / f"checkpoints.old-{int(time.time())}"
                os.replace(self.run_dir / "checkpoints", aside)
                print(f"--resume none --force: previous checkpoints moved to {aside}")
            self.dist.barrier()
            return None
        if resume == "latest":
            info = ckpt.latest_complete(self.run_dir)
            if self.dist.enabled:
                # Every host resumes from the same step: the newest one all of them hold.
                agreed = self.dist.all_min(info.step if info is not None else -1)
                info = ckpt.find_step(self.run_dir, agreed) if agreed >= 0 else None
            if info is None:
                torn = [i for i in infos if not i.complete]
                if torn:
                    print(f"note: ignoring {len(torn)} incomplete checkpoint(s); starting fresh")
                return None
        else:
            try:
                step = int(resume)
            except ValueError:
                raise ConfigError(
                    f"--resume must be latest, none or a step number, got {resume!r}"
                ) from None
            try:
                info = ckpt.find_step(self.run_dir, step)
            except ckpt.CheckpointError as e:
                raise ConfigError(str(e)) from e
        self.load(info.path)
        if self.dist.writer:
            print(f"resumed from {info.path} (step {self.step})", flush=True)
            append_jsonl(
                self.run_dir / METRICS_FILE,
                {"kind": "resume", "step": self.step, "time": time.time(), "pid": os.getpid()},
            )
        return self.step

    def load(self, path: Path) -> None:
        """Restore everything from a checkpoint that latest_complete/find_step just verified."""
        model_state, state, meta = ckpt_io.load_checkpoint(path, hashes_checked=True)
        if meta.get("config_hash") not in (None, config_hash(self.cfg)) and not self.force:
            print(
                f"warning: checkpoint {path.name} was written under a different config "
                "(model or schedule changes apply from here on)"
            )
        self.model.load_state_dict(model_state)
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.lr_scale = float(state["lr_scale"])
        self.nan_rollbacks = int(state["nan_rollbacks"])
        self.skip_positions = [int(p) for p in state["skip_positions"]]
        self.loader.load_state_dict(state["data"])
        torch.set_rng_state(state["rng"]["torch"])
        if self.device.type == "cuda" and state["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)
        self.last_checkpoint_step = self.step

    # ---- checkpoints ----

    def save(self) -> Path | None:
        """Checkpoint the current step.

        checkpoint.async_save=false: write it here (training stalls for the whole write) and
        return its directory. async_save=true (the default): wait for the previous background
        write if it is still running (that wait is stall too), copy model and optimizer state
        into the reused host buffers, hand the write to the background thread and return None.
        Either way the step is reported (heartbeat `last_checkpoint_step`, the "saved checkpoint"
        line) only once the checkpoint is complete on disk: `poll_save()` reports a finished
        background write before the next step, `finish_saves()` waits for it."""
        prev_phase = self.phase
        self.set_phase("checkpointing")
        t0 = time.perf_counter()
        background = self.cfg.checkpoint.async_save
        if background:
            self._wait_for_save()  # at most one write in flight: its buffers are reused below
        step, path, result = self.step, None, None
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
        self.set_phase(prev_phase)
        if result is not None:
            self._report_saved(result)
        return path

    def _checkpoint_state(self) -> tuple[dict, dict]:
        """(optim.pt state, meta.json fields) of the current step. The tensors in the state are
        the live ones: `ckpt_io.snapshot` copies them before training goes on."""
        rng = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        state = {
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "lr_scale": self.lr_scale,
            "nan_rollbacks": self.nan_rollbacks,
            "skip_positions": list(self.skip_positions),
            "data": self.loader.state_dict(),
            "rng": rng,
        }
        meta = {
            "tokens_seen": self.tokens_seen,
            "data_state": state["data"],
            "config_hash": config_hash(self.cfg),
            # The LR-schedule multiplier this checkpoint trains at (NaN cuts); the supervisor
            # reads it to cut relative to the run's real LR, never compounding a cut twice.
            "lr_scale": self.lr_scale,
            "versions": {
                "m3run": __version__,
                "torch": torch.__version__,
                "python": sys.version.split()[0],
            },
            "loss": self.last.get("loss"),
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
                run_dir, step, cpu_model, cpu_optim, meta,
                before_meta=lambda: faults.during_save(step),
            )  # fmt: skip
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
        self.heartbeat(force=True)

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
        w = self._writer
        if w.pending_step is None:
            return
        prev_phase = self.phase
        if w.running():
            print(
                f"waiting for checkpoint step {w.pending_step} to finish writing "
                f"({w.elapsed_s:.1f}s so far)",
                flush=True,
            )
            if prev_phase == "training":
                self.set_phase("checkpointing")
        poll_s = max(0.05, self.cfg.log.heartbeat_interval_s)
        bound_s = max(_WRITE_HANG_S, 10 * self._longest_write_s)
        while not w.join(timeout=poll_s):
            if w.elapsed_s < bound_s:
                self.heartbeat(force=True)
        if self.phase != prev_phase:
            self.set_phase(prev_phase)
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

    # ---- heartbeat / metrics ----

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self.heartbeat(force=True)

    def heartbeat(self, force: bool = False) -> None:
        now = time.time()
        if not force and now - self._last_heartbeat < self.cfg.log.heartbeat_interval_s:
            return
        self._last_heartbeat = now
        vram = None
        dev = getattr(self, "device", None)
        if dev is not None and dev.type == "cuda":
            vram = torch.cuda.max_memory_allocated(dev)
        atomic_write_json(
            self.run_dir / heartbeat_file(self.dist.local_rank),
            {
                "pid": os.getpid(),
                "phase": self.phase,
                "step": self.step,
                "total_steps": self.cfg.train.total_steps,
                "loss": self.last.get("loss"),
                "lr": self.last.get("lr"),
                "grad_norm": self.last.get("grad_norm"),
                "tokens_per_s": self.last.get("tokens_per_s"),
                "mfu": self.last.get("mfu"),
                "vram_bytes": vram,
                "step_time_s": self.step_time_s,
                "checkpoint_time_s": self.checkpoint_time_s,
                "checkpoint_write_s": self.checkpoint_write_s,
                "checkpoint_in_flight_step": self._writer.pending_step,
                "last_checkpoint_step": self.last_checkpoint_step,
                "ts": now,
            },
        )

    def log_step(self, record: dict, eta_s: float) -> None:
        if not self.dist.writer:
            return
        append_jsonl(self.run_dir / METRICS_FILE, record)
        self._track(record)
        mem = ""
        if self.device.type == "cuda":
            mem = f" | mem {torch.cuda.max_memory_allocated(self.device) / 2**30:.1f}GB"
        mfu = f" | mfu {record['mfu'] * 100:.1f}%" if record["mfu"] is not None else ""
        print(
            f"step {record['step']}/{self.cfg.train.total_steps} | loss {record['loss']:.4f} "
            f"| ppl {record['ppl']:.1f} | lr {record['lr']:.2e} | gnorm {record['grad_norm']:.3f} "
            f"| {_fmt_tokens(record['tokens_per_s'])} tok/s{mfu}{mem} "
            f"| eta {format_duration(eta_s)}",
            flush=True,
        )

    # ---- the loop ----

    def _on_signal(self, signum, frame) -> None:
        # Only set the flag: a print here could re-enter a stdout write the signal interrupted
        # and lose the stop. The training loop reports it at the next step boundary.
        self.stop_signal = signum

    def train_step(self) -> dict | None:
        """One optimizer step over grad_accum_steps micro-batches. Returns the step's record,
        or None when the step was skipped as non-finite (weights and moments untouched)."""
        t = self.cfg.train
        step = self.step + 1
        self.faults.before_step(step)
        lr = lr_at(self.cfg, step) * self.lr_scale
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        # A NaN streak recorded several consecutive windows: skip every one of them.
        while self.loader.windows_consumed in self.skip_positions:
            pos = self.loader.windows_consumed
            self.loader.skip(self.local_accum)
            if self.dist.writer:
                print(f"skipping the data window at position {pos} (it gave NaN earlier)")
        start_pos = self.loader.windows_consumed
        poison = self.faults.poison(step)
        loss_sum = torch.zeros((), device=self.device)
        autocast = (
            torch.autocast(self.device.type, dtype=self.autocast_dtype)
            if self.autocast_dtype is not None
            else contextlib.nullcontext()
        )
        for i in range(self.local_accum):
            x, y = self.loader.next_batch()
            x = x.to(self.device, non_blocking=True)
            y = y.to(self.device, non_blocking=True)
            # DDP all-reduces gradients only on the last micro-batch of the window.
            sync = i == self.local_accum - 1 or not self.dist.enabled
            with autocast, contextlib.nullcontext() if sync else self.ddp_model.no_sync():
                loss = self.step_model(x, y)
                if poison:
                    loss = loss * float("nan")
                # Divide before backward so the summed gradients are those of the mean loss.
                (loss / self.local_accum).backward()
            loss_sum += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip)
        # The logged loss is the mean over every micro-batch of the step, on every rank.
        mean = self.dist.all_sum(loss_sum) / t.grad_accum_steps
        # One host sync per step: the non-finite guard needs both numbers before the update.
        mean_loss, gnorm = torch.stack([mean.float(), grad_norm.float()]).tolist()
        if not (math.isfinite(mean_loss) and math.isfinite(gnorm)):
            self.optimizer.zero_grad(set_to_none=True)
            return {"bad": True, "start_pos": start_pos, "loss": mean_loss, "grad_norm": gnorm}
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step = step
        self.tokens_seen += self.tokens_per_step
        return {"loss": mean_loss, "grad_norm": gnorm, "lr": lr}

    def rollback(self, bad_positions: list[int]) -> None:
        """In-process recovery from a NaN excursion: back to the latest complete checkpoint,
        never again on the offending data, with the learning rate scaled down."""
        self.nan_rollbacks += 1
        if self.nan_rollbacks > self.cfg.train.nan_max_rollbacks:
            raise NaNExcursion(
                f"{self.nan_rollbacks - 1} in-process rollbacks did not heal the non-finite "
                f"loss/gradients at step {self.step + 1}"
            )
        self.finish_saves()  # a checkpoint still being written is the one to roll back to
        info = ckpt.latest_complete(self.run_dir)
        if self.dist.enabled:
            agreed = self.dist.all_min(info.step if info is not None else -1)
            info = ckpt.find_step(self.run_dir, agreed) if agreed >= 0 else None
        if info is None:
            raise NaNExcursion(
                f"non-finite loss/gradients at step {self.step + 1} and no complete checkpoint "
                "to roll back to"
            )
        skip = sorted(set(self.skip_positions) | set(bad_positions))
        rollbacks = self.nan_rollbacks
        scale = self.lr_scale * self.cfg.train.nan_lr_factor
        self.load(info.path)
        # What the rollback decided outlives the checkpoint it restored.
        self.skip_positions, self.nan_rollbacks, self.lr_scale = skip, rollbacks, scale
        if not self.dist.writer:
            return
        append_jsonl(
            self.run_dir / METRICS_FILE,
            {"kind": "rollback", "step": self.step, "lr_scale": scale, "time": time.time(),
             "skipped_positions": skip},
        )  # fmt: skip
        print(
            f"NaN rollback #{rollbacks}: restored step {self.step}, lr scale {scale:g}, "
            f"skipping {len(skip)} data window(s)",
            flush=True,
        )

    def eval(self) -> float | None:
        if self.val_batches is None or not self.dist.writer:
            return None
        self.set_phase("eval")
        self.model.eval()
        total = 0.0
        with torch.no_grad():
            for x, y in self.val_batches:
                x, y = x.to(self.device), y.to(self.device)
                if self.autocast_dtype is not None:
                    with torch.autocast(self.device.type, dtype=self.autocast_dtype):
                        total += self.model(x, y).item()
                else:
                    total += self.model(x, y).item()
        self.model.train()
        self.set_phase("training")
        loss = total / len(self.val_batches)
        record = {"kind": "eval", "step": self.step, "eval_loss": loss, "time": time.time()}
        append_jsonl(self.run_dir / METRICS_FILE, record)
        self._track(record)
        print(f"eval step {self.step} | val loss {loss:.4f} | ppl {math.exp(min(loss, 50)):.1f}")
        return loss

    def train(self) -> int:
        cfg, t = self.cfg, self.cfg.train
        self.model.train()
        self.set_phase("training")
        bad_streak: list[int] = []
        # Step time excludes evals and checkpoint saves (they are reported on their own).
        window_t0, window_steps, paused = time.perf_counter(), 0, 0.0
        run_t0, run_step0 = time.perf_counter(), self.step
        while self.step < t.total_steps:
            self.poll_save()  # a finished background save is reported, a failed one raised
            if self._stop_agreed():
                raise StopRequested
            out = self.train_step()
            if out.get("bad"):
                bad_streak.append(out["start_pos"])
                if self.dist.writer:
                    print(
                        f"step {self.step + 1}: non-finite loss {out['loss']} / grad norm "
                        f"{out['grad_norm']}: step skipped ({len(bad_streak)} in a row)",
                        flush=True,
                    )
                if self.dist.writer:
                    append_jsonl(
                        self.run_dir / METRICS_FILE,
                        {"kind": "nonfinite", "step": self.step + 1, "time": time.time()},
                    )
                if len(bad_streak) >= t.nan_max_consecutive:
                    self.rollback(bad_streak)
                    bad_streak = []
                self.heartbeat()
                continue
            bad_streak = []
            window_steps += 1
            self.last.update(out)
            if self.step % cfg.log.interval_steps == 0 or self.step == t.total_steps:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                elapsed = time.perf_counter() - window_t0 - paused
                self.step_time_s = elapsed / max(1, window_steps)
                tps = self.tokens_per_step / self.step_time_s
                mfu = 6 * self.n_params * tps / self.peak_flops if self.peak_flops else None
                run_rate = (time.perf_counter() - run_t0) / max(1, self.step - run_step0)
                record = {
                    "kind": "train",
                    "step": self.step,
                    "loss": out["loss"],
                    "ppl": math.exp(min(out["loss"], 50.0)),
                    "lr": out["lr"],
                    "grad_norm": out["grad_norm"],
                    "tokens_per_s": tps,
                    "mfu": mfu,
                    "tokens_seen": self.tokens_seen,
                    "time": time.time(),
                }
                self.last.update(tokens_per_s=tps, mfu=mfu)
                self.log_step(record, eta_s=run_rate * (t.total_steps - self.step))
                window_t0, window_steps, paused = time.perf_counter(), 0, 0.0
            t_aside = time.perf_counter()
            if cfg.eval.interval_steps and self.step % cfg.eval.interval_steps == 0:
                self.eval()
            if self.step % cfg.checkpoint.interval_steps == 0 or self.step == t.total_steps:
                self.save()
            paused += time.perf_counter() - t_aside
            self.heartbeat()
        self.finish_saves()  # the final checkpoint is complete on disk before "finished"
        return EXIT_OK

    def _stop_agreed(self) -> bool:
        """Every rank stops at the same step boundary: a signal seen by any rank stops all."""
        if not self.dist.enabled:
            stop = self.stop_signal is not None
        else:
            flag = torch.tensor([0 if self.stop_signal is None else 1], device=self.device)
            stop = bool(self.dist.all_sum(flag).item())
        if stop and self.dist.writer:
            why = signal.Signals(self.stop_signal).name if self.stop_signal else "another rank"
            print(f"stop requested ({why}): saving at step {self.step}", flush=True)
        return stop

    def close(self) -> None:
        if self._writer.pending_step is not None:
            # Exiting on an error with a write in flight: finish it, the state it holds is good.
            try:
                self._writer.join()
                self._report_saved(self._writer.result())
            except ckpt.CheckpointError as e:
                print(f"error: {e}", file=sys.stderr, flush=True)
        self.dist.close()
        loader = getattr(self, "loader", None)
        if loader is not None:
            loader.close()
        if self.tracker is not None:
            with contextlib.suppress(Exception):
                self.tracker.finish()


def run(
    config: str | Path,
    run_dir: str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    resume: str = "latest",
    force: bool = False,
    lr_scale: float = 1.0,
) -> int:
    """Train and return the worker's exit code (never raises for the expected failures)."""
    trainer = None
    try:
        cfg = load_config(config, overrides)
        if not (lr_scale > 0):
            raise ConfigError(f"--lr-scale must be > 0, got {lr_scale}")
        trainer = Trainer(cfg, Path(run_dir), resume=resume, force=force, lr_scale=lr_scale)
        signal.signal(signal.SIGTERM, trainer._on_signal)
        signal.signal(signal.SIGINT, trainer._on_signal)
        trainer.setup()
        if trainer.stop_signal is not None:
            raise StopRequested
        code = trainer.train()
        trainer.set_phase("finished")
        if trainer.dist.writer:
            print(f"finished: {trainer.step} steps, {trainer.tokens_seen:,} tokens", flush=True)
        return code
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    except StopRequested:
        return _stop(trainer)
    except ckpt.CheckpointError as e:
        return _save_failed(trainer, e)
    except NaNExcursion as e:
        print(f"error: NaN excursion not healed: {e}", file=sys.stderr, flush=True)
        trainer.set_phase("failed")
        return EXIT_NAN
    finally:
        if trainer is not None:
            trainer.close()


def _stop(trainer: Trainer) -> int:
    """SIGTERM/SIGINT: the write in flight completes, then the stop step is saved (unless it is
    that one) and waited for. Exit 75 only with that checkpoint complete on disk."""
    trainer.set_phase("stopping")
    try:
        trainer.finish_saves()
        if trainer.cfg.checkpoint.save_on_exit and trainer.last_checkpoint_step != trainer.step:
            trainer.save()
            trainer.finish_saves()
    except ckpt.CheckpointError as e:
        return _save_failed(trainer, e)
    trainer.set_phase("stopped")
    last = trainer.last_checkpoint_step
    saved = f"checkpoint step {last} is complete" if last is not None else "no checkpoint yet"
    print(f"stopped at step {trainer.step}; {saved}", flush=True)
    return EXIT_STOPPED


def _save_failed(trainer: Trainer | None, e: ckpt.CheckpointError) -> int:
    last = trainer.last_checkpoint_step if trainer is not None else None
    since = f"step {last}" if last is not None else "none yet, so from the start"
    print(
        f"error: {e}\nThe worker exits with code {EXIT_SAVE_FAILED} (a crash) so that the "
        f"supervisor restarts it from the latest complete checkpoint ({since}). If this "
        "repeats, fix the cause named above (disk space, permissions, the filesystem under "
        "checkpoints/).",
        file=sys.stderr,
        flush=True,
    )
    if not isinstance(e.__cause__, (OSError, ckpt.CheckpointError)):
        traceback.print_exception(e, file=sys.stderr)  # not a disk error: show where it failed
    return EXIT_SAVE_FAILED


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m runner.train", description=__doc__)
    p.add_argument("config", help="YAML recipe (e.g. configs/demo_cpu.yaml)")
    p.add_argument("--run-dir", required=True, help="run directory (created if missing)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--resume", default="latest", help="latest (default) | none | STEP")
    p.add_argument("--force", action="store_true", help="accept a changed config / restart")
    p.add_argument("--lr-scale", type=float, default=1.0, help="multiply the LR schedule")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    return run(a.config, a.run_dir, a.overrides, a.resume, a.force, a.lr_scale)


if __name__ == "__main__":
    sys.exit(main())
