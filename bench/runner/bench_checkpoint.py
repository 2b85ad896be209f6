"""Training stall of a checkpoint save: background (checkpoint.async_save) vs synchronous.

    python bench/runner/bench_checkpoint.py --preset 434m --dir /tmp/ckbench [--reps 3]
    python bench/runner/bench_checkpoint.py --preset tiny --dir /tmp/ckbench     # CPU smoke

Builds the real model of the preset and a real AdamW state (one optimizer step on random tokens,
so both moments exist), then saves it the way the worker does, alternating the two modes:

* sync:  snapshot into fresh CPU tensors, write the triple (fsync'd, meta.json last, renamed into
  place), apply retention; training waits for all of it.
* async: the worker's background save: on CUDA the copy into host buffers allocated once (one
  page-locked allocation) is queued on a stream of its own and the next optimizer update waits
  for it on the GPU; the write and retention run on the background writer thread. Training
  waits only to queue the copy.

The stall is wall time from the save call until training could go on; the copy off the GPU is
reported beside it (the time until its event passes, with nothing else queued). The buffers are
allocated (and pinned) on a thread before the first save while training steps run, as the worker
does after its first step: that time, and the slowest step beside it, are reported on their
own. With --train-steps N (default 10 on CUDA), the step time is measured alone (N steps after
each async save) and while a background write is in flight: what the background write still
costs training (CPU, memory bandwidth, the GIL). The checkpoints go to DIR/checkpoints
(retention keeps the newest 2), deleted at the end unless --keep.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from m3run.model import Mamba3LM  # noqa: E402
from m3run.model.config import ModelConfig  # noqa: E402
from m3run.model.lm import param_groups  # noqa: E402
from m3run.runner.checkpoint.background import (  # noqa: E402
    BackgroundWriter,
    timed_write,
)
from m3run.runner.checkpoint.layout import apply_retention  # noqa: E402
from m3run.runner.checkpoint.snapshot import (  # noqa: E402
    Snapshot,
    SnapshotBuffers,
    leaves_of,
    snapshot,
)
from m3run.runner.checkpoint.write import write_checkpoint  # noqa: E402
from m3run.runner.protocol import CHECKPOINTS_DIR  # noqa: E402

KEEP_LAST = 2


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Setup:
    """The preset's model, a real AdamW state, and a training step on random tokens."""

    def __init__(self, preset: str, device: torch.device, micro_batch: int, seq_len: int):
        torch.manual_seed(0)
        self.device = device
        self.cfg = ModelConfig.preset(preset)
        self.model = Mamba3LM(self.cfg).to(device)
        self.n_params = self.model.num_params()
        self.optimizer = torch.optim.AdamW(
            param_groups(self.model, 0.1), lr=1e-4, fused=device.type == "cuda"
        )
        self.shape = (micro_batch, seq_len)
        self.autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16)
            if device.type == "cuda"
            else contextlib.nullcontext()
        )
        self.step = 0
        self.copied = None  # the CUDA event the next update waits for (the worker's rule)
        self.train_step()  # moments exist from here on

    def train_step(self) -> None:
        x = torch.randint(0, self.cfg.vocab_size, self.shape, device=self.device)
        y = torch.randint(0, self.cfg.vocab_size, self.shape, device=self.device)
        with self.autocast:
            loss = self.model(x, y)
        loss.backward()
        if self.copied is not None:
            torch.cuda.current_stream(self.device).wait_event(self.copied)
            self.copied = None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        _sync(self.device)

    def states(self) -> tuple[dict, dict, dict]:
        """(model state, optim.pt state, meta) shaped like the worker's."""
        rng = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        state = {
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "tokens_seen": self.step * self.shape[0] * self.shape[1],
            "lr_scale": 1.0,
            "nan_rollbacks": 0,
            "skip_positions": [],
            "data": {"windows_consumed": self.step},
            "rng": rng,
        }
        return self.model.state_dict(), state, {"bench": "bench_checkpoint.py"}


def _job(run_dir: Path, step: int, snap: Snapshot, meta: dict):
    def job(cancel=None) -> Path:
        snap.wait()
        path = write_checkpoint(run_dir, step, snap.model, snap.optim, meta, cancel=cancel)
        apply_retention(run_dir, KEEP_LAST)
        return path

    return job


def save_sync(s: Setup, run_dir: Path, step: int) -> dict:
    _sync(s.device)
    t0 = time.perf_counter()
    model_state, state, meta = s.states()
    snap = Snapshot(*snapshot(model_state, state))
    t_snap = time.perf_counter() - t0
    result = timed_write(step, _job(run_dir, step, snap, meta))
    stall = time.perf_counter() - t0
    return {
        "stall_s": stall,
        "snapshot_s": t_snap,
        "write_s": result.write_s,
        "bytes": result.bytes,
    }


def save_async(
    s: Setup,
    run_dir: Path,
    step: int,
    buffers: SnapshotBuffers,
    writer: BackgroundWriter,
    train_steps: int,
    stream,
) -> dict:
    _sync(s.device)
    t0 = time.perf_counter()
    model_state, state, meta = s.states()
    snap = buffers.fill(model_state, state, stream=stream)
    s.copied = snap.ready
    writer.submit(step, _job(run_dir, step, snap, meta))
    stall = time.perf_counter() - t0
    snap.wait()
    copy_s = time.perf_counter() - t0
    allocated = buffers.allocated_bytes
    # Train while the write is in flight (the state's buffers are no longer the live tensors).
    step_times = []
    while train_steps and writer.running():
        t = time.perf_counter()
        s.train_step()
        step_times.append(time.perf_counter() - t)
    writer.join()
    result = writer.result()
    return {
        "stall_s": stall,
        "copy_s": copy_s,
        "write_s": result.write_s,
        "bytes": result.bytes,
        "allocated_bytes": allocated,
        "steps_during_write": step_times,
    }


def _row(name: str, runs: list[dict], key: str) -> str:
    vals = [r[key] for r in runs]
    return (
        f"{name:<22} {len(vals):>4}  {statistics.mean(vals):>9.3f}  {max(vals):>9.3f}"
        if vals
        else f"{name:<22} {0:>4}  {'-':>9}  {'-':>9}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", default="434m", help="model preset: 434m (CUDA), 125m, tiny")
    ap.add_argument("--dir", type=Path, required=True, help="run dir the checkpoints go to")
    ap.add_argument("--reps", type=int, default=3, help="saves per mode after the first")
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument(
        "--train-steps",
        type=int,
        default=None,
        help="measure the step time alone over N steps and while a write runs "
        "(default 10 on CUDA, 0 on CPU)",
    )
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints written")
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args()

    if a.preset not in ("434m", "125m", "tiny"):
        print(f"error: --preset {a.preset!r} is unknown; use 434m, 125m or tiny", file=sys.stderr)
        return 2
    if a.reps < 1:
        print(f"error: --reps must be >= 1, got {a.reps}", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available()
    if a.device == "cuda" and not cuda:
        print(
            "error: --device cuda but no CUDA GPU is visible; use --device auto or cpu",
            file=sys.stderr,
        )
        return 2
    device = torch.device("cuda" if (cuda and a.device != "cpu") else "cpu")
    if a.preset != "tiny" and device.type != "cuda":
        print(
            f"skipped: --preset {a.preset} measures a CUDA training job (the stall is the "
            "device-to-host copy into pinned memory) and no CUDA GPU is in use here. Run it on a "
            "GPU machine, or run --preset tiny for a CPU smoke test of the same code path."
        )
        return 0
    train_steps = a.train_steps if a.train_steps is not None else (10 if cuda else 0)
    if device.type == "cpu":
        a.seq_len = min(a.seq_len, 256)

    run_dir = a.dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    if (run_dir / CHECKPOINTS_DIR).exists():
        print(
            f"error: {run_dir / CHECKPOINTS_DIR} already exists; point --dir at an empty "
            "or new directory (the bench writes and deletes checkpoints there)",
            file=sys.stderr,
        )
        return 2

    s = Setup(a.preset, device, a.micro_batch, a.seq_len)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"preset {a.preset} ({s.n_params / 1e6:.1f}M params) + AdamW on {where} | "
        f"torch {torch.__version__} | {os.cpu_count()} CPUs | dir {run_dir}",
        flush=True,
    )
    base_steps: list[float] = []

    def steps_alone() -> None:
        for _ in range(train_steps):
            t = time.perf_counter()
            s.train_step()
            base_steps.append(time.perf_counter() - t)

    for _ in range(3 if train_steps else 0):  # warm-up (autotuning, allocator), not timed
        s.train_step()
    buffers, writer = SnapshotBuffers(), BackgroundWriter()
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    # As the worker does after its first step: the buffers allocated (and pinned) on a thread
    # while training goes on; the steps that ran beside it say what that costs them.
    model_state, state, _ = s.states()
    leaves = leaves_of(model_state, state)
    prepared = threading.Event()
    t0 = time.perf_counter()
    prepare_s = 0.0

    def prepare() -> None:
        nonlocal prepare_s
        buffers.prepare(leaves)
        prepare_s = time.perf_counter() - t0
        prepared.set()

    threading.Thread(target=prepare, name="bench-prepare").start()
    beside_prepare: list[float] = []
    while train_steps and not prepared.is_set():
        t = time.perf_counter()
        s.train_step()
        beside_prepare.append(time.perf_counter() - t)
    prepared.wait()
    step = 0
    try:
        step += 1
        first = save_async(s, run_dir, step, buffers, writer, train_steps, stream)
        syncs, asyncs = [], []
        for _ in range(a.reps):  # alternate, so the page cache and disk state favour neither
            step += 1
            syncs.append(save_sync(s, run_dir, step))
            step += 1
            asyncs.append(save_async(s, run_dir, step, buffers, writer, train_steps, stream))
            steps_alone()  # the reference step time, interleaved with the saves
    finally:
        with contextlib.suppress(Exception):
            writer.join()
            writer.result()
        if not a.keep:
            shutil.rmtree(run_dir / CHECKPOINTS_DIR, ignore_errors=True)

    n_bytes = asyncs[-1]["bytes"]
    print(f"checkpoint size: {_gb(n_bytes)} on disk (model.safetensors + optim.pt + meta.json)")
    pinned = (
        " pinned"
        if buffers.pinned
        else (f" NOT pinned: {buffers.pin_error}" if buffers.pin_error else "")
    )
    print(
        f"host buffers: {_gb(buffers.nbytes)}{pinned}, allocated once before the first save in "
        f"{prepare_s:.3f} s (first save's stall {first['stall_s']:.3f} s, later saves "
        f"allocate {_gb(max(r['allocated_bytes'] for r in asyncs))})"
    )
    print()
    print(f"{'seconds':<22} {'reps':>4}  {'mean':>9}  {'max':>9}")
    print(_row("sync  stall", syncs, "stall_s"))
    print(_row("  of which snapshot", syncs, "snapshot_s"))
    print(_row("  of which write", syncs, "write_s"))
    print(_row("async stall", asyncs, "stall_s"))
    print(_row("async copy off the GPU", asyncs, "copy_s"))
    print(_row("async background write", asyncs, "write_s"))
    sync_stall = statistics.mean(r["stall_s"] for r in syncs)
    async_stall = statistics.mean(r["stall_s"] for r in asyncs)
    mean_write = statistics.mean(r["write_s"] for r in asyncs + syncs)
    print(
        f"\nasync saves stall training {sync_stall - async_stall:.3f} s less per checkpoint "
        f"({sync_stall / max(1e-9, async_stall):.0f}x less); disk write "
        f"{n_bytes / mean_write / 1e9:.2f} GB/s"
    )
    if base_steps and beside_prepare:
        base, busy = statistics.mean(base_steps), max(beside_prepare)
        print(
            f"steps while the buffers were allocated and pinned on a thread: "
            f"{len(beside_prepare)}, the slowest {busy * 1e3:.1f} ms against {base * 1e3:.1f} ms "
            "alone"
        )
    during = [t for r in asyncs for t in r["steps_during_write"]]
    if base_steps and during:
        base, busy = statistics.mean(base_steps), statistics.mean(during)
        print(
            f"training step ({a.micro_batch}x{a.seq_len} tokens): {base * 1e3:.1f} ms alone, "
            f"{busy * 1e3:.1f} ms while a background write runs ({(busy / base - 1) * 100:+.1f}%, "
            f"{len(during)} steps)"
        )
    if a.json:
        record = {
            "preset": a.preset,
            "device": where,
            "params": s.n_params,
            "bytes": n_bytes,
            "buffer_bytes": buffers.nbytes,
            "pinned": buffers.pinned,
            "prepare_s": prepare_s,
            "step_s_beside_prepare": beside_prepare,
            "first_async": first,
            "sync": syncs,
            "async": asyncs,
            "step_s_alone": base_steps,
        }
        a.json.write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
