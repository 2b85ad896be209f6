"""GPU speed of the SwiGLU MLP alone: the plain module against the fused operator
(kernels/swiglu.py), each compiled as the trainer compiles (inductor, model.lm.compile_options)
and eager, forward+backward under bf16 autocast, in one process.

    PYTHONPATH=. python bench/kernels/bench_swiglu.py [--d-model 1024 --d-hidden 3072 \
        --b 16 --t 2048]

Prints the wall time of one forward+backward (mean of 20 after 3 warm-ups), the peak memory and
the GPU kernels of one call (torch.profiler), largest first.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# The helpers the bench scripts share live in bench/common, beside this script's folder.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))

import torch
from step_probes import kernel_rows
from torch.profiler import ProfilerActivity, profile

from m3run.model.layers import SwiGLU
from m3run.model.lm import compile_options


def bench(backend: str, compiled: bool, a: argparse.Namespace) -> None:
    torch.manual_seed(0)
    mlp = SwiGLU(a.d_model, a.d_hidden, backend=backend).cuda()
    fn = torch.compile(mlp, options=compile_options()) if compiled else mlp
    x = torch.randn(a.b, a.t, a.d_model, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    def once():
        with torch.autocast("cuda", torch.bfloat16):
            y = fn(x)
        y.backward(dy)

    for _ in range(3):
        once()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(20):
        once()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / 20 * 1e3
    peak = torch.cuda.max_memory_allocated() / 2**30
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        once()
        torch.cuda.synchronize()
    print(f"{backend:8s} compiled={compiled}: {ms:.3f} ms forward+backward, peak {peak:.2f} GiB")
    for row in kernel_rows(prof.key_averages())[:8]:
        print(f"    {row['ms']:8.3f} ms {row['calls']:3d}× {row['kernel'][:100]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--d-hidden", type=int, default=3072)
    ap.add_argument("--b", type=int, default=16)
    ap.add_argument("--t", type=int, default=2048)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_swiglu.py needs a CUDA GPU (the operator's kernels are Triton)")
    for backend in ("pytorch", "triton"):
        for compiled in (True, False):
            bench(backend, compiled, a)


if __name__ == "__main__":
    main()
