"""The training worker: `m3run train CONFIG --run-dir DIR` / `python -m m3run.runner.train ...`.

Builds the model, the optimizer, the schedule and the data stream from a `RunConfig`, resumes
from a checkpoint when asked, trains, and leaves everything the supervisor watches in the run
directory (heartbeat.json, metrics.jsonl, checkpoints/). Exit codes are the protocol in
runner/protocol.py: 0 finished, 75 stopped after a saved checkpoint, 76 NaN excursion not healed,
78 bad config or data, anything else a crash.
"""

from __future__ import annotations

import argparse
import errno
import signal
import sys
import time
import traceback
from pathlib import Path

from m3run.runner.checkpoint import layout as ckpt
from m3run.runner.config import (
    ConfigError,
    keep_legacy_values,
    load_config,
    load_frozen_config,
)
from m3run.runner.data.manifest import DataError
from m3run.runner.files import describe_os_error
from m3run.runner.protocol import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    EXIT_CONFIG,
    EXIT_NAN,
    EXIT_OK,
    EXIT_SAVE_FAILED,
    EXIT_STOPPED,
    STANDBY_ARG,
    WorkerPhase,
)

from . import standby
from .excursions import NaNExcursion
from .preimport import import_in_background
from .trainer import StopRequested, Trainer

# Filesystem errors that no restart can heal: a full disk or quota, a read-only or forbidden
# run dir, a file past the filesystem's size limit, a planted symbolic link (ELOOP).
UNWRITABLE = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG, errno.ELOOP}
)


def run(
    config: str | Path,
    run_dir: str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    resume: str = "latest",
    force: bool = False,
    lr_scale: float = 1.0,
) -> int:
    """Train and return the worker's exit code (never raises for the expected failures)."""
    # This module's imports (torch, the model, the kernels) are done: now, or for a warm spare
    # when it was handed its arguments.
    imported = standby.activated_at() or time.time()
    trainer = None
    try:
        cfg = load_config(config, overrides)
        # dynamo and inductor, while the setup waits on the GPU and the disk
        compile_stack = import_in_background() if cfg.train.compile else None
        frozen = Path(run_dir) / CONFIG_FILE
        if frozen.is_file():  # every rank: a key the run was frozen without keeps its value
            cfg = keep_legacy_values(cfg, load_frozen_config(frozen))
        if not (lr_scale > 0):
            raise ConfigError(f"--lr-scale must be > 0, got {lr_scale}")
        trainer = Trainer(
            cfg,
            Path(run_dir),
            resume=resume,
            force=force,
            lr_scale=lr_scale,
            compile_stack=compile_stack,
        )
        trainer.startup_times["imported"] = imported
        signal.signal(signal.SIGTERM, trainer._on_signal)
        signal.signal(signal.SIGINT, trainer._on_signal)
        if trainer.stop_signal is None:  # a stop sent at a warm spare's handover
            trainer.stop_signal = standby.stop_signal()
        trainer.setup()
        if trainer.stop_signal is not None:
            raise StopRequested
        code = trainer.train()
        trainer.set_phase(WorkerPhase.FINISHED)
        if trainer.dist.writer:
            print(f"finished: {trainer.step} steps, {trainer.tokens_seen:,} tokens", flush=True)
        return code
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    except OSError as e:
        if e.errno not in UNWRITABLE:
            raise  # anything else is a crash: the supervisor restarts the worker
        print(f"error: {describe_os_error(e)}", file=sys.stderr, flush=True)
        _unwritable_note()
        return EXIT_CONFIG
    except StopRequested:
        return _stop(trainer)
    except ckpt.CheckpointError as e:
        return _save_failed(trainer, e)
    except NaNExcursion as e:
        print(f"error: NaN excursion not healed: {e}", file=sys.stderr, flush=True)
        trainer.set_phase(WorkerPhase.FAILED)
        return EXIT_NAN
    finally:
        if trainer is not None:
            trainer.close()


def _stop(trainer: Trainer) -> int:
    """SIGTERM/SIGINT: the stop step is saved (unless it is already) and waited for, a pending
    write of an older step cancelled (Checkpointer.save_for_stop). Exit 75 only with that
    checkpoint complete on disk."""
    trainer.set_phase(WorkerPhase.STOPPING)
    saves = trainer.checkpointer
    try:
        saves.save_for_stop()
    except ckpt.CheckpointError as e:
        return _save_failed(trainer, e)
    trainer.set_phase(WorkerPhase.STOPPED)
    last = saves.last_checkpoint_step
    saved = f"checkpoint step {last} is complete" if last is not None else "no checkpoint yet"
    print(f"stopped at step {trainer.step}; {saved}", flush=True)
    return EXIT_STOPPED


def _unwritable_note() -> None:
    print(
        f"The worker exits {EXIT_CONFIG}: the run dir cannot be written, and restarting into "
        "the same disk would fail the same way. Fix the cause named above, then relaunch.",
        file=sys.stderr,
        flush=True,
    )


def _save_failed(trainer: Trainer | None, e: ckpt.CheckpointError) -> int:
    if e.errno in UNWRITABLE:
        print(f"error: {e}", file=sys.stderr, flush=True)
        _unwritable_note()
        return EXIT_CONFIG
    if trainer is not None and trainer.checkpointer is not None:
        trainer.checkpointer.close()  # a later save queued behind the failed one holds good state
    last = trainer.last_checkpoint_step if trainer is not None else None
    since = f"step {last}" if last is not None else "none yet, so from the start"
    print(
        f"error: {e}\nThe worker exits with code {EXIT_SAVE_FAILED} (a crash) so that the "
        f"supervisor restarts it from the latest complete checkpoint ({since}). If this "
        "repeats, fix the cause named above (disk space, permissions, the filesystem under "
        f"{CHECKPOINTS_DIR}/).",
        file=sys.stderr,
        flush=True,
    )
    if not isinstance(e.__cause__, (OSError, ckpt.CheckpointError)):
        traceback.print_exception(e, file=sys.stderr)  # not a disk error: show where it failed
    return EXIT_SAVE_FAILED


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m m3run.runner.train", description=__doc__)
    p.add_argument("config", help="YAML recipe (e.g. configs/demo_cpu.yaml)")
    p.add_argument("--run-dir", required=True, help="run directory (created if missing)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--resume", default="latest", help="latest (default) | none | STEP")
    p.add_argument("--force", action="store_true", help="accept a changed config / restart")
    p.add_argument("--lr-scale", type=float, default=1.0, help="multiply the LR schedule")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == [STANDBY_ARG]:  # a warm spare: the arguments come later, on stdin
        argv = standby.wait_for_arguments()
        if argv is None:
            return EXIT_OK
    a = build_parser().parse_args(argv)
    return run(a.config, a.run_dir, a.overrides, a.resume, a.force, a.lr_scale)
