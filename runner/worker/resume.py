"""Where a worker starts from: `--resume latest` (the newest checkpoint that verifies and loads),
`--resume STEP`, or `--resume none` (from scratch).

A run dir that holds checkpoints is never silently trained from step 0: when none of them can
be used (every meta.json broken, a flipped byte in the only one), the worker exits 78 naming
each one and why, and touches none of them; starting over is `--resume none --force`, which
moves the old checkpoints aside. A checkpoint whose digests match but whose contents cannot be
loaded is marked unusable (runner.checkpoint.layout.UNUSABLE_FILE) and the one before it is
used. A checkpoint whose tensors do not fit this config's model is exit 78 naming them.
Every start is recorded in metrics.jsonl: `resume` (from a checkpoint) or `start` (step 0),
so a reader can tell a replay of steps from a jump.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from m3run.runner.checkpoint import layout as ckpt
from m3run.runner.config import ConfigError
from m3run.runner.protocol import CHECKPOINTS_DIR, WorkerPhase

from .checkpointing import Checkpointer
from .dist import Dist
from .restore import UnloadableCheckpoint
from .telemetry import Telemetry


class Resume:
    """Chooses the checkpoint and loads it through the checkpointer."""

    def __init__(
        self,
        run_dir: Path,
        resume: str,
        force: bool,
        dist: Dist,
        checkpointer: Checkpointer,
        telemetry: Telemetry,
    ):
        self.run_dir = run_dir
        self.resume = resume
        self.force = force
        self.dist = dist
        self.checkpointer = checkpointer
        self.telemetry = telemetry

    def run(self) -> int | None:
        """Load the chosen checkpoint; its step, or None for a start from scratch."""
        infos = ckpt.list_checkpoints(self.run_dir, verify=False)
        if self.resume == "none":
            self._start_over(infos)
            info = None
        elif self.resume == "latest":
            info = self._latest(infos)
        else:
            info = self._step()
        step = self.checkpointer.counters.state_dict()["step"] if info is not None else None
        if self.dist.writer:
            kind = "resume" if info is not None else "start"
            if info is not None:
                print(f"resumed from {info.path} (step {step})", flush=True)
            self.telemetry.record(
                {"kind": kind, "step": step or 0, "time": time.time(), "pid": os.getpid()}
            )
        return step

    def _start_over(self, infos: list[ckpt.CheckpointInfo]) -> None:
        if infos and not self.force:
            raise ConfigError(
                f"--resume none but {self.run_dir / CHECKPOINTS_DIR} already holds "
                f"{len(infos)} checkpoint(s). Fix: use --resume latest to continue, "
                "or --force to start over (the old checkpoints are moved aside, not deleted)."
            )
        if infos and self.dist.writer:
            aside = self.run_dir / f"{CHECKPOINTS_DIR}.old-{int(time.time())}"
            os.replace(self.run_dir / CHECKPOINTS_DIR, aside)
            print(f"--resume none --force: previous checkpoints moved to {aside}")
        self.dist.barrier()

    def _load(self, info: ckpt.CheckpointInfo) -> None:
        self.telemetry.set_phase(WorkerPhase.LOADING)
        try:
            self.checkpointer.load(info.path)
        finally:
            self.telemetry.set_phase(WorkerPhase.STARTUP)

    def _latest(self, infos: list[ckpt.CheckpointInfo]) -> ckpt.CheckpointInfo | None:
        if self.dist.enabled:
            # Every host resumes from the same step: the newest one all of them hold.
            info = ckpt.latest_complete(self.run_dir, trust_verified=True)
            agreed = self.dist.all_min(info.step if info is not None else -1)
            info = (
                ckpt.find_step(self.run_dir, agreed, trust_verified=True) if agreed >= 0 else None
            )
            if info is None:
                self._refuse_scratch(infos, [])
                return None
            self._load(info)
            return info
        unusable: list[tuple[ckpt.CheckpointInfo, str]] = []
        for info in reversed(infos):
            ok, reason = (
                ckpt.verify_checkpoint(
                    info.path, full=True, trust_verified=True, record_verified=True
                )
                if info.complete
                else (
                    False,
                    info.reason,
                )
            )
            if not ok:
                unusable.append((info, reason or "incomplete"))
                continue
            try:
                self._load(info)
            except UnloadableCheckpoint as e:
                self._mark(info, str(e))
                unusable.append((info, f"cannot be loaded: {e}"))
                continue
            if unusable:
                print(
                    f"note: resuming from step {info.step}; newer checkpoint(s) unusable: "
                    + "; ".join(f"step {i.step}: {why}" for i, why in unusable),
                    flush=True,
                )
            return info
        self._refuse_scratch(infos, unusable)
        return None

    def _mark(self, info: ckpt.CheckpointInfo, reason: str) -> None:
        print(f"warning: checkpoint {info.path} is unusable ({reason}); marking it", flush=True)
        if self.dist.writer:
            ckpt.mark_unusable(info.path, reason)
            self.telemetry.record(
                {
                    "kind": "checkpoint_unusable",
                    "step": info.step,
                    "reason": reason,
                    "time": time.time(),
                }
            )

    def _refuse_scratch(
        self, infos: list[ckpt.CheckpointInfo], unusable: list[tuple[ckpt.CheckpointInfo, str]]
    ) -> None:
        """Nothing to resume from: fine in an empty run dir, exit 78 where checkpoints exist."""
        if not infos:
            return
        why = unusable or [(i, i.reason or "incomplete") for i in infos]
        listed = "; ".join(f"{i.path.name}: {reason}" for i, reason in why)
        raise ConfigError(
            f"--resume latest: {self.run_dir / CHECKPOINTS_DIR} holds {len(infos)} "
            f"checkpoint(s) but none is usable ({listed}). Nothing was changed. Fix: restore a "
            "good checkpoint (e.g. from the mirror), resume an explicit one with --resume STEP, "
            "or start over with --resume none --force (moves them aside)"
        )

    def _step(self) -> ckpt.CheckpointInfo:
        resume = self.resume
        if not (resume.isascii() and resume.isdigit()):
            raise ConfigError(f"--resume must be latest, none or a step number, got {resume!r}")
        try:
            info = ckpt.find_step(self.run_dir, int(resume), trust_verified=True)
        except ckpt.CheckpointError as e:
            raise ConfigError(str(e)) from e
        try:
            self._load(info)
        except UnloadableCheckpoint as e:
            raise ConfigError(
                f"--resume {resume}: checkpoint {info.path} cannot be loaded: {e}"
            ) from e
        return info
