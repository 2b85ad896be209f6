"""Where a run with a checkpoint mirror resumes, decided at each (re)start of the supervisor
before the first worker, and what the mirror's uploader may then change there.

* `--resume latest`: the newest complete checkpoint wins, wherever it lives. The run dir's
  newest checkpoints down to the mirror's newest are hashed; when the mirror's is newer than
  every one that verifies, it is restored (verified against its sha256 digests) and the run
  resumes from it. A mirrored checkpoint whose bytes do not match its meta.json is not
  complete: it is skipped for the next older, with an event. One that is newer but cannot be
  downloaded (a transport error after retries, a run dir that cannot be written) ends the launch
  with exit 78, naming both steps and the fix: a run never silently resumes from an older
  checkpoint than the mirror holds.
* `--resume STEP`: a step the run dir lacks is restored from the mirror when it is there.
* `--resume none`, or a STEP older than the mirror's newest: the run starts another history.
  The mirror's steps above where it starts are kept as they are; an event names them.

What the mirror holds is never lost to a replayed step (a rewind, a NaN rollback, a run on
another disk): the uploader never replaces a complete mirrored checkpoint with a different one
of the same step; it keeps the mirror's, leaves the run dir's save out and says so in a
`mirror_conflict` event (`MirrorConflict`). Only a mirrored step found corrupt here (its bytes
do not match its meta.json) may be replaced. Retention never deletes a mirrored step above the
one the run resumed from unless the run has since uploaded that step itself. Torch-free.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from m3run.runner.checkpoint.layout import META_FILE, CheckpointInfo, verify_checkpoint
from m3run.runner.files import describe_os_error, sha256_file
from m3run.runner.supervisor.mirror import (
    CorruptRemote,
    Identity,
    Mirror,
    MirrorError,
    RemoteCheckpoint,
    identity,
    local_complete,
)
from m3run.runner.supervisor.mirror_probe import cause, fix_for, retrying

Emit = Callable[..., None]  # EventLog.emit: (event, reason=..., level=..., **fields)


@dataclass
class Reconciled:
    """The outcome: what was restored and what the uploader may change in the mirror."""

    restored: int | None = None  # the step restored from the mirror
    resumed_from: int = -1  # the step the run resumes from; -1 from scratch
    # step -> the mirrored checkpoint there that the uploader may replace: found corrupt
    replaceable: dict[int, Identity] = field(default_factory=dict)
    others: set[int] = field(default_factory=set)  # mirrored steps retention must keep
    # The run dir's checkpoints above where the run resumes, as they are at start (step -> sha256
    # of meta.json): another trajectory's, never uploaded; a new save of the step is.
    stale: dict[int, str] = field(default_factory=dict)


def reconcile(
    mirror: Mirror,
    run_dir: Path,
    resume: str,
    remote: list[RemoteCheckpoint],
    emit: Emit,
    attempts: int = 3,
    backoff_s: float = 1.0,
) -> Reconciled:
    """Compare the run dir's checkpoints with `remote` (the mirror's listing), restore what must
    be restored, record what was done as events. MirrorError (exit 78) when a checkpoint the
    run must resume from cannot be restored."""
    run_dir.mkdir(parents=True, exist_ok=True)
    local = {i.step: i for i in local_complete(run_dir)}
    complete = [c for c in remote if c.complete and c.meta is not None]
    out = Reconciled()

    def restore(c: RemoteCheckpoint, why: str, instead: str) -> bool:
        """Download `c`; False when it is corrupt (reported), MirrorError when it cannot be."""
        try:
            retrying(lambda: mirror.download(c, run_dir), attempts, backoff_s)
        except CorruptRemote as e:
            out.replaceable[c.step] = identity(c.meta)  # not a checkpoint: a save may replace it
            emit(
                "mirror_skip",
                level="warning",
                step=c.step,
                url=mirror.url,
                reason=f"the mirror's step {c.step} does not match its meta.json ({e}): it is "
                "not a complete checkpoint and is not resumed from",
            )
            return False
        except Exception as e:
            raise MirrorError(
                f"{why}, but it could not be restored: {_cause_and_fix(mirror, run_dir, e)}; "
                f"or {instead}"
            ) from e
        out.restored = c.step
        return True

    if resume == "latest":
        newest = complete[-1].step if complete else None
        mine = _newest_local(local, newest)
        if mine is not None:
            newer_than = f"the run dir's newest complete checkpoint (step {mine})"
            instead = (
                f"resume from the run dir's step {mine} with --resume {mine} (the mirror's "
                "newer checkpoints are kept)"
            )
        else:
            newer_than = "anything in the run dir (it has no complete checkpoint)"
            instead = "start over with --resume none (the mirror's checkpoints are kept)"
        for c in reversed(complete):
            if mine is not None and c.step <= mine:
                break
            why = f"the mirror's step {c.step} ({mirror.url}) is newer than {newer_than}"
            if restore(c, why, instead):
                emit(
                    "mirror_restore",
                    step=c.step,
                    local_step=mine,
                    url=mirror.url,
                    reason=(
                        f"the mirror's step {c.step} is newer than the run dir's newest complete "
                        f"checkpoint (step {mine}): restored it from {mirror.url}; the run "
                        f"resumes from step {c.step}"
                        if mine is not None
                        else f"the run dir had no complete checkpoint; restored step {c.step} "
                        f"from {mirror.url}"
                    ),
                )
                break
        out.resumed_from = out.restored if out.restored is not None else _or(mine)
    elif resume.isdigit():
        step = int(resume)
        wanted = [c for c in complete if c.step == step]
        if step not in local and not wanted:
            raise MirrorError(
                f"--resume {step}: neither {run_dir} nor the mirror {mirror.url} holds a "
                f"complete checkpoint at step {step} (fix: --resume latest, or a step that "
                "`m3run checkpoints` lists)"
            )
        if step not in local and wanted:
            why = f"--resume {step} names a checkpoint only the mirror ({mirror.url}) holds"
            if restore(wanted[0], why, "resume from another step"):
                emit(
                    "mirror_restore",
                    step=step,
                    local_step=None,
                    url=mirror.url,
                    reason=f"--resume {step} names a checkpoint the run dir lacks: restored it "
                    f"from {mirror.url}",
                )
        out.resumed_from = step

    for step, info in local.items():
        if step > out.resumed_from:
            with contextlib.suppress(OSError):
                out.stale[step] = sha256_file(info.path / META_FILE)
    above = [c for c in remote if c.step > out.resumed_from]
    out.others = {c.step for c in above}
    theirs = [c.step for c in above if c.complete and c.step not in out.replaceable]
    if theirs and resume != "latest":
        start = f"step {out.resumed_from}" if out.resumed_from >= 0 else "scratch"
        emit(
            "mirror_diverged",
            level="warning",
            steps=theirs,
            url=mirror.url,
            reason=f"the mirror holds checkpoints newer than where this run starts ({start}): "
            f"steps {', '.join(map(str, theirs))}. They are kept: this run never overwrites "
            "nor prunes them, and a later launch with --resume latest resumes from the newest "
            "complete checkpoint, theirs until this run saves a newer one. To keep this "
            "history apart, give it its own checkpoint.mirror_url (--force)",
        )
    return out


def _newest_local(local: dict[int, CheckpointInfo], floor: int | None) -> int | None:
    """The run dir's newest complete checkpoint, as far as the comparison needs it: those at or
    above the mirror's newest (`floor`) are hashed (a corrupt one must not outrank the mirror),
    the first one below it is not (the mirror's wins over it anyway)."""
    for step in sorted(local, reverse=True):
        if floor is None or step < floor:
            return step
        ok, _ = verify_checkpoint(local[step].path, full=True, record_verified=True)
        if ok:
            return step
    return None


def _or(step: int | None) -> int:
    return -1 if step is None else step


def _cause_and_fix(mirror: Mirror, run_dir: Path, e: BaseException) -> str:
    filename = getattr(e, "filename", None)
    if isinstance(e, OSError) and filename and str(filename).startswith(str(run_dir)):
        return describe_os_error(e)  # the run dir's side: a full disk, a read-only mount
    return f"{cause(e)} (fix: {fix_for(mirror, e)}, then relaunch)"
