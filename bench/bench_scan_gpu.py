"""GPU speed of the Mamba-3 SISO scan: the Triton kernel (both backwards, v1 and v2) vs the PyTorch
chunked reference, forward and forward+backward, in one run, with the achieved memory bandwidth.

    python bench/bench_scan_gpu.py [--b 16 --t 2048 --h 32 --p 64 --n 64 --s 16 --g 1]
                                   [--no-ref] [--sweep] [--kernels]

Times are medians of ``triton.testing.do_bench`` (CUDA events, warm-up first). Bandwidth counts
the bytes of the inputs and outputs once: forward = inputs + y; forward+backward = that +
dy + one gradient per input. ``--sweep`` also times the kernels' launch settings;
``--kernels`` splits one forward+backward of each backward version into its GPU kernels
(torch.profiler, mean of 20 calls). The forward
is the same for both backwards (``M3RUN_SCAN_BWD``), so its two times check each other.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from kernels.mamba3 import mamba3_siso


def make_inputs(b, t, h, p, n, s, g, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen)

    dt = F.softplus(r(b, h, t) - 2.0)
    x = dict(
        q=F.rms_norm(r(b, t, g, n), (n,)).bfloat16(),
        k=F.rms_norm(r(b, t, g, n), (n,)).bfloat16(),
        v=r(b, t, h, p).bfloat16(),
        adt=-F.softplus(r(b, h, t)) * dt, dt=dt, trap=r(b, h, t),
        q_bias=torch.ones(h, n), k_bias=torch.ones(h, n),
        angles=r(b, t, h, s), d=torch.ones(h), z=r(b, t, h, p).bfloat16(),
    )  # fmt: skip
    return {key: val.cuda() for key, val in x.items()}


def nbytes(tensors) -> int:
    return sum(x.numel() * x.element_size() for x in tensors)


def time_impl(x, backend, chunk, fwd_only=False, bwd_only=False):
    import triton.testing

    leaves = {key: val.clone().requires_grad_() for key, val in x.items()}
    gy = torch.randn_like(x["v"])

    def fwd():
        with torch.no_grad():
            return mamba3_siso(**x, chunk_size=chunk, backend=backend)

    def fwd_bwd():
        mamba3_siso(**leaves, chunk_size=chunk, backend=backend).backward(gy)

    ms_f = ms_fb = float("nan")
    if not bwd_only:
        ms_f = triton.testing.do_bench(fwd, warmup=25, rep=200, return_mode="median")
    if not fwd_only:
        ms_fb = triton.testing.do_bench(
            fwd_bwd, warmup=25, rep=200, grad_to_none=list(leaves.values()), return_mode="median"
        )
    return ms_f, ms_fb, fwd()


def kernel_times(x, chunk, reps: int = 20) -> list[tuple[str, float]]:
    """GPU time per kernel name of one forward+backward, in ms, largest first."""
    from torch.profiler import ProfilerActivity, profile

    leaves = {key: val.clone().requires_grad_() for key, val in x.items()}
    gy = torch.randn_like(x["v"])

    def step():
        for leaf in leaves.values():
            leaf.grad = None
        mamba3_siso(**leaves, chunk_size=chunk, backend="triton").backward(gy)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if us > 0:
            totals[ev.key] = totals.get(ev.key, 0.0) + us / 1e3 / reps
    return sorted(totals.items(), key=lambda kv: -kv[1])


def kernel_info(fn) -> str:
    """Registers, spills and shared memory of each compiled variant of a Triton kernel."""
    rows = []
    try:
        for cache in fn.device_caches.values():
            for kern in cache[0].values():
                md = kern.metadata
                rows.append(
                    f"regs {kern.n_regs} spills {kern.n_spills} warps {md.num_warps} "
                    f"stages {md.num_stages} smem {md.shared}"
                )
    except Exception as exc:  # the cache layout is a Triton internal
        rows.append(f"(no compile info: {exc!r})")
    return "; ".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("b", 16), ("t", 2048), ("h", 32), ("p", 64), ("n", 64), ("s", 16),
                          ("g", 1), ("chunk", 64)):  # fmt: skip
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--no-ref", action="store_true", help="skip the PyTorch reference")
    ap.add_argument("--sweep", action="store_true", help="also time the kernels' launch settings")
    ap.add_argument("--kernels", action="store_true", help="GPU time of each kernel of fwd+bwd")
    a = ap.parse_args()

    from kernels.mamba3 import triton_siso as ts

    x = make_inputs(a.b, a.t, a.h, a.p, a.n, a.s, a.g)
    io_f = nbytes(x.values()) + nbytes([x["v"]])  # inputs + y
    io_fb = io_f + nbytes([x["v"]]) + nbytes(x.values())  # + dy + one gradient per input
    shape = f"b{a.b} t{a.t} h{a.h} p{a.p} n{a.n} s{a.s} g{a.g} chunk{a.chunk}"
    print(f"mamba3_siso on {torch.cuda.get_device_name()}, {shape}, bf16 with d and z")
    print(f"torch {torch.__version__}, triton {__import__('triton').__version__}")

    from kernels.mamba3 import triton_siso_bwd as tb

    if a.sweep:
        print("\nlaunch settings")
        configs = (
            ("fwd", ts.FWD_CONFIG), ("bwd", ts.BWD_CONFIG), ("angle", ts.ANGLE_CONFIG),
            ("dstate", tb.DSTATE_CONFIG), ("dkv", tb.DKV_CONFIG), ("dq", tb.DQ_CONFIG),
        )  # fmt: skip
        base = {name: dict(cfg) for name, cfg in configs}
        for ns in (1, 2):
            ts.FWD_CONFIG.update(num_warps=4, num_stages=ns)
            ms_f, _, _ = time_impl(x, "triton", a.chunk, fwd_only=True)
            print(f"  fwd warps=4 stages={ns}: {ms_f:.3f} ms")
        ts.FWD_CONFIG.update(base["fwd"])
        ts.SCAN_BWD = "v1"
        for nw, ns, anw in ((4, 1, 4), (8, 1, 4), (8, 2, 4), (8, 1, 8)):
            ts.BWD_CONFIG.update(num_warps=nw, num_stages=ns)
            ts.ANGLE_CONFIG.update(num_warps=anw)
            _, ms_fb, _ = time_impl(x, "triton", a.chunk, bwd_only=True)
            print(f"  fwd+bwd v1: state warps={nw} stages={ns}, angle warps={anw}: {ms_fb:.3f} ms")
        ts.SCAN_BWD = "v2"
        for bv, dsw, kvw, qw in ((64, 4, 8, 8), (64, 4, 4, 4), (64, 4, 4, 8), (64, 4, 8, 4),
                                 (32, 4, 8, 8), (64, 8, 8, 8)):  # fmt: skip
            tb.DSTATE_CONFIG.update(BV=bv, num_warps=dsw)
            tb.DKV_CONFIG.update(num_warps=kvw)
            tb.DQ_CONFIG.update(num_warps=qw)
            _, ms_fb, _ = time_impl(x, "triton", a.chunk, bwd_only=True)
            print(
                f"  fwd+bwd v2: dstate BV={bv} warps={dsw}, dkv warps={kvw}, dq warps={qw}:"
                f" {ms_fb:.3f} ms"
            )
        for name, cfg in configs:
            cfg.update(base[name])

    if a.kernels:
        for version in ts.SCAN_BWD_VERSIONS:
            ts.SCAN_BWD = version
            rows = kernel_times(x, a.chunk)
            total = sum(ms for _, ms in rows)
            print(f"\nfwd+bwd {version} by kernel (GPU time, {total:.3f} ms in all)")
            for name, ms in rows:
                print(f"  {ms:7.3f} ms {100 * ms / total:5.1f}%  {name[:90]}")
        ts.SCAN_BWD = ts.SCAN_BWD_DEFAULT

    results = {}
    for version in ts.SCAN_BWD_VERSIONS:
        ts.SCAN_BWD = version
        results[f"triton {version}"] = time_impl(x, "triton", a.chunk)
    if not a.no_ref:
        results["pytorch"] = time_impl(x, "pytorch", a.chunk)
    print(f"\nforward kernel: {kernel_info(ts._siso_fwd_kernel)}")
    print(f"v1 backward state kernel: {kernel_info(ts._siso_bwd_state_kernel)}")
    print(f"v1 backward angle kernel: {kernel_info(ts._siso_bwd_angle_kernel)}")
    print(f"v2 backward dstate kernel: {kernel_info(tb._siso_bwd_dstate_kernel)}")
    print(f"v2 backward dkv kernel: {kernel_info(tb._siso_bwd_dkv_kernel)}")
    print(f"v2 backward dq kernel: {kernel_info(tb._siso_bwd_dq_kernel)}")
    print(f"v2 backward cumsum kernel: {kernel_info(tb._siso_bwd_cumsum_kernel)}")

    ref = results.get("pytorch")
    head = (f"{'impl':9} {'fwd ms':>8} {'fwd GB/s':>9} {'fwd+bwd ms':>11} {'GB/s':>7}"
            f" {'fwd x':>7} {'f+b x':>7} {'y rel err':>10}")  # fmt: skip
    print("\n" + head + "\n" + "-" * len(head))
    for name, (ms_f, ms_fb, y) in results.items():
        sp_f = f"{ref[0] / ms_f:.1f}" if ref else "-"
        sp_fb = f"{ref[1] / ms_fb:.1f}" if ref else "-"
        err = "-"
        if ref:
            yr = ref[2].double()
            err = f"{((y.double() - yr).norm() / yr.norm()).item():.1e}"
        print(
            f"{name:9} {ms_f:8.3f} {io_f / ms_f / 1e6:9.0f}"
            f" {ms_fb:11.3f} {io_fb / ms_fb / 1e6:7.0f}"
            f" {sp_f:>7} {sp_fb:>7} {err:>10}"
        )
    print(
        "(fwd x, f+b x: speed-up over the PyTorch reference; GB/s: bytes of inputs+outputs;"
        f" default backward: {ts.SCAN_BWD_DEFAULT})"
    )


if __name__ == "__main__":
    main()
