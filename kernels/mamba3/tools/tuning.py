"""Choose the scan kernels' launch plans on this GPU by timing candidates (never in a training
process: `m3run tune-scan` and `bench/tune_scan.py` call it).

The scan runs once as the model's mixer calls it (z and x packed, one set of angles for every
head, resets where the run packs documents), with every launch recorded; then each kernel is
timed alone, on the recorded arguments, under each candidate configuration (num_warps,
num_stages, ptxas maxnreg, the p block of the forward and the chunk kernel, the chunk kernel's
heads and chunks a program, the angle kernel's head blocks) at each candidate chunk, and the
fastest is kept. Every candidate compiles first, on a pool of threads (compiled one by one at
their first launch, the compiles would take most of a tune's time). The entry :func:`tune_shape`
returns is what the checked-in table (``plans/table.py``) and this machine's plans
(``plans/local.py``) hold.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import launching
from .. import plans as lp
from .. import triton_common as tc
from ..triton_siso import mamba3_siso_triton
from .precompile import Launch, precompile, scan_launches

C = lp.LaunchConfig
CANDIDATES: dict[str, list[lp.LaunchConfig]] = {
    # bv 32: twice the sequential programs (b·h·2, one per p half), each with half the state
    # tile; slower than whole p on an earlier forward (docs/benchmarks.md), retried on this one.
    # wg 1: the wide products transposed (64 rows), warpgroup MMAs on sm_90. maxnreg 128: four
    # programs an SM instead of two, so twice the b·h sequential programs run in one wave
    # (388 B of spills a thread at 3 stages, 368 B at 1; sm_90, ptxas).
    "fwd": [C(4, 2), C(4, 3), C(8, 2), C(4, 3, 168), C(4, 2, bv=32), C(4, 3, bv=32),
            C(2, 3, bv=32), C(4, 2, wg=1), C(4, 3, wg=1), C(4, 1, 128, wg=1),
            C(4, 2, 128, wg=1), C(4, 3, 128, wg=1)],
    # maxnreg 128 at bv 0: four programs an SM, so twice the b·h sequential programs run in
    # one wave (no spills on sm_90 since the kernel only carries dG).
    "bwd_dstate": [C(4, 2), C(4, 1), C(8, 2), C(4, 2, bv=32), C(4, 3, bv=32), C(2, 2, bv=16),
                   C(4, 2, bv=16), C(4, 1, 128), C(4, 2, 128)],
    # maxnreg 168 / 128: three / four programs an SM instead of two (ncu: latency-bound at 12%
    # occupancy), for 196 / 472 B of spills a thread against none (sm_90, ptxas). hpp 2 / 4:
    # half / a quarter of the per-head dq, dk written and summed (timed with the head sum);
    # cpp with stages > 1: a chunk's loads under the work on the one before (cp.async). ptxas at
    # chunk 32, sm_90: 12 B of spills at 8 warps and hpp 2, 728 B at (4, 1, 168, hpp 2); 8 B at
    # (8, 2, cpp 2), 696 B at (4, 2, 168, cpp 2). wg 1: 100 B at (4, 1, 168), 172 B at
    # (8, 1, 128). 2 warps (255 registers, 404 B of spills, four programs an SM): half the
    # warps wait at each of the kernel's 124 barriers, which has beaten every 4-warp plan
    # (docs/benchmarks.md).
    "bwd_chunk": [C(2, 1), C(2, 1, 232), C(2, 1, bv=32), C(4, 1), C(8, 1), C(4, 1, 168),
                  C(4, 1, 128), C(8, 1, 128),
                  C(4, 1, 168, hpp=2), C(8, 1, hpp=2), C(8, 1, hpp=4), C(8, 2, hpp=2),
                  C(8, 2, cpp=2), C(8, 2, cpp=4), C(8, 3, cpp=4), C(4, 2, 168, cpp=2),
                  C(4, 1, 168, bv=32), C(4, 2, 168, bv=32), C(4, 1, 168, bv=16),
                  C(8, 1, 128, bv=32), C(4, 1, wg=1), C(4, 1, 168, wg=1), C(4, 1, 128, wg=1),
                  C(8, 1, 128, wg=1)],
    # hb: with shared angles, the heads in blocks, a program each (their sums added after,
    # timed with the kernel): more programs than the b·chunks that take every head in turn.
    "bwd_angle": [C(2, 1), C(4, 1), C(1, 1), C(2, 1, hb=4), C(4, 1, hb=2), C(4, 1, hb=4),
                  C(4, 1, hb=8), C(2, 1, hb=8), C(1, 1, hb=8)],
}  # fmt: skip

# A kernel whose work depends on another's configuration, timed with it: the head sum adds
# what the chunk kernel's hpp leaves of a group's dq, dk (nothing at a whole group).
FOLLOWERS = {"bwd_chunk": "bwd_head_sum"}

# The fields that change a launch's grid, buffers or flags: a candidate with another value than
# the starting plan's is recorded afresh.
_SHAPING = ("bv", "hpp", "cpp", "wg", "hb")

Timer = Callable[[Callable[[], object]], float]  # a function's time a call, ms


@dataclass(frozen=True)
class Shape:
    """What a scan call is tuned at: the model's (batch, tokens, heads, head dim p, state n,
    angles s, groups g), the dot dtype and whether the run packs documents (resets)."""

    b: int
    t: int
    h: int
    p: int
    n: int
    s: int
    g: int = 1
    dtype: torch.dtype = torch.bfloat16
    reset: bool = True

    def table_keys(self) -> list[str]:
        """The table keys this shape's plan serves: one per caller chunk size (the kernels'
        chunk is the plan's, whatever the caller's)."""
        return [lp.shape_key(tc.Tiles.of(self.p, self.n, c), self.dtype) for c in tc.CHUNK_SIZES]

    def describe(self) -> str:
        name = lp.dtype_name(self.dtype)
        return (
            f"b{self.b} t{self.t} h{self.h} p{self.p} n{self.n} s{self.s} g{self.g} {name}"
            f"{', resets' if self.reset else ''}"
        )


def scan_inputs(shape: Shape, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """The scan's inputs as the model's mixer passes them, with values in the ranges it feeds the
    scan: q, k RMS-normed (b, t, g, n) and z, x packed (b, t, 2, h, p) in the dot dtype; Δ,
    A·Δ, λ̃ (b, h, t), biases (h, n), one set of angles (b, t, 1, s) and ``d`` in fp32; with
    ``reset``, a document start every 512 tokens. Leaves that take gradients."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    b, t, h, p, n, s, g = shape.b, shape.t, shape.h, shape.p, shape.n, shape.s, shape.g

    def r(*size):
        return torch.randn(*size, generator=gen)

    dt = F.softplus(r(b, h, t) - 2.0)
    x = dict(
        q=F.rms_norm(r(b, t, g, n), (n,)).to(shape.dtype),
        k=F.rms_norm(r(b, t, g, n), (n,)).to(shape.dtype),
        zv=r(b, t, 2, h, p).to(shape.dtype),
        adt=-F.softplus(r(b, h, t)) * dt,
        dt=dt,
        trap=r(b, h, t),
        q_bias=torch.ones(h, n),
        k_bias=torch.ones(h, n),
        angles=r(b, t, 1, s),
        d=torch.ones(h),
    )
    out = {key: val.to(device).requires_grad_() for key, val in x.items()}
    if shape.reset:
        reset = torch.zeros(b, t, dtype=torch.bool)
        reset[:, 512::512] = True
        out["reset"] = reset.to(device)
    return out


def _scan(x: dict, chunk: int) -> torch.Tensor:
    return mamba3_siso_triton(
        x["q"],
        x["k"],
        None,
        x["adt"],
        x["dt"],
        x["trap"],
        x["q_bias"],
        x["k_bias"],
        x["angles"],
        x["d"],
        None,
        chunk_size=chunk,
        reset=x.get("reset"),
        zv=x["zv"],
    )


def forward_backward(x: dict, plan: lp.Plan) -> None:
    """One forward and backward of the scan under ``plan``."""
    with lp.launch_plans().forcing(plan):
        y = _scan(x, plan.chunk)
        y.backward(torch.ones_like(y))
    for val in x.values():
        val.grad = None


def record(x: dict, plan: lp.Plan) -> dict[str, Launch]:
    """Every launch of one forward+backward under ``plan`` (executed), by kernel name, kept for
    re-timing."""
    launches: dict[str, Launch] = {}

    def rec(*made):
        launch = Launch(*made)
        launch.run()
        launches[launch.name] = launch

    with launching.recording_everywhere(rec):
        forward_backward(x, plan)
    if x["zv"].is_cuda:
        torch.cuda.synchronize()
    return launches


def _plans(chunks: list[int], names, start_for, candidates) -> list[tuple[str, lp.Plan]]:
    """(kernel, plan) for every candidate of every kernel at every chunk."""
    return [
        (name, lp.Plan(chunk, dict(start_for(chunk), **{name: cfg})))
        for chunk in chunks
        for name in names
        for cfg in candidates[name]
    ]


def compile_candidates(shape: Shape, device: torch.device, plans, log=print) -> None:
    """Compile every candidate's launches ahead, on a pool of threads (their launches recorded
    on meta tensors); a candidate that does not compile is reported when it is timed."""
    launches: list[Launch] = []
    for name, plan in plans:
        with lp.launch_plans().forcing(plan):
            recorded = scan_launches(
                shape.b,
                shape.t,
                shape.h,
                shape.p,
                shape.n,
                shape.s,
                g=shape.g,
                chunk_size=plan.chunk,
                dtype=shape.dtype,
                reset=shape.reset,
                device=device,
            )
        keep = {name, FOLLOWERS.get(name)}
        launches += [launch for launch in recorded if launch.name in keep]
    t0 = time.perf_counter()
    try:
        summary = precompile(launches, device).result()
    except Exception as e:  # the candidate that failed is skipped when timed
        summary = f"some candidates did not compile ({e})"
    log(f"compiled the candidates: {summary} ({time.perf_counter() - t0:.1f} s)")


def cuda_timer(fn: Callable[[], object]) -> float:
    """Median ms a call on the GPU (Triton's benchmark loop)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def tune(
    x: dict,
    chunk: int,
    names=lp.KERNELS,
    start: dict | None = None,
    log=print,
    timer: Timer = cuda_timer,
    candidates=None,
) -> tuple[float, dict[str, dict]]:
    """Time each kernel of ``names`` alone under each candidate at this chunk, the others under
    ``start`` (the defaults when None); returns the sum of the best times (ms) and {kernel: best
    config as a dict}. A candidate that changes a launch's grid, buffers or flags is recorded
    afresh from a forward+backward under it; a kernel's follower (FOLLOWERS) is timed with it,
    and the angle kernel with its head blocks' sum."""
    candidates = CANDIDATES if candidates is None else candidates
    start = dict(start or lp.DEFAULT_CONFIGS)
    base = record(x, lp.Plan(chunk, start))
    best, total = {}, 0.0
    for name in names:
        if name not in base:  # every scan launches all four: a miss is a recording that failed
            raise RuntimeError(
                f"the recorded forward and backward launched no {name} kernel "
                f"(recorded: {sorted(base)})"
            )
        times = []
        for cfg in candidates[name]:
            try:
                launches = base
                if any(getattr(cfg, f) != getattr(start[name], f) for f in _SHAPING):
                    launches = record(x, lp.Plan(chunk, dict(start, **{name: cfg})))
                call, with_follower = _timed_call(name, launches, cfg)
                ms = timer(call)
            except Exception as exc:  # a config that does not compile or launch here
                log(f"  {name} {cfg.as_dict()}: failed ({type(exc).__name__}: {str(exc)[:80]})")
                continue
            times.append((ms, cfg))
            log(f"  {name:10} {cfg.as_dict()}: {ms * 1e3:8.1f} us{with_follower}")
        if not times:
            raise RuntimeError(f"no candidate of {name} ran at chunk {chunk}")
        ms, cfg = min(times, key=lambda mc: mc[0])
        log(f"{name}: best {cfg.as_dict()} {ms * 1e3:.1f} us")
        best[name] = cfg.as_dict()
        total += ms
    return total, best


def _timed_call(
    name: str, launches: dict[str, Launch], cfg: lp.LaunchConfig, follow: bool = True
) -> tuple[Callable, str]:
    """The kernel's launch under ``cfg`` on its recorded arguments, with what must follow it
    (``follow``: its follower too)."""
    launch = launches[name]
    follower = launches.get(FOLLOWERS.get(name, "")) if follow else None
    blocks = None  # the angle kernel's head blocks (shared angles, hb > 1) are summed after it
    if name == "bwd_angle":
        arg = dict(zip(launch.kernel.arg_names, launch.args, strict=False))
        if arg["s_ah"] == 0 and arg["dth"].shape[2] > 1:
            blocks = arg["dth"]

    def call():
        launch.run(cfg)
        if blocks is not None:
            blocks.sum(2, keepdim=True)
        if follower is not None:
            follower.run()

    return call, (f" (with {FOLLOWERS[name]})" if follower is not None else "")


@dataclass
class Tuned:
    """A tune's result: the entry to store, the GPU time (ms) of the scan's kernels in a forward
    and backward under it and under the baseline plan (:func:`kernels_ms`), and how long the
    tune took (s)."""

    entry: dict
    ms: float
    baseline_ms: float
    seconds: float


def tune_shape(
    shape: Shape,
    device: torch.device,
    *,
    chunks=tc.CHUNK_SIZES,
    names=lp.KERNELS,
    start_for=None,
    baseline: lp.Plan | None = None,
    log=print,
    timer: Timer = cuda_timer,
    candidates=None,
) -> Tuned:
    """Tune every kernel of ``names`` at each chunk (the others, and the starting point, under
    ``start_for(chunk)``: the defaults when None) and keep the chunk whose kernels sum fastest.
    The entry names every kernel's configuration. Its forward+backward is timed against
    ``baseline``'s (by default what runs without a tuned plan: the defaults at DEFAULT_CHUNK)."""
    t0 = time.perf_counter()
    candidates = CANDIDATES if candidates is None else candidates
    start_for = start_for or (lambda chunk: dict(lp.DEFAULT_CONFIGS))
    bad = sorted(set(chunks) - set(tc.CHUNK_SIZES))
    if bad or not chunks:
        raise ValueError(f"chunks must be among {tc.CHUNK_SIZES}, got {list(chunks)}")
    x = scan_inputs(shape, device)
    if not tc.interpreting():
        compile_candidates(shape, device, _plans(chunks, names, start_for, candidates), log)
    results = {}
    for chunk in chunks:
        log(f"chunk {chunk}")
        results[chunk] = tune(x, chunk, names, start_for(chunk), log, timer, candidates)
        log(f"chunk {chunk}: {results[chunk][0]:.3f} ms of the kernels tuned")
    chunk = min(results, key=lambda c: results[c][0])
    kept = {name: cfg.as_dict() for name, cfg in start_for(chunk).items()}
    entry = {"chunk": chunk, **kept, **results[chunk][1]}
    plan = lp.Plan(chunk, lp.entry_configs(entry))
    baseline = baseline or lp.untuned_plan(lp.DEFAULT_CHUNK)
    ms, baseline_ms = kernels_ms(x, plan, timer), kernels_ms(x, baseline, timer)
    return Tuned(entry, ms, baseline_ms, time.perf_counter() - t0)


def kernels_ms(x: dict, plan: lp.Plan, timer: Timer = cuda_timer) -> float:
    """The GPU time of the scan's kernels under ``plan``: each kernel of one recorded forward
    and backward timed alone on its arguments, summed. A timed forward+backward would take the
    host's time where it is the longer (the host's launch overhead can exceed the kernels' time,
    docs/benchmarks.md) and say less of the plans than they differ by."""
    launches = record(x, plan)
    return sum(
        timer(_timed_call(name, launches, launch.cfg, follow=False)[0])
        for name, launch in launches.items()
    )


def summary(t: Tuned) -> str:
    speedup = t.baseline_ms / t.ms if t.ms > 0 and math.isfinite(t.baseline_ms) else float("nan")
    return (
        f"chunk {t.entry['chunk']}: the scan's kernels {t.ms:.3f} ms a forward and backward "
        f"against {t.baseline_ms:.3f} ms without it ({speedup:.2f}x), tuned in {t.seconds:.0f} s"
    )


def tune_and_store(
    shape: Shape,
    device: torch.device,
    *,
    chunks=tc.CHUNK_SIZES,
    baseline: lp.Plan | None = None,
    log=print,
    path: Path | None = None,
    **search,
) -> tuple[Tuned, Path]:
    """Tune ``shape`` on ``device`` (:func:`tune_shape`, which takes ``search``'s timer and
    candidates) and store the plan in this machine's plans (``path``: the plans file, by
    default plans.plans_path()) for every caller chunk of the shape, with the GPU, the
    shape, the times and when; this process reads it at once. Returns the result and the file;
    raises :class:`PlansNotStored` when the file cannot be written."""
    import datetime

    tuned = tune_shape(shape, device, chunks=chunks, baseline=baseline, log=log, **search)
    about = {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "shape": shape.describe(),
        "kernels_ms": round(tuned.ms, 4),
        "defaults_kernels_ms": round(tuned.baseline_ms, 4),
        "at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    target = lp.plans_path() if path is None else path
    arch = lp.arch_key(device) if device.type == "cuda" else device.type  # the interpreter's: cpu
    try:
        stored = lp.launch_plans().local.store(arch, shape.table_keys(), tuned.entry, about, target)
    except OSError as e:
        raise PlansNotStored(target, e, tuned) from e
    return tuned, stored


class PlansNotStored(Exception):
    """A tune that ran but whose plan could not be written (``tuned`` holds it)."""

    def __init__(self, path: Path, error: OSError, tuned: Tuned):
        super().__init__(
            f"cannot write the tuned launch plans to {path} ({error}). Fix: make {path.parent} "
            f"writable, or set {lp.PLANS_ENV} to a file on writable storage that "
            "survives restarts"
        )
        self.path, self.tuned = path, tuned
