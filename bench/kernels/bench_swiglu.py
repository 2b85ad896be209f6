"""GPU speed of the SwiGLU MLP alone: the plain module against the fused operator
(kernels/swiglu.py), each compiled as the trainer compiles (inductor, model.lm.compile_options)
and eager, forward+backward under bf16 autocast, in one process.

    PYTHONPATH=. python bench/kernels/bench_swiglu.py [--d-model 1024 --d-hidden 3072 \
        --b 16 --t 2048]

Prints the wall time of one forward+backward (mean of 20 after 3 warm-ups), the peak memory and
the GPU kernels of one call (torch.profiler), largest first. With --sweep, instead: the
operator's two elementwise kernels alone at each --blocks × --warps launch (the module's BLOCK
and NUM_WARPS), timed with CUDA events, with the bandwidth they reach (the forward reads g and
u and writes h; the backward reads g, u and dh and writes dg, du and h).
"""

from __future__ import annotations

import argparse
import functools
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


def sweep(a: argparse.Namespace) -> None:
    from m3run.kernels import swiglu as op

    rows, hidden = a.b * a.t, a.d_hidden
    gu = torch.randn(rows, 2 * hidden, device="cuda", dtype=torch.bfloat16)
    dh = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    dgu, h = torch.empty_like(gu), torch.empty_like(dh)
    elem = rows * hidden * gu.element_size()
    print(f"rows {rows}, d_hidden {hidden}, bf16; kept now: BLOCK={op.BLOCK}, warps={op.NUM_WARPS}")
    kernels = {
        "forward": (op.swiglu_fwd_kernel, (gu, h, hidden), 3 * elem),
        "backward": (op.swiglu_bwd_kernel, (gu, dh, dgu, h, hidden), 6 * elem),
    }
    for block in a.blocks:
        for warps in a.warps:
            grid = (rows, -(-hidden // block))
            for name, (kernel, args, nbytes) in kernels.items():
                launch = functools.partial(kernel[grid], *args, BLOCK=block, num_warps=warps)
                us = _time_us(launch)
                print(
                    f"  {name:8s} BLOCK={block:5d} warps={warps:2d}: {us:8.1f} µs, "
                    f"{nbytes / us / 1e6:.2f} TB/s"
                )


def _time_us(launch, reps: int = 20) -> float:
    for _ in range(3):
        launch()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        launch()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--d-hidden", type=int, default=3072)
    ap.add_argument("--b", type=int, default=16)
    ap.add_argument("--t", type=int, default=2048)
    ap.add_argument("--sweep", action="store_true", help="time the kernels' launches alone")
    ap.add_argument("--blocks", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8, 16])
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_swiglu.py needs a CUDA GPU (the operator's kernels are Triton)")
    if a.sweep:
        sweep(a)
        return
    for backend in ("pytorch", "triton"):
        for compiled in (True, False):
            bench(backend, compiled, a)


if __name__ == "__main__":
    main()
