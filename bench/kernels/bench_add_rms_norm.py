"""GPU speed of the residual add + RMSNorm operator's backward kernel (kernels/add_rms_norm.py)
alone, over launch configurations: rows a tile × warps × programs.

    PYTHONPATH=. python bench/kernels/bench_add_rms_norm.py [--b 16 --t 2048 --d 1024]
        [--rows 1 2 4 8 --warps 4 8 16 --programs 512 1024 2048 4096]

For each configuration: the backward operator's time (CUDA events, mean of 50 after 3
warm-ups) on an fp32 stream with a bf16 branch, and the bandwidth of the bytes it must move
(s, g_s and ds in fp32; g_n and the bf16 copy of ds), fastest first. The kernel's constants
(ROWS, NUM_WARPS, PROGRAMS) are the configuration to keep.
"""

from __future__ import annotations

import argparse
import itertools

import torch

import m3run.kernels.add_rms_norm as op


def time_ms(fn, reps: int = 50) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--b", type=int, default=16)
    ap.add_argument("--t", type=int, default=2048)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--programs", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit(
            "bench_add_rms_norm.py needs a CUDA GPU (the operator's kernels are Triton)"
        )
    torch.manual_seed(0)
    s = torch.randn(a.b, a.t, a.d, device="cuda")
    g_s = torch.randn_like(s)
    g_n = torch.randn_like(s).bfloat16()
    w = 1 + 0.1 * torch.randn(a.d, device="cuda")
    moved = s.numel() * (3 * 4 + 2 * 2)  # read s, g_s (fp32), g_n; write ds, its bf16 copy
    kept = (op.ROWS, op.NUM_WARPS, op.PROGRAMS)
    print(
        f"GPU {torch.cuda.get_device_name()} | torch {torch.__version__} | (b, t, d) = "
        f"({a.b}, {a.t}, {a.d}) | the code's configuration: rows {kept[0]}, warps {kept[1]}, "
        f"programs {kept[2]}"
    )
    rows = []
    for r, nw, p in itertools.product(a.rows, a.warps, a.programs):
        op.ROWS, op.NUM_WARPS, op.PROGRAMS = r, nw, p
        ms = time_ms(lambda: op.add_rms_norm_bwd_op(s, w, g_s, g_n, 1e-5, torch.bfloat16))
        rows.append((ms, r, nw, p))
    op.ROWS, op.NUM_WARPS, op.PROGRAMS = kept
    for ms, r, nw, p in sorted(rows):
        mark = "  (the code's)" if (r, nw, p) == kept else ""
        print(
            f"rows {r} warps {nw:2d} programs {p:4d}: {ms * 1e3:7.1f} µs, "
            f"{moved / ms / 1e6:6.0f} GB/s{mark}"
        )


if __name__ == "__main__":
    main()
