"""What the worker tells the outside while it trains: heartbeat.json (the supervisor's hang
detection and `m3run status`), the metrics.jsonl records, the console step line (a StepRecord
under a json console), the optional experiment tracker (runner.tracking: wandb or TensorBoard)
and the MFU estimate."""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from m3run.runner.config import ConfigError, RunConfig
from m3run.runner.files import append_jsonl, atomic_write_json
from m3run.runner.formatting import format_duration
from m3run.runner.protocol import (
    LOG_FORMAT_ENV,
    METRICS_FILE,
    EvalRecord,
    Heartbeat,
    LogFormat,
    StepRecord,
    WorkerPhase,
    heartbeat_file,
    worker_record_line,
)
from m3run.runner.tracking import (
    TENSORBOARD_DIR,
    resolve_tracker,
    tracker_problem,
    tracker_values,
    why_chosen,
)

from .dist import Dist

# Dense bf16 tensor-core peaks (FLOP/s) by device name, for MFU when no measured peak is given.
PEAK_FLOPS_ENV = "M3RUN_PEAK_FLOPS"
_BF16_PEAK = {"A100": 312e12, "H100": 989e12, "H200": 989e12, "H20": 148e12, "L40S": 362e12}


class Pace:
    """Recent wall time per step, evals and saves included, for the ETA. The first logged
    window (compilation, autotuning, a cold page cache) is dropped once a later one exists, and
    only the last few windows count: an ETA from the mean since the start would read 13 h at
    step 5 of a 20-minute run."""

    WINDOWS = 8

    def __init__(self) -> None:
        self._windows: collections.deque[tuple[float, int]] = collections.deque(
            maxlen=self.WINDOWS + 1
        )

    def add(self, wall_s: float, steps: int) -> None:
        if steps > 0:
            self._windows.append((wall_s, steps))

    def eta_s(self, steps_left: int) -> float:
        windows = list(self._windows)
        if len(windows) > 1:
            windows = windows[1:]
        wall = sum(w for w, _ in windows)
        steps = sum(n for _, n in windows)
        return wall / steps * steps_left if steps else float("nan")


def peak_flops(device: torch.device) -> float | None:
    """The MFU denominator, recorded beside every MFU as `mfu_peak_flops`: M3RUN_PEAK_FLOPS
    (e.g. a measured matmul peak), else the GPU's nominal dense bf16 peak from the table above;
    None on CPU or unknown GPUs. bench/ reports MFU against the measured peak, so set
    M3RUN_PEAK_FLOPS to that value to compare the two."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    nominal = next((peak for key, peak in _BF16_PEAK.items() if key in name), None)
    text = os.environ.get(PEAK_FLOPS_ENV)
    if not text:
        return nominal
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if math.isfinite(value) and value > 0:
        return value
    # A bad value would crash the worker (non-numeric) or make every MFU negative or infinite;
    # the nominal peak keeps MFU meaningful, and the warning says it was not the asked one.
    instead = f"the nominal bf16 peak of {name} ({nominal:.3g})" if nominal else "no MFU"
    print(
        f"warning: {PEAK_FLOPS_ENV}={text!r} is not a positive number of FLOP/s; using "
        f"{instead} instead (fix: e.g. {PEAK_FLOPS_ENV}=7.5e14, or unset it)",
        flush=True,
    )
    return nominal


@dataclass(frozen=True)
class SaveStatus:
    """The heartbeat's checkpoint fields, as the Checkpointer last knew them."""

    last_checkpoint_step: int | None  # complete on disk
    checkpoint_time_s: float | None  # training stall of the latest save
    checkpoint_write_s: float | None  # write time of the latest complete save
    in_flight_step: int | None  # a background write not yet collected


_NO_SAVES = SaveStatus(None, None, None, None)  # before the trainer built its Checkpointer


def _fmt_tokens(n: float) -> str:
    return f"{n / 1e3:.1f}k" if n < 1e6 else f"{n / 1e6:.2f}M"


class Telemetry:
    """The worker's reports. `current_step()` reads the trainer's optimizer step; `saves`, set
    once the trainer has built its Checkpointer, supplies the heartbeat's checkpoint fields
    (none before that). Every rank
    heartbeats (rank 0 into heartbeat.json, the others beside it); only writer ranks append to
    metrics.jsonl, print step lines and log to the tracker."""

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path,
        dist: Dist,
        device: torch.device,
        current_step: Callable[[], int],
    ):
        self.cfg = cfg
        self.run_dir = run_dir
        self.dist = dist
        self.device = device
        self.current_step = current_step
        self.saves: Callable[[], SaveStatus] | None = None
        self.phase = WorkerPhase.STARTUP
        self.last: dict = {}  # the latest good step: loss, grad_norm, lr, tokens_per_s, mfu
        self.step_time_s: float | None = None
        self.peak_flops = peak_flops(device)
        self.tracker = None
        self._last_heartbeat = 0.0
        # Under a supervisor whose console is json, steps and evals are printed as records.
        self.json_lines = os.environ.get(LOG_FORMAT_ENV) == LogFormat.JSON

    # ---- heartbeat ----

    def set_phase(self, phase: WorkerPhase) -> None:
        self.phase = phase
        self.heartbeat(force=True)

    def heartbeat(self, force: bool = False) -> None:
        """Rewrite this rank's heartbeat file, at most every log.heartbeat_interval_s unless
        forced."""
        now = time.time()
        if not force and now - self._last_heartbeat < self.cfg.log.heartbeat_interval_s:
            return
        self._last_heartbeat = now
        vram = None
        if self.device.type == "cuda":
            vram = torch.cuda.max_memory_allocated(self.device)
        saves = self.saves() if self.saves is not None else _NO_SAVES
        beat = Heartbeat(
            ts=now,
            phase=self.phase,
            pid=os.getpid(),
            step=self.current_step(),
            total_steps=self.cfg.train.total_steps,
            loss=self.last.get("loss"),
            lr=self.last.get("lr"),
            grad_norm=self.last.get("grad_norm"),
            tokens_per_s=self.last.get("tokens_per_s"),
            mfu=self.last.get("mfu"),
            mfu_peak_flops=self.peak_flops,
            vram_bytes=vram,
            step_time_s=self.step_time_s,
            checkpoint_time_s=saves.checkpoint_time_s,
            checkpoint_write_s=saves.checkpoint_write_s,
            checkpoint_in_flight_step=saves.in_flight_step,
            last_checkpoint_step=saves.last_checkpoint_step,
        )
        atomic_write_json(self.run_dir / heartbeat_file(self.dist.local_rank), beat.to_dict())

    # ---- metrics.jsonl and the console ----

    def record(self, record: dict) -> None:
        """Append one record to metrics.jsonl (callers decide which ranks write)."""
        append_jsonl(self.run_dir / METRICS_FILE, record)

    def log_train(
        self,
        step: int,
        out: dict,
        *,
        step_time_s: float,
        tokens_per_step: int,
        tokens_seen: int,
        n_params: int,
        eta_s: float,
        tokens_by_source: dict[str, int] | None = None,
    ) -> None:
        """A logged training step: its record (metrics.jsonl, tracker) and its console line.
        `step_time_s` is the mean over the steps since the last logged one, evals and saves
        excluded. `tokens_by_source`: a data mix's target tokens drawn per source so far."""
        self.step_time_s = step_time_s
        tps = tokens_per_step / step_time_s
        # Training FLOPs ≈ 6 × parameters per token (Kaplan et al. 2020), over the device peak.
        mfu = 6 * n_params * tps / self.peak_flops if self.peak_flops else None
        record = {
            "kind": "train",
            "step": step,
            "loss": out["loss"],
            "ppl": math.exp(min(out["loss"], 50.0)),
            "lr": out["lr"],
            "grad_norm": out["grad_norm"],
            "tokens_per_s": tps,
            "mfu": mfu,
            "mfu_peak_flops": self.peak_flops,
            "tokens_seen": tokens_seen,
            "time": time.time(),
        }
        if tokens_by_source is not None:
            record["tokens_by_source"] = tokens_by_source
        self.last.update(tokens_per_s=tps, mfu=mfu)
        if not self.dist.writer:
            return
        vram = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        self.record(record)
        self.track({**record, "step_time_s": step_time_s, "vram_bytes": vram})
        if self.json_lines:
            line = StepRecord(
                time=record["time"],
                step=step,
                total_steps=self.cfg.train.total_steps,
                loss=record["loss"],
                ppl=record["ppl"],
                lr=record["lr"],
                grad_norm=record["grad_norm"],
                tokens_per_s=tps,
                tokens_seen=tokens_seen,
                mfu=mfu,
                vram_bytes=vram,
                eta_s=eta_s,
                tokens_by_source=tokens_by_source,
            )
            print(worker_record_line(line), flush=True)
            return
        mem = f" | mem {vram / 2**30:.1f}GB" if vram is not None else ""
        mfu_text = f" | mfu {record['mfu'] * 100:.1f}%" if record["mfu"] is not None else ""
        print(
            f"step {record['step']}/{self.cfg.train.total_steps} | loss {record['loss']:.4f} "
            f"| ppl {record['ppl']:.1f} | lr {record['lr']:.2e} | gnorm {record['grad_norm']:.3f} "
            f"| {_fmt_tokens(record['tokens_per_s'])} tok/s{mfu_text}{mem} "
            f"| eta {format_duration(eta_s)}",
            flush=True,
        )

    def log_eval(self, step: int, loss: float) -> None:
        record = {"kind": "eval", "step": step, "eval_loss": loss, "time": time.time()}
        ppl = math.exp(min(loss, 50))
        self.record(record)
        self.track({**record, "ppl": ppl})
        if self.json_lines:
            line = EvalRecord(time=record["time"], step=step, eval_loss=loss, ppl=ppl)
            print(worker_record_line(line), flush=True)
            return
        print(f"eval step {step} | val loss {loss:.4f} | ppl {ppl:.1f}")

    # ---- the experiment tracker ----

    def start_tracker(self, resumed: bool) -> None:
        """Start the experiment tracker runner.tracking chooses (writer ranks only). A failure
        is a ConfigError at the first launch (the user asked for tracking) and a warning on
        resume (a tracker must never kill a run)."""
        kind = resolve_tracker(self.cfg.log.tracker)
        if kind == "none" or not self.dist.writer:
            return
        try:
            problem = tracker_problem(self.cfg.log.tracker, check_login=False)
            if problem is not None:
                raise RuntimeError(problem)
            self.tracker = _start(kind, self.cfg, self.run_dir)
        except Exception as e:
            if not resumed:
                raise ConfigError(
                    f"{why_chosen(self.cfg.log.tracker)}, but the experiment tracker ({kind}) "
                    f"failed to start: {type(e).__name__}: {e}. Fix: install and log in to it, "
                    "or set log.tracker: none (and unset WANDB_PROJECT)"
                ) from e
            print(f"warning: experiment tracker unavailable on resume ({e}); training goes on")
            self.tracker = None

    def track(self, record: dict) -> None:
        """Log a metrics record's numbers to the tracker, under their grouped tags."""
        if self.tracker is None:
            return
        try:
            self.tracker.log(tracker_values(record), self.current_step())
        except Exception as e:  # a tracker outage must never kill a running job
            print(f"warning: experiment tracker failed ({e}); disabling it for this process")
            self.tracker = None

    def close(self) -> None:
        if self.tracker is not None:
            with contextlib.suppress(Exception):
                self.tracker.close()


class _Wandb:
    """wandb, keyed on the run dir: a relaunch of the same run dir continues the same wandb run
    (two run dirs with one config are two runs)."""

    def __init__(self, cfg: RunConfig, run_dir: Path):
        import wandb

        key = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:12]
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "m3run",
            name=run_dir.name,
            dir=str(run_dir),
            config=cfg.model_dump(mode="json"),
            resume="allow",
            id=f"m3run-{key}",
        )

    def log(self, values: dict, step: int) -> None:
        self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()


class _TensorBoard:
    """TensorBoard event files in RUN_DIR/tensorboard/, one scalar per metric, and the frozen
    config as the run's hyperparameters (the HPARAMS tab), written once per run: by the first
    writer of the directory, not again by a resumed worker."""

    def __init__(self, cfg: RunConfig, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        log_dir = run_dir / TENSORBOARD_DIR
        first = not any(log_dir.glob("events.out.tfevents.*"))
        self._writer = SummaryWriter(log_dir=str(log_dir))
        if first:
            self._record_hparams(cfg)

    def _record_hparams(self, cfg: RunConfig) -> None:
        from torch.utils.tensorboard.summary import hparams

        # The plugin takes numbers, strings and booleans; a list (data.sources) goes as text.
        values = {
            k: v if v is None or isinstance(v, (bool, int, float, str)) else json.dumps(v)
            for k, v in cfg.flat().items()
        }
        # The metrics the HPARAMS tab compares runs by; their values are the scalars logged.
        experiment, session_start, _ = hparams(values, {"train/loss": 0.0, "eval/loss": 0.0})
        writer = self._writer.file_writer
        writer.add_summary(experiment)
        writer.add_summary(session_start)
        self._writer.flush()

    def log(self, values: dict, step: int) -> None:
        for key, value in values.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _start(kind: str, cfg: RunConfig, run_dir: Path) -> _Wandb | _TensorBoard:
    return {"wandb": _Wandb, "tensorboard": _TensorBoard}[kind](cfg, run_dir)
