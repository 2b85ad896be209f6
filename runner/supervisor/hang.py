"""Is the worker alive? Heartbeat allowances calibrated from what this run has shown, the hang
check over every local rank's heartbeat, and the VRAM watch.

The allowance a heartbeat may age before the worker counts as hung:
* starting (no heartbeat yet, or phase startup: imports, building the model, loading a
  checkpoint): ``startup_timeout_s`` until a startup has been seen in this run dir, then
  max(``min_startup_timeout_s``, ``heartbeat_safety_factor`` × the longest startup seen), so a
  worker stuck before training (a stopped process, a hung filesystem) is caught in a minute,
  not in fifteen. The longest startup is kept in state.json across relaunches;
* loading a checkpoint, compiling (the first steps under torch.compile and Triton
  autotuning): ``startup_timeout_s``, since how long they take depends on the checkpoint's
  size, the disk and warm caches, not on what earlier startups took;
* training: ``heartbeat_safety_factor`` × the longest of the reported step time, the longest
  gap observed after a training heartbeat and the heartbeat interval (or the fixed
  ``heartbeat_timeout_s``); the first step gets the startup allowance (compilation);
* checkpointing/stopping: the same factor × the reported checkpoint time plus a step;
* eval and any other phase: the factor × the longest gap observed after that phase;
* a final phase (finished/stopped/failed): the stop grace, to exit.
Never below ``min_heartbeat_timeout_s``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from m3run.runner.files import read_json
from m3run.runner.protocol import (
    FINAL_WORKER_PHASES,
    HEARTBEAT_FILE,
    RANK_HEARTBEAT_GLOB,
    Heartbeat,
    WorkerPhase,
)
from m3run.runner.supervisor.events import EventLog
from m3run.runner.supervisor.settings import SupervisorSettings

# Worker phases that precede training (None: no heartbeat yet, or a phase this supervisor does
# not know); the first two are calibrated from observed startups.
STARTING_PHASES = frozenset({None, WorkerPhase.STARTUP})
STARTUP_PHASES = STARTING_PHASES | {WorkerPhase.LOADING, WorkerPhase.COMPILING}
SAVE_PHASES = frozenset({WorkerPhase.CHECKPOINTING, WorkerPhase.STOPPING})


@dataclass(frozen=True)
class Hang:
    """A heartbeat older than its allowance."""

    reason: str
    file: str
    age_s: float
    allowance_s: float


class HangDetector:
    """Heartbeat bookkeeping for the worker being watched. The calibration (longest observed
    gap per phase) lasts the supervisor's lifetime; `new_worker` forgets the last heartbeat."""

    def __init__(
        self, run_dir: Path, settings: SupervisorSettings, longest_startup_s: float | None = None
    ):
        self.run_dir = run_dir
        self.s = settings
        self._observed: dict[WorkerPhase | None, float] = {}
        # The longest time a worker of this run dir took from its start to leaving phase
        # startup (earlier supervisors' included, through state.json).
        self.longest_startup_s = longest_startup_s
        self.last: Heartbeat | None = None
        self._spawn_wall = 0.0
        self._started = False
        self._before: dict[str, float] = {}

    def new_worker(self, spawn_wall: float) -> None:
        self._spawn_wall = spawn_wall
        self.last = None
        self._started = False
        # What the files say now was written by an earlier worker, however recently.
        self._before = {
            path.name: hb.ts
            for path in self._files()
            if (hb := Heartbeat.from_dict(read_json(path))) is not None
        }

    def _files(self) -> list[Path]:
        return [self.run_dir / HEARTBEAT_FILE, *sorted(self.run_dir.glob(RANK_HEARTBEAT_GLOB))]

    def _fresh(self, path: Path) -> Heartbeat | None:
        """The record in `path` if the current worker wrote it."""
        hb = Heartbeat.from_dict(read_json(path))
        if hb is None or hb.ts < self._spawn_wall - 1.0:
            return None
        if hb.ts <= self._before.get(path.name, float("-inf")):
            return None
        return hb

    def read(self) -> Heartbeat | None:
        """Local rank 0's heartbeat, if the current worker wrote it."""
        return self._fresh(self.run_dir / HEARTBEAT_FILE)

    def observe(self, hb: Heartbeat) -> bool:
        """Take in a heartbeat; False if it is the one seen last."""
        prev = self.last
        if prev is not None and hb.ts == prev.ts:
            return False
        if not self._started and hb.phase not in STARTING_PHASES:
            self._started = True
            took = max(0.0, hb.ts - self._spawn_wall)
            self.longest_startup_s = max(self.longest_startup_s or 0.0, took)
        if prev is not None:
            gap = hb.ts - prev.ts
            # A step right after startup/compile belongs to the startup allowance.
            if prev.phase not in STARTUP_PHASES and gap >= 0:
                self._observed[prev.phase] = max(self._observed.get(prev.phase, 0.0), gap)
        self.last = hb
        return True

    def allowance(self, hb: Heartbeat | None) -> float:
        """Seconds the current heartbeat may age before the worker counts as hung."""
        s = self.s
        phase = hb.phase if hb else None
        if phase in STARTING_PHASES and self.longest_startup_s is not None:
            calibrated = s.heartbeat_safety_factor * self.longest_startup_s
            return min(s.startup_timeout_s, max(s.min_startup_timeout_s, calibrated))
        if phase in STARTUP_PHASES:
            return s.startup_timeout_s
        if phase in FINAL_WORKER_PHASES:  # done: it only has to exit
            return max(s.stop_grace_s, s.min_heartbeat_timeout_s)
        if s.heartbeat_timeout_s is not None:
            return s.heartbeat_timeout_s
        step_time = hb.step_time_s
        observed = self._observed.get(phase)
        if phase == WorkerPhase.TRAINING:
            if step_time is None and observed is None:
                return s.startup_timeout_s  # first step: compilation and autotuning
            base = max(step_time or 0.0, observed or 0.0, s.heartbeat_interval_s)
        elif phase in SAVE_PHASES:
            ckpt = hb.checkpoint_time_s
            if ckpt is None and observed is None:
                return s.startup_timeout_s  # no save observed yet
            base = max((ckpt or 0.0) + (step_time or 0.0), observed or 0.0)
        else:  # eval and anything new: only what was observed for that phase
            if observed is None:
                return s.startup_timeout_s
            base = observed
        return max(s.min_heartbeat_timeout_s, s.heartbeat_safety_factor * base)

    def check(self, hb: Heartbeat | None, allowance: float) -> Hang | None:
        """A Hang if local rank 0's heartbeat, or any other local rank's
        (protocol.heartbeat_file), is older than its allowance."""
        now = time.time()
        beats = [(HEARTBEAT_FILE, hb, allowance)]
        for path in self._files()[1:]:
            other = self._fresh(path)
            if other is not None:
                beats.append((path.name, other, self.allowance(other)))
        for name, beat, allow in beats:
            age = now - (beat.ts if beat else self._spawn_wall)
            if age <= allow:
                continue
            phase = (beat.phase or "unknown") if beat else "no heartbeat yet"
            step = beat.step if beat else None
            where = "" if name == HEARTBEAT_FILE else f" in {name}"
            reason = (
                f"hang: no heartbeat{where} for {age:.0f}s (allowance {allow:.0f}s, "
                f"worker phase {phase}, step {step})"
            )
            return Hang(reason=reason, file=name, age_s=age, allowance_s=allow)
        return None


class VramWatch:
    """Peak VRAM of the run's workers (heartbeat and NVML per process), and one warning when
    it nears the GPU's capacity."""

    def __init__(self, settings: SupervisorSettings, log: EventLog, peak: int | None):
        self.s = settings
        self.log = log
        self.peak = peak
        self.capacity: int | None = None
        self._warned = False

    def note(self, used: int, source: str) -> None:
        if used > (self.peak or 0):
            self.peak = used
        cap = self.capacity
        if cap and not self._warned and used > self.s.vram_warn_fraction * cap:
            self._warned = True
            self.log.emit(
                "vram_warn",
                level="warning",
                used_bytes=used,
                capacity_bytes=cap,
                reason=f"worker uses {used / 2**30:.1f} GiB of {cap / 2**30:.1f} GiB "
                f"({used / cap:.0%}, over supervisor.vram_warn_fraction="
                f"{self.s.vram_warn_fraction}); an OOM is near: lower "
                "train.micro_batch_size or enable train.activation_checkpointing",
                source=source,
            )
