"""The smoke test's check 7, a checkpoint round trip (save → verify → load of the fresh model's
weights), run on a thread beside the other checks: in a scratch directory inside the run dir
under the supervisor, so it proves the filesystem the run's checkpoints go to, and timed, so the
launch knows that filesystem's write speed."""

from __future__ import annotations

import shutil
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from m3run.model import Mamba3LM
from m3run.runner.checkpoint import layout as ckpt
from m3run.runner.checkpoint.io import load_checkpoint
from m3run.runner.checkpoint.snapshot import snapshot
from m3run.runner.checkpoint.write import write_checkpoint


class RoundTripFailed(Exception):
    """The round trip could not write, read or remove a checkpoint, or changed a tensor."""


SCRATCH_PREFIX = ".smoke-checkpoint-"


def start_round_trip(model: Mamba3LM, scratch: Path | None) -> Future[tuple[str, float | None]]:
    """Check 7's work on a thread: save → verify → load of the model's state, copied to the CPU
    here (the copy is complete when this returns, so the checks after it may use the model as
    they like), in a scratch directory under ``scratch``. The thread's verdict and the write
    speed it saw (bytes per second), or the error it raised, are the future's."""
    try:
        state = snapshot(model.state_dict(), {})[0]
    except Exception as e:  # a state that cannot be saved fails check 7, not check 3
        failed: Future[tuple[str, float | None]] = Future()
        failed.set_exception(e)
        return failed
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="m3run-smoke-checkpoint")
    try:
        return pool.submit(_round_trip, state, scratch)
    finally:
        pool.shutdown(wait=False)  # the thread finishes its one job, then ends


def _round_trip(state: dict[str, torch.Tensor], scratch: Path | None) -> tuple[str, float | None]:
    where = scratch if scratch is not None else Path(tempfile.gettempdir())
    try:
        return _round_trip_in(state, scratch)
    except OSError as e:
        raise RoundTripFailed(
            f"cannot write, read or remove a checkpoint under {where}: {e}. Check write "
            "permission and free space there"
            + (" (the run's checkpoints go to the same filesystem)" if scratch else "")
        ) from e


def _round_trip_in(
    state: dict[str, torch.Tensor], scratch: Path | None
) -> tuple[str, float | None]:
    t0 = time.perf_counter()
    if scratch is not None:  # what a smoke test killed mid-write left (the run dir is locked)
        for stale in Path(scratch).glob(SCRATCH_PREFIX + "*"):
            shutil.rmtree(stale, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix=SCRATCH_PREFIX, dir=scratch) as tmp:
        t_write = time.perf_counter()
        path = write_checkpoint(tmp, 0, state, {"step": 0}, {"smoke": True})
        # The run dir's write speed, an estimate: the data files' bytes over the whole call
        # (write, hash, fsync), taken beside check 3's compile, which competes for the CPU.
        write_s = time.perf_counter() - t_write
        data_bytes = sum((path / name).stat().st_size for name in ckpt.DATA_FILES)
        ok, reason = ckpt.verify_checkpoint(path)
        if not ok:
            raise RoundTripFailed(f"a checkpoint just written does not verify: {reason}")
        loaded, _, _ = load_checkpoint(path)
        diff = [k for k in state if not torch.equal(loaded[k], state[k])]
        if diff:
            raise RoundTripFailed(f"tensors changed in the round trip: {diff[:3]}")
        size = sum(f.stat().st_size for f in path.iterdir())
    speed = float(round(data_bytes / write_s)) if write_s > 0 else None  # finer is noise
    written = f", written at {speed / 1e6:,.0f} MB/s" if speed else ""
    message = (
        f"save → verify → load of {len(state)} tensors ({size / 2**20:.1f} MiB) is exact "
        f"({time.perf_counter() - t0:.1f} s, beside checks 3–6{written})"
    )
    return message, speed
