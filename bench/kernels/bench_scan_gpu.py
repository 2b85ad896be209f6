"""GPU speed of the Mamba-3 SISO scan: our Triton kernel, the official mamba_ssm Mamba-3 SISO Triton
kernel (when its source is importable) and the PyTorch chunked reference, forward and
forward+backward, in one process.

    python bench/kernels/bench_scan_gpu.py [--b 16 --t 2048 --h 32 --p 64 --n 64 --s 16 --g 1]
                                   [--chunk 64] [--no-ref] [--kernels] [--doc-len N] [--rounds 3]
                                   [--shared-angles] [--host]
                                   [--variant NAME:KERNEL.FIELD=VALUE,... ...] [--row-width W ...]

The official kernel is never a dependency: put a checkout's ``mamba_ssm/`` directory on
PYTHONPATH (``PYTHONPATH=path/to/dir-holding-mamba_ssm``) and it is timed beside ours; only its
Triton Mamba-3 modules are imported (the package ``__init__`` would load CUDA extensions). Its
autotuner runs on the first call of each kernel, before the timing.

Times are medians of ``triton.testing.do_bench`` (CUDA events, warm-up first); forward+backward
is timed ``--rounds`` times, the impls taking turns, and the median of the rounds kept (the
official kernel is bound by its host-side launches and moves between rounds). Bandwidth counts
the bytes of the inputs and outputs once: forward = inputs + y; forward+backward = that + dy +
one gradient per input. ``--kernels`` splits one forward+backward into GPU kernels
(torch.profiler, mean of 20 calls) for ours and the official kernel, after the timings;
``--host`` the host's time a forward+backward of each (the calls queued behind a second of GPU
work, so none waits for it): where it reaches the timed fwd+bwd, that timing is the host's.
``--variant`` also times ours under the launch plan with some fields changed (``ours[NAME]``), e.g.
``c8:bwd_chunk.num_warps=8,bwd_chunk.num_stages=2,bwd_chunk.maxnreg=none,bwd_chunk.cpp=2``,
so that a candidate is timed beside the official kernel before it goes into the table.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
import types
from pathlib import Path

# The helpers the bench scripts share live in bench/common, beside this script's folder.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))

import torch
import torch.nn.functional as F
from plan_edits import edited_plan, parse_variant

from m3run.kernels.mamba3 import mamba3_siso


def make_inputs(b, t, h, p, n, s, g, seed=0, shared_angles=False):
    """The scan's inputs on the GPU; with ``shared_angles`` one (b, t, 1, s) set of angles for
    every head, as the model passes them, else (b, t, h, s)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen)

    dt = F.softplus(r(b, h, t) - 2.0)
    x = dict(
        q=F.rms_norm(r(b, t, g, n), (n,)).bfloat16(),
        k=F.rms_norm(r(b, t, g, n), (n,)).bfloat16(),
        v=r(b, t, h, p).bfloat16(),
        adt=-F.softplus(r(b, h, t)) * dt,
        dt=dt,
        trap=r(b, h, t),
        q_bias=torch.ones(h, n),
        k_bias=torch.ones(h, n),
        angles=r(b, t, 1 if shared_angles else h, s),
        d=torch.ones(h),
        z=r(b, t, h, p).bfloat16(),
    )
    return {key: val.cuda() for key, val in x.items()}


def load_official():
    """The official ``mamba3_siso_combined`` from a mamba_ssm source tree on the path, or None.
    Registers bare package modules so that only the Triton Mamba-3 files are imported."""
    spec = importlib.util.find_spec("mamba_ssm")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    for name, sub in (
        ("mamba_ssm", "."),
        ("mamba_ssm.ops", "ops"),
        ("mamba_ssm.ops.triton", "ops/triton"),
        ("mamba_ssm.ops.triton.mamba3", "ops/triton/mamba3"),
    ):
        mod = types.ModuleType(name)
        mod.__path__ = [str(root / sub)]
        sys.modules[name] = mod
    from mamba_ssm.ops.triton.mamba3.mamba3_siso_combined import mamba3_siso_combined

    return mamba3_siso_combined


def official_fn(combined):
    """Our argument names onto the official entry point (positional: Q K V ADT DT Trap Q_bias
    K_bias Angles D Z); shared angles expanded to every head, as its module does."""

    def fn(q, k, v, adt, dt, trap, q_bias, k_bias, angles, d, z, chunk_size):
        angles = angles.expand(-1, -1, v.shape[2], -1)
        return combined(q, k, v, adt, dt, trap, q_bias, k_bias, angles, d, z, chunk_size=chunk_size)

    return fn


def ours_fn(backend, reset=None):
    """Our scan; with ``reset`` (b, t) bool, packed documents (the state reset at each start)."""
    extra = {} if reset is None else {"reset": reset}

    def fn(chunk_size, **x):
        return mamba3_siso(**x, chunk_size=chunk_size, backend=backend, **extra)

    return fn


def nbytes(tensors) -> int:
    return sum(x.numel() * x.element_size() for x in tensors)


def differentiable(x, row_width: int = 0):
    """Leaves for autograd and a function giving the call's keyword arguments from them. With
    ``row_width``, z and v are the column ranges [0, E) and [E, 2E) of one (b, t, row_width) leaf
    (E = h·p), as they were of in_proj's output when it was one product, so the kernels read them
    with its row stride and their gradients meet in one tensor."""
    leaves = {
        key: val.clone().requires_grad_()
        for key, val in x.items()
        if not (row_width and key in ("v", "z"))
    }
    if not row_width:
        return leaves, lambda: leaves
    b, t, h, p = x["v"].shape
    e = h * p
    if row_width < 2 * e:
        raise SystemExit(f"--row-width must be ≥ 2·h·p = {2 * e}, got {row_width}")
    wide = x["v"].new_zeros(b, t, row_width)
    wide[..., :e] = x["z"].reshape(b, t, e)
    wide[..., e : 2 * e] = x["v"].reshape(b, t, e)
    leaves["wide"] = wide.requires_grad_()

    def kwargs():
        rest = {key: val for key, val in leaves.items() if key != "wide"}
        z = wide[..., :e].unflatten(-1, (h, p))
        return {**rest, "z": z, "v": wide[..., e : 2 * e].unflatten(-1, (h, p))}

    return leaves, kwargs


def time_fwd_bwd(fn, x, chunk, row_width: int = 0) -> float:
    """Median ms of one forward+backward (compiled, and for the official kernel autotuned,
    outside the timing)."""
    import triton.testing

    leaves, kwargs = differentiable(x, row_width)
    gy = torch.randn_like(x["v"])

    def fwd_bwd():
        fn(chunk_size=chunk, **kwargs()).backward(gy)

    fwd_bwd()
    return triton.testing.do_bench(
        fwd_bwd, warmup=25, rep=200, grad_to_none=list(leaves.values()), return_mode="median"
    )


def time_fwd(fn, x, chunk, row_width: int = 0) -> float:
    """Median ms of one forward without autograd (the official kernel autotunes this variant
    afresh, which takes minutes)."""
    import triton.testing

    kwargs = differentiable(x, row_width)[1]

    def fwd():
        with torch.no_grad():
            return fn(chunk_size=chunk, **kwargs())

    fwd()
    return triton.testing.do_bench(fwd, warmup=25, rep=200, return_mode="median")


def warmed_step(fn, x, chunk, row_width: int = 0):
    """One forward+backward of ``fn`` on fresh leaves, as a call (gradients dropped first), run
    three times and synchronised: compiled, its memory in the allocator's cache."""
    leaves, kwargs = differentiable(x, row_width)
    gy = torch.randn_like(x["v"])

    def step():
        for leaf in leaves.values():
            leaf.grad = None
        fn(chunk_size=chunk, **kwargs()).backward(gy)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    return step


def host_ms(fn, x, chunk, reps: int = 30, row_width: int = 0) -> float:
    """The host's ms a forward+backward: the calls queued behind about a second of GPU work, so
    that none waits for the GPU and the time is the host's alone (the operators' Python, the
    launches, the allocations). The fwd+bwd timing hides part of it (do_bench clears the L2
    cache between calls, and the host runs ahead meanwhile); calls back to back, as a training
    step makes them, run at the slower of the two."""
    step = warmed_step(fn, x, chunk, row_width)
    torch.cuda._sleep(2_000_000_000)  # cycles: about a second, longer than the calls below
    t0 = time.perf_counter()
    for _ in range(reps):
        step()
    ms = (time.perf_counter() - t0) / reps * 1e3
    torch.cuda.synchronize()
    return ms


def kernel_times(fn, x, chunk, reps: int = 20, row_width: int = 0) -> list[tuple[str, float]]:
    """GPU time per kernel name of one forward+backward, in ms, largest first."""
    from torch.profiler import ProfilerActivity, profile

    step = warmed_step(fn, x, chunk, row_width)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (
        ("b", 16),
        ("t", 2048),
        ("h", 32),
        ("p", 64),
        ("n", 64),
        ("s", 16),
        ("g", 1),
        ("chunk", 64),
    ):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--no-ref", action="store_true", help="skip the PyTorch reference")
    ap.add_argument(
        "--shared-angles",
        action="store_true",
        help="one (b, t, 1, s) set of angles for every head, as the model passes them (the "
        "official kernel gets them expanded, as its module does)",
    )
    ap.add_argument(
        "--doc-len",
        type=int,
        default=0,
        help="also time ours on packed documents of this many tokens (a reset at each start)",
    )
    ap.add_argument(
        "--kernels",
        nargs="*",
        choices=("ours", "official"),
        default=None,
        help="GPU time of each kernel of fwd+bwd (of these impls; none named: both)",
    )
    ap.add_argument(
        "--host",
        action="store_true",
        help="also the host's time a forward+backward of each impl, the GPU kept busy ahead",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="forward+backward timings of each impl, taken in turns; the median is kept",
    )
    ap.add_argument(
        "--row-width",
        type=int,
        nargs="*",
        default=[],
        metavar="W",
        help="also time ours with z and v read from one (b, t, W) tensor, as from in_proj's "
        "output when it was one product (4336 at the 434m preset): ours@W",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:KERNEL.FIELD=VALUE,...",
        help="also time ours under the launch plan with these fields changed (repeatable)",
    )
    a = ap.parse_args()
    if a.rounds < 1:
        raise SystemExit(f"--rounds must be ≥ 1, got {a.rounds}")
    variants = [(name, edits) for name, _, edits in map(parse_variant, a.variant)]

    import triton

    x = make_inputs(a.b, a.t, a.h, a.p, a.n, a.s, a.g, shared_angles=a.shared_angles)
    io_f = nbytes(x.values()) + nbytes([x["v"]])  # inputs + y
    io_fb = io_f + nbytes([x["v"]]) + nbytes(x.values())  # + dy + one gradient per input
    shape = f"b{a.b} t{a.t} h{a.h} p{a.p} n{a.n} s{a.s} g{a.g} chunk{a.chunk}"
    shape += ", angles shared by the heads" if a.shared_angles else ""
    print(f"mamba3_siso on {torch.cuda.get_device_name()}, {shape}, bf16 with d and z")
    print(f"torch {torch.__version__}, triton {triton.__version__}")

    impls = {"ours": ours_fn("triton")}
    edits = {f"ours[{name}]": fields for name, fields in variants}
    for name in edits:
        impls[name] = ours_fn("triton")
    widths = {f"ours@{w}": w for w in a.row_width}
    for name in widths:
        impls[name] = ours_fn("triton")
    if a.doc_len:
        reset = torch.zeros(a.b, a.t, dtype=torch.bool, device="cuda")
        reset[:, a.doc_len // 2 :: a.doc_len] = True  # starts off the chunk grid too
        impls[f"ours+reset/{a.doc_len}"] = ours_fn("triton", reset)
    combined = load_official()
    if combined is not None:
        impls["official"] = official_fn(combined)
    else:
        print("official kernel: mamba_ssm not importable (put its source on PYTHONPATH)")
    if not a.no_ref:
        impls["pytorch"] = ours_fn("pytorch")

    # Forward+backward of every impl first, with its ratio, so that a run cut short during the
    # official kernel's autotune of its no-grad forward still has the line that matters. The
    # impls take turns for --rounds rounds: the official kernel is bound by its host-side
    # launches and its time moves between rounds, so each round is printed and the median kept.
    fb = {name: [] for name in impls}
    for r in range(a.rounds):
        for name, fn in impls.items():
            with edited_plan(edits.get(name)):
                fb[name].append(time_fwd_bwd(fn, x, a.chunk, widths.get(name, 0)))
        print(
            f"round {r + 1}: " + ", ".join(f"{n} {v[-1]:.3f} ms" for n, v in fb.items()), flush=True
        )
    fb = {name: statistics.median(times) for name, times in fb.items()}
    for name, ms in fb.items():
        print(f"{name}: fwd+bwd {ms:.3f} ms (median of {a.rounds})", flush=True)
    base = fb.get("official")
    if base:
        for name, ms in fb.items():
            print(f"{name}: fwd+bwd / official = {ms / base:.2f}", flush=True)
    fw = {}
    for name, fn in impls.items():
        with edited_plan(edits.get(name)):
            fw[name] = time_fwd(fn, x, a.chunk, widths.get(name, 0))
        print(f"{name}: fwd {fw[name]:.3f} ms", flush=True)
    head = (
        f"{'impl':15} {'fwd ms':>8} {'fwd GB/s':>9} {'fwd+bwd ms':>11} {'GB/s':>7}"
        f" {'fwd/off':>8} {'f+b/off':>8}"
    )
    print("\n" + head + "\n" + "-" * len(head))
    for name in impls:
        ms_f, ms_fb = fw[name], fb[name]
        r_f = f"{ms_f / fw['official']:.2f}" if base else "-"
        r_fb = f"{ms_fb / base:.2f}" if base else "-"
        print(
            f"{name:15} {ms_f:8.3f} {io_f / ms_f / 1e6:9.0f}"
            f" {ms_fb:11.3f} {io_fb / ms_fb / 1e6:7.0f} {r_f:>8} {r_fb:>8}"
        )
    print("(fwd/off, f+b/off: time over the official kernel's time, same process)")

    if a.host:
        print()
        for name, fn in impls.items():
            with edited_plan(edits.get(name)):
                ms = host_ms(fn, x, a.chunk, row_width=widths.get(name, 0))
            pace = (
                "back to back the calls run at the host's pace"
                if ms > fb[name]
                else "the GPU's time bounds it"
            )
            print(
                f"{name}: host {ms:.3f} ms a fwd+bwd against {fb[name]:.3f} ms timed ({pace})",
                flush=True,
            )

    # After the timings, so that no profiler state touches them.
    if a.kernels is not None:
        for name in a.kernels or ("ours", *edits, *widths, "official"):
            if name not in impls:
                continue
            with edited_plan(edits.get(name)):
                rows = kernel_times(impls[name], x, a.chunk, row_width=widths.get(name, 0))
            total = sum(ms for _, ms in rows)
            print(f"\nfwd+bwd {name} by kernel (GPU time, {total:.3f} ms in all)")
            for kname, ms in rows:
                print(f"  {ms:7.3f} ms {100 * ms / total:5.1f}%  {kname[:90]}")


if __name__ == "__main__":
    main()
