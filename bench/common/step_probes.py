"""The instruments bench_train.py measures a training step with: the bf16 matmul peak (MFU's
denominator), the profiler's kernels by kind and the GPU's idle gaps, Python's collections, the
GPU's clocks and power through NVML, and the host trace that trace_report.py reads. None of them
changes what the step computes."""

from __future__ import annotations

import contextlib
import gc
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

# --profile takes this many steps back to back, so the wait between steps is in its span.
PROFILED_STEPS = 2


def matmul_peak_flops(device: torch.device, n: int = 8192, reps: int = 20) -> float:
    """Measured dense bf16 matmul throughput (FLOP/s): the MFU denominator."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize(device)
    return 2 * n**3 * reps / (time.perf_counter() - t0)


CATEGORIES = [
    ("scan", ("mamba3", "siso", "_chunk", "_state", "triton_siso")),
    ("loss", ("logsumexp", "cross_entropy", "ce_grad", "scatter", "gather", "log_softmax")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "_fused_adamw")),
    ("matmul", ("gemm", "sm90", "cutlass", "nvjet", "matmul", "mm_", "cublas")),
    (
        "norms/elementwise",
        ("norm", "elementwise", "vectorized", "triton_", "reduce", "silu", "swiglu"),
    ),
]


def categorise(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


class GcPauses:
    """Python's garbage collections inside a ``with`` block: how many of each generation and
    the host time they took (a long one at a step's start leaves the GPU waiting)."""

    def __init__(self):
        self.pauses: list[tuple[int, float]] = []
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.pauses.append((info["generation"], (time.perf_counter() - self._t0) * 1e3))

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict:
        by_gen = {g: [ms for gen, ms in self.pauses if gen == g] for g in (0, 1, 2)}
        return {f"gen{g}": {"n": len(ms), "ms": round(sum(ms), 2)} for g, ms in by_gen.items()}


class ClockSampler:
    """The GPU's SM clock, power draw and clock-event reasons through NVML, sampled by a thread
    every ``interval_s`` inside a ``with`` block, read per span of host time (a timed step): is a
    slow step the code's or the clocks'? The GPU is CUDA's ``device``, found in NVML by its UUID
    (NVML's indices ignore CUDA_VISIBLE_DEVICES). Without NVML (no nvidia-ml-py, no driver) it
    records nothing and says so in ``error``."""

    def __init__(self, device: torch.device, interval_s: float = 0.025):
        self.samples: list[tuple[float, int, float, int]] = []  # (t, MHz, W, reasons)
        self.error: str | None = None
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            uuid = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
            self._handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        except Exception as e:  # no library, no driver: the benchmark runs on without clocks
            self.error = f"{type(e).__name__}: {e}"

    def _run(self) -> None:
        nv, h = self._nvml, self._handle
        while not self._stop.wait(self._interval):
            try:
                self.samples.append(
                    (
                        time.perf_counter(),
                        nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
                        nv.nvmlDeviceGetPowerUsage(h) / 1e3,
                        nv.nvmlDeviceGetCurrentClocksEventReasons(h),
                    )
                )
            except Exception as e:  # a query this GPU or driver lacks: no more samples
                self.error = f"{type(e).__name__}: {e}"
                return

    def __enter__(self) -> ClockSampler:
        if self.error is None:
            self._thread = threading.Thread(target=self._run, name="clock-sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if hasattr(self, "_nvml"):
            self._nvml.nvmlShutdown()

    def span(self, t0: float, t1: float) -> dict | None:
        """Mean SM clock (MHz) and power (W) of the samples in [t0, t1), and the share of them
        under each clock-event reason seen."""
        from m3run.runner.health.nvml import THROTTLE_REASONS

        inside = [x for x in self.samples if t0 <= x[0] < t1]
        if not inside:
            return None
        n = len(inside)
        reasons = {
            name: round(sum(1 for x in inside if x[3] & bit) / n, 2)
            for name, bit in THROTTLE_REASONS.items()
            if any(x[3] & bit for x in inside)
        }
        return {
            "sm_mhz": round(sum(x[1] for x in inside) / n),
            "power_w": round(sum(x[2] for x in inside) / n),
            "reasons": reasons,
        }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(step: Callable[[], object], n: int, device: torch.device) -> dict:
    """``step()`` n times back to back after a full collection, timed: the mean step (s) over
    the whole run, synced at its end; each step's host time (ms; a step that ends in a host read
    of its loss is timed whole); the Python collections among them; and on CUDA the SM clock,
    power and clock-event reasons of each step (``step_clocks``, None without samples;
    ``clock_error`` says why)."""
    step_ms, bounds, pauses = [], [], GcPauses()
    clocks = ClockSampler(device) if device.type == "cuda" else None
    # A full collection first: one owed to earlier runs in the process (the models and graphs
    # that --rounds and --variant leave behind) would otherwise land in whichever stack's steps
    # come next (a 470 ms pause in the official module's fourth round, 2026-12-03).
    gc.collect()
    with pauses, clocks or contextlib.nullcontext():
        t0 = t_prev = time.perf_counter()
        for _ in range(n):
            last = step()
            now = time.perf_counter()
            step_ms.append((now - t_prev) * 1e3)
            bounds.append((t_prev, now))
            t_prev = now
        sync(device)
        total = time.perf_counter() - t0
    return {
        "step_s": total / n,
        "step_ms": [round(ms, 2) for ms in step_ms],
        "gc": pauses.summary(),
        "step_clocks": [clocks.span(*b) for b in bounds] if clocks and clocks.samples else None,
        "clock_error": clocks.error if clocks else None,
        "last": last,
    }


def timing_lines(result: dict) -> list[str]:
    """The per-step lines of a result holding :func:`timed_steps`' fields."""
    steps = " ".join(f"{ms:.1f}" for ms in result["step_ms"])
    out = [f"timed steps (ms): {steps} | Python gc: {json.dumps(result['gc'])}"]
    if result.get("step_clocks"):
        per_step = " ".join(
            f"{c['sm_mhz']} MHz/{c['power_w']} W" if c else "-" for c in result["step_clocks"]
        )
        seen = sorted({r for c in result["step_clocks"] if c for r in c["reasons"]})
        out.append(
            f"SM clock/power by step: {per_step} | clock-event reasons seen: "
            f"{', '.join(seen) or 'none'}"
        )
    if result.get("clock_error"):
        out.append(f"GPU clocks not (all) read: {result['clock_error']}")
    return out


def host_trace(trainer, out_dir: Path, impl: str) -> Path:
    """Two more steps under torch.profiler with the host's threads, operator shapes and the GPU,
    as a gzipped Chrome trace in ``out_dir`` (for what the host did while the GPU waited, and
    each matmul's shape beside its kernel's time). Returns its path."""
    from torch.profiler import ProfilerActivity, record_function
    from torch.profiler import profile as prof

    out_dir.mkdir(parents=True, exist_ok=True)
    name = "".join(c if c.isalnum() else "-" for c in impl).strip("-")
    path = out_dir / f"trace-{name}.json.gz"
    activities = [ProfilerActivity.CPU]
    if trainer.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with prof(activities=activities, record_shapes=True) as p:
        for i in range(PROFILED_STEPS):
            with record_function(f"train_step {i}"):
                trainer.train_step()
        sync(trainer.device)
    p.export_chrome_trace(str(path))  # gzipped by the profiler, for the suffix
    return path


def kernel_rows(averages) -> list[dict]:
    """Every kernel of one profiled step with GPU time, most first: name (cut to 120
    characters), kind, ms, launches."""
    rows = []
    for evt in averages:
        us = getattr(evt, "self_device_time_total", 0) or getattr(evt, "self_cuda_time_total", 0)
        if us:
            rows.append(
                {
                    "kernel": evt.key[:120],
                    "kind": categorise(evt.key),
                    "ms": us / 1e3,
                    "calls": evt.count,
                }
            )
    return sorted(rows, key=lambda r: -r["ms"])


def device_spans(events) -> list[tuple[float, float, str]]:
    """(start µs, end µs, name) of every GPU activity (kernels, copies) of a profile."""
    from torch.autograd import DeviceType

    spans = [
        (e.time_range.start, e.time_range.end, e.name)
        for e in events
        if e.device_type == DeviceType.CUDA
    ]
    return [span for span in spans if span[1] > span[0]]


def gap_walk(intervals: list[tuple[float, float]]) -> tuple[float, float, list]:
    """For (start, end) intervals sorted by start: the time some interval covers (overlaps
    counted once), the span from the first start to the last end, and every gap as (length,
    index of the interval that ended last before it, index of the first one after it)."""
    busy, gaps = 0.0, []
    (start, end), i_end = intervals[0], 0
    for i, (s, e) in enumerate(intervals[1:], 1):
        if s > end:
            busy += end - start
            gaps.append((s - end, i_end, i))
            start, end, i_end = s, e, i
        elif e > end:
            end, i_end = e, i
    return busy + end - start, end - intervals[0][0], gaps


def idle_gaps(spans: list[tuple[float, float, str]], top: int, floor_us: float = 20.0) -> dict:
    """Where the GPU waits in one step: the span from its first activity to its last, the time
    some activity runs (overlaps counted once), the idle rest, the gaps of ``floor_us`` or more
    and the ``top`` largest with the activities that end before and start after each."""
    if not spans:
        return {
            "span_ms": 0.0,
            "busy_ms": 0.0,
            "idle_ms": 0.0,
            "gaps": 0,
            "gaps_ms": 0.0,
            "largest": [],
        }
    spans = sorted(spans)
    busy, span, walk = gap_walk([(s, e) for s, e, _ in spans])
    gaps = [(us, spans[a][2], spans[b][2]) for us, a, b in walk]
    big = sorted((g for g in gaps if g[0] >= floor_us), key=lambda g: -g[0])
    return {
        "span_ms": round(span / 1e3, 3),
        "busy_ms": round(busy / 1e3, 3),
        "idle_ms": round((span - busy) / 1e3, 3),
        "gaps": len(big),
        "gaps_ms": round(sum(g[0] for g in big) / 1e3, 3),
        "largest": [
            {"us": round(us, 1), "after": a[:80], "before": b[:80]} for us, a, b in big[:top]
        ],
    }
