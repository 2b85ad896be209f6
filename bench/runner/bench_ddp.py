"""Data-parallel scaling of the real worker: 1 process vs N processes under torchrun.

    python bench/runner/bench_ddp.py --nproc 2 [--preset 434m] [--steps 8] [--compile]

Runs `python -m m3run.runner.train` (1 process) and `torchrun --nproc-per-node N -m
m3run.runner.train` with the same global batch (accumulation adjusts), reads tokens/s from each
run's metrics.jsonl (the mean of the records after the warm-up steps) and prints tokens/s per GPU
and the scaling efficiency. On a CPU machine it uses gloo and the tiny preset (a smoke run of the
script, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run(nproc: int, run_dir: Path, overrides: list[str], env: dict) -> tuple[float, float]:
    """Returns (mean tokens/s after warm-up, wall seconds)."""
    if nproc == 1:
        cmd = [sys.executable, "-m", "m3run.runner.train"]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--max-restarts",
            "0",
            "-m",
            "m3run.runner.train",
        ]
    cmd += [str(REPO / "configs" / "pretrain_a100_434m.yaml"), "--run-dir", str(run_dir)]
    for o in overrides:
        cmd += ["--set", o]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise SystemExit(f"{nproc}-process run failed with exit {proc.returncode}")
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r.get("kind") == "train"]
    timed = train[len(train) // 2 :]  # the second half: compilation and warm-up excluded
    return sum(r["tokens_per_s"] for r in timed) / len(timed), wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument(
        "--preset", default=None, help="model preset (default: 434m on GPU, tiny on CPU)"
    )
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=None)
    ap.add_argument("--compile", action="store_true")
    a = ap.parse_args()
    import torch

    from m3run.runner.data.prepare import prepare_data

    gpu = torch.cuda.is_available() and torch.cuda.device_count() >= a.nproc
    preset = a.preset or ("434m" if gpu else "tiny")
    micro = a.micro_batch or (16 if gpu else 4)
    work = Path(tempfile.mkdtemp(prefix="bench-ddp-"))
    data = work / "data"
    vocab = 8192 if gpu else 512
    max_bytes = 6_000_000 if gpu else 400_000
    prepare_data(
        ["stdlib"],
        data,
        tokenizer=f"bpe:{vocab}",
        max_bytes=max_bytes,
        val_fraction=0.01,
        progress=False,
    )
    overrides = [
        f"model.preset={preset}",
        f"train.total_steps={a.steps}",
        "train.warmup_steps=2",
        f"train.micro_batch_size={micro}",
        f"train.grad_accum_steps={a.nproc}",
        f"train.compile={'true' if a.compile else 'false'}",
        "eval.interval_steps=0",
        f"checkpoint.interval_steps={a.steps}",
        "log.interval_steps=1",
        f"data.train_path={data / 'train'}",
        f"data.val_path={data / 'val'}",
        f"train.device={'cuda' if gpu else 'cpu'}",
        f"train.precision={'bf16' if gpu else 'fp32'}",
    ]
    if not gpu:
        overrides += ["data.seq_len=64", "model.vocab_size=512"]
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
    }
    if not gpu:
        env["OMP_NUM_THREADS"] = "1"
    one, wall1 = run(1, work / "one", overrides, env)
    many, wall_n = run(a.nproc, work / "many", overrides, env)
    eff = many / (a.nproc * one)
    what = torch.cuda.get_device_name(0) if gpu else "CPU (gloo smoke run)"
    print(
        f"{preset} on {what} | torch {torch.__version__} | global batch "
        f"{micro * a.nproc} seq | compile {a.compile}"
    )
    print(f"1 process : {one / 1e3:8.1f}k tok/s                 (wall {wall1:.0f}s)")
    print(
        f"{a.nproc} processes: {many / 1e3:8.1f}k tok/s, {many / a.nproc / 1e3:.1f}k per GPU "
        f"(wall {wall_n:.0f}s)"
    )
    print(f"scaling efficiency: {eff:.1%}")


if __name__ == "__main__":
    main()
