"""Checkpoint write speed against the disk's raw sequential write, in one process.

    python bench/runner/bench_checkpoint_write.py --preset 434m --dir /tmp/ckwrite [--reps 3]

The state is shaped like the worker's for the preset (the model's tensors, AdamW's two moments
and step counts, in CPU memory as a snapshot leaves them; random values), so no GPU is needed:
the write path starts from host memory (the snapshot buffers, as in the worker). Alternating, so
the page cache and the disk's state favour neither:

* raw:   the same number of bytes written to one file in 16 MiB writes, one fsync: what this
         disk does at best from one writer.
* write: `write_checkpoint`, the worker's background write: model.safetensors, optim.pt and
         meta.json with their sha256, each fsync'd, the directory renamed into place.

Reports each one's MB/s and the write's share of raw. The files go to DIR and are deleted.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from m3run.model import Mamba3LM  # noqa: E402
from m3run.model.config import ModelConfig  # noqa: E402
from m3run.runner.checkpoint.snapshot import SnapshotBuffers  # noqa: E402
from m3run.runner.checkpoint.write import write_checkpoint  # noqa: E402
from m3run.runner.protocol import CHECKPOINTS_DIR  # noqa: E402

_RAW_BLOCK = 16 << 20


def states(preset: str) -> tuple[dict, dict]:
    """(model state, optim.pt state) shaped like the worker's, on CPU."""
    with torch.device("meta"):
        model = Mamba3LM(ModelConfig.preset(preset))
    gen = torch.Generator().manual_seed(0)
    shapes = {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}
    model_state = {k: torch.randn(s, generator=gen).to(dt) for k, (s, dt) in shapes.items()}
    moments = {
        i: {
            "step": torch.tensor(1000.0),
            "exp_avg": torch.randn(s, generator=gen),
            "exp_avg_sq": torch.rand(s, generator=gen),
        }
        for i, (s, _) in enumerate(shapes.values())
    }
    optimizer = {"state": moments, "param_groups": [{"params": list(moments), "lr": 1e-4}]}
    return model_state, {"optimizer": optimizer, "step": 1000, "data": {"windows_consumed": 1}}


def raw_write(path: Path, data: memoryview) -> float:
    """Seconds to write `data` to a new file at `path` and fsync it."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for i in range(0, len(data), _RAW_BLOCK):
            os.write(fd, data[i : i + _RAW_BLOCK])
        os.fsync(fd)
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - t0
    path.unlink()
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", default="434m", help="model preset: 434m, 125m or tiny")
    ap.add_argument("--dir", type=Path, required=True, help="where the files go (deleted after)")
    ap.add_argument("--reps", type=int, default=3, help="writes of each kind")
    a = ap.parse_args()
    if a.preset not in ("434m", "125m", "tiny"):
        print(f"error: --preset {a.preset!r} is unknown; use 434m, 125m or tiny", file=sys.stderr)
        return 2
    if a.reps < 1:
        print(f"error: --reps must be >= 1, got {a.reps}", file=sys.stderr)
        return 2
    run_dir = a.dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    if (run_dir / CHECKPOINTS_DIR).exists():
        print(f"error: {run_dir / CHECKPOINTS_DIR} exists; use an empty --dir", file=sys.stderr)
        return 2

    # Written from the host buffers a snapshot fills, as the worker's background write is.
    snap = SnapshotBuffers().fill(*states(a.preset))
    model_state, optim_state = snap.model, snap.optim
    probe = write_checkpoint(run_dir, 1, model_state, optim_state, {})
    n_bytes = sum(f.stat().st_size for f in probe.iterdir())
    shutil.rmtree(run_dir / CHECKPOINTS_DIR)
    data = memoryview(torch.empty(n_bytes, dtype=torch.uint8).numpy()).cast("B")
    print(
        f"preset {a.preset}: {n_bytes / 1e9:.2f} GB per checkpoint | torch {torch.__version__} | "
        f"{os.cpu_count()} CPUs | dir {run_dir}",
        flush=True,
    )
    raws, writes = [], []
    try:
        for rep in range(a.reps):
            raws.append(raw_write(run_dir / "raw.bin", data))
            t0 = time.perf_counter()
            write_checkpoint(run_dir, 2 + rep, model_state, optim_state, {})
            writes.append(time.perf_counter() - t0)
            shutil.rmtree(run_dir / CHECKPOINTS_DIR)
    finally:
        shutil.rmtree(run_dir / CHECKPOINTS_DIR, ignore_errors=True)
        (run_dir / "raw.bin").unlink(missing_ok=True)

    def mbs(seconds: list[float]) -> str:
        rates = [n_bytes / s / 1e6 for s in seconds]
        return f"{statistics.median(rates):8.0f} MB/s median ({min(rates):.0f}–{max(rates):.0f})"

    print(f"raw sequential write  {mbs(raws)}")
    print(f"write_checkpoint      {mbs(writes)}")
    ratio = statistics.median(raws) / statistics.median(writes)
    print(f"write_checkpoint at {ratio:.0%} of the raw write speed ({a.reps} of each, alternating)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
