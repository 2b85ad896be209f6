"""GPU speed of the two small kernels that end the scan's backward, alone, under each launch: the
head sum of grouped q, k (with each head's bias partials, as at one head a chunk program, and
without them, as the chunk kernel leaves it at several) followed by the parameters' sum.

    PYTHONPATH=. python bench/kernels/bench_scan_sums.py [--b 16 --t 2048 --h 32 --n 64 --chunk 32]

Each (partials, warps, rows a program, stages) is checked against PyTorch (the group sums
bitwise, the bias sums within fp32 rounding) and timed with ``triton.testing.do_bench``
(median), the parameters' sum included; the launches the code uses are
``triton_sums.HEAD_SUM``/``HEAD_SUM_ROWS`` and ``HEAD_SUM_PARTS``/``HEAD_SUM_PARTS_ROWS``.
"""

from __future__ import annotations

import argparse

import torch

from m3run.kernels.mamba3 import triton_sums
from m3run.kernels.mamba3.launching import LaunchConfig


def time_launch(dq, dk, dd, partials_in, parts: bool, cfg: LaunchConfig, rows: int) -> float:
    """ms of one head sum and parameters' sum under (cfg, rows), after checking their results."""
    import triton.testing

    saved = (
        triton_sums.HEAD_SUM,
        triton_sums.HEAD_SUM_ROWS,
        triton_sums.HEAD_SUM_PARTS,
        triton_sums.HEAD_SUM_PARTS_ROWS,
    )
    triton_sums.HEAD_SUM = triton_sums.HEAD_SUM_PARTS = cfg
    triton_sums.HEAD_SUM_ROWS = triton_sums.HEAD_SUM_PARTS_ROWS = rows
    try:

        def call():
            sq, _, pq, pk = triton_sums.head_sums(dq, dk, 1, parts=parts)
            if not parts:  # the chunk kernel's per-(batch, chunk) partials instead
                pq = pk = partials_in
            return sq, triton_sums.param_sums(pq, pk, dd)

        sq, bias = call()
        if not torch.equal(sq, dq.float().sum(2, keepdim=True).to(dq.dtype)):
            raise AssertionError("group sums differ from PyTorch's")
        if parts and not torch.allclose(bias[0], dq.float().sum((0, 1)), rtol=1e-4, atol=1e-2):
            raise AssertionError("bias sums differ from PyTorch's")
        return triton.testing.do_bench(call, warmup=10, rep=50, return_mode="median")
    finally:
        (
            triton_sums.HEAD_SUM,
            triton_sums.HEAD_SUM_ROWS,
            triton_sums.HEAD_SUM_PARTS,
            triton_sums.HEAD_SUM_PARTS_ROWS,
        ) = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("b", 16), ("t", 2048), ("h", 32), ("n", 64), ("chunk", 32)):
        ap.add_argument(f"--{name}", type=int, default=default)
    a = ap.parse_args()
    nc = -(-a.t // a.chunk)
    gen = torch.Generator(device="cpu").manual_seed(0)
    dq, dk = (torch.randn(a.b, a.t, a.h, a.n, generator=gen).bfloat16().cuda() for _ in "qk")
    dd = torch.randn(a.b, nc, a.h, generator=gen).cuda()
    partials_in = torch.randn(a.b, nc, a.h, a.n, generator=gen).cuda()  # the chunk kernel's
    print(
        f"scan backward sums on {torch.cuda.get_device_name()}, b{a.b} t{a.t} h{a.h} n{a.n} "
        f"(one group), {nc} chunks; µs, the parameters' sum included"
    )
    for parts in (False, True):
        print("\nwith each head's bias partials" if parts else "\nwithout the bias partials")
        print(f"{'warps':>5} {'stages':>6} " + " ".join(f"{r:>4} rows" for r in (16, 32, 64, 128)))
        for warps in (1, 2, 4, 8):
            for stages in (1, 2):
                cells = []
                for rows in (16, 32, 64, 128):
                    cfg = LaunchConfig(num_warps=warps, num_stages=stages)
                    ms = time_launch(dq, dk, dd, partials_in, parts, cfg, rows)
                    cells.append(f"{ms * 1e3:9.1f}")
                print(f"{warps:>5} {stages:>6} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
