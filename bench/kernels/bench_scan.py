"""Speed of the Mamba-3 SISO scan references: chunked vs recurrent (forward and forward+backward).

    python bench/kernels/bench_scan.py [--b 2 --t 512 --h 8 --p 64 --n 64 --s 16] \
        [--device cpu|cuda]

Prints a table. On CUDA the Triton kernel has its own benchmark (bench/kernels/bench_scan_gpu.py).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from m3run.kernels.mamba3 import mamba3_siso, mamba3_siso_recurrent


def inputs(b, t, h, p, n, s, device, dtype, requires_grad):
    g = torch.Generator(device="cpu").manual_seed(0)

    def r(*shape, dt=dtype):
        return (
            torch.randn(*shape, generator=g)
            .to(device=device, dtype=dt)
            .requires_grad_(requires_grad)
        )

    dt = F.softplus(torch.randn(b, h, t, generator=g) - 2).to(device)
    adt = (-F.softplus(torch.randn(b, h, t, generator=g)) * dt.cpu().to(device)).to(device)
    return dict(
        q=r(b, t, 1, n),
        k=r(b, t, 1, n),
        v=r(b, t, h, p),
        z=r(b, t, h, p),
        adt=adt.requires_grad_(requires_grad),
        dt=dt.requires_grad_(requires_grad),
        trap=r(b, h, t, dt=torch.float32),
        q_bias=r(h, n, dt=torch.float32),
        k_bias=r(h, n, dt=torch.float32),
        angles=r(b, t, h, s, dt=torch.float32),
        d=r(h, dt=torch.float32),
    )


def timeit(fn, device, reps):
    fn()  # warm up
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    for k, v in dict(b=2, t=512, h=8, p=64, n=64, s=16, reps=3).items():
        ap.add_argument(f"--{k}", type=int, default=v)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-recurrent", action="store_true", help="skip the slow token loop")
    a = ap.parse_args()
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    shape = f"b{a.b} t{a.t} h{a.h} p{a.p} n{a.n} s{a.s} {str(dtype).split('.')[-1]} on {a.device}"
    threads = torch.get_num_threads()
    print(f"mamba3_siso references, {shape}, torch {torch.__version__}, {threads} threads")
    print(f"{'impl':<12}{'fwd ms':>12}{'fwd+bwd ms':>14}")
    impls = {"chunked": lambda x: mamba3_siso(**x, chunk_size=64, backend="pytorch")}
    if not a.no_recurrent:
        impls["recurrent"] = lambda x: mamba3_siso_recurrent(**x)
    results = {}
    for name, fn in impls.items():
        x = inputs(a.b, a.t, a.h, a.p, a.n, a.s, a.device, dtype, requires_grad=True)
        with torch.no_grad():
            fwd = timeit(lambda fn=fn, x=x: fn(x), a.device, a.reps)
        fwdbwd = timeit(lambda fn=fn, x=x: fn(x).float().sum().backward(), a.device, a.reps)
        results[name] = (fwd, fwdbwd)
        print(f"{name:<12}{fwd:>12.2f}{fwdbwd:>14.2f}")
    if "recurrent" in results:
        c, r = results["chunked"], results["recurrent"]
        print(
            f"chunked speed-up over recurrent: fwd {r[0] / c[0]:.1f}x, fwd+bwd {r[1] / c[1]:.1f}x"
        )


if __name__ == "__main__":
    main()
