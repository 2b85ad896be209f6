"""What a `bench_train.py --trace` file says about a training step, in three parts.

    python bench/step/trace_report.py OUT/trace-ours.json.gz [--gaps 12] [--floor-us 20]

1. Per profiled step: the host's time, the GPU's span, its kernel time and idle time, and the
   idle split into gaps of at least ``--floor-us`` and the many small ones between kernels.
2. The largest gaps, each with the kernel after it, how long after the previous kernel ended the
   host launched that kernel (close to the gap's length: the host set the pace), and the
   operators the host's main thread ran meanwhile; other threads' operators in that window too.
3. Every matmul shape (aten::mm and aten::addmm as the host called them) with its calls per
   step, the GPU time of its kernels (split-K reductions and memsets included) and the TFLOP/s
   that makes, and the sum beside what the same FLOPs take at ``--peak`` TFLOP/s.

Kernels belong to the step whose host annotation ("train_step i") was open when they were
launched. CPU-only traces (``--dry-run``) have no GPU events: the report says so.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

# The helpers the bench scripts share live in bench/common, beside this script's folder.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))

from step_probes import gap_walk

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
MATMULS = {"aten::mm": (0, 1), "aten::addmm": (1, 2)}  # op → positions of its two matrices


@dataclass
class Trace:
    gpu: list[dict]  # GPU events by start time
    launches: dict[int, dict]  # correlation id → the host's launch call
    ops: list[dict]  # the host's operators
    op_by_id: dict[int, dict]  # External id → operator
    steps: list[dict]  # the "train_step i" annotations

    @classmethod
    def load(cls, path: Path) -> Trace:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            events = json.load(f)["traceEvents"]
        gpu = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES), key=lambda e: e["ts"])
        launches = {
            e["args"]["correlation"]: e
            for e in events
            if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})
        }
        ops = [e for e in events if e.get("cat") == "cpu_op"]
        op_by_id: dict[int, dict] = {}
        for e in ops:
            op_by_id.setdefault(e["args"].get("External id"), e)
        steps = sorted(
            (
                e
                for e in events
                if e.get("cat") == "user_annotation" and e["name"].startswith("train_step")
            ),
            key=lambda e: e["ts"],
        )
        return cls(gpu, launches, ops, op_by_id, steps)

    def launched_at(self, kernel: dict) -> float | None:
        launch = self.launches.get(kernel["args"].get("correlation"))
        return launch["ts"] if launch else None

    def op_of(self, kernel: dict) -> dict | None:
        return self.op_by_id.get(kernel["args"].get("External id"))

    def step_kernels(self, step: dict) -> list[dict]:
        t0, t1 = step["ts"], step["ts"] + step["dur"]
        return [k for k in self.gpu if (t := self.launched_at(k)) is not None and t0 <= t <= t1]


def kernel_gaps(kernels: list[dict]) -> tuple[float, float, list[tuple[float, float, dict]]]:
    """(kernel time, span, gaps) of kernels in start order; a gap is (µs, where it began, the
    kernel after it). Overlapping kernels count once towards the span, in full towards time."""
    _, span, walk = gap_walk([(k["ts"], k["ts"] + k["dur"]) for k in kernels])
    ends = [(us, kernels[a]["ts"] + kernels[a]["dur"], kernels[b]) for us, a, b in walk]
    return sum(k["dur"] for k in kernels), span, ends


def report_steps(tr: Trace, n_gaps: int, floor_us: float) -> None:
    main_tid = tr.steps[0]["tid"]
    for step in tr.steps:
        kernels = tr.step_kernels(step)
        if not kernels:
            continue
        busy, span, gaps = kernel_gaps(kernels)
        idle = sum(g for g, _, _ in gaps)
        large = [x for x in gaps if x[0] >= floor_us]
        print(
            f"{step['name']}: host {step['dur'] / 1e3:.1f} ms | GPU span {span / 1e3:.1f} ms, "
            f"kernel time {busy / 1e3:.1f} ms, idle {idle / 1e3:.2f} ms: "
            f"{sum(g for g, _, _ in large) / 1e3:.2f} ms in {len(large)} gaps ≥ {floor_us:g} µs, "
            f"{(idle - sum(g for g, _, _ in large)) / 1e3:.2f} ms in {len(gaps) - len(large)} "
            "smaller ones"
        )
        for gap, began, k in sorted(large, key=lambda x: -x[0])[:n_gaps]:
            launched = tr.launched_at(k)
            late = f"{launched - began:7.1f} µs" if launched is not None else "      ?"
            window = (began, launched if launched is not None else began)
            mine = Counter(
                e["name"]
                for e in tr.ops
                if e["tid"] == main_tid and window[0] <= e["ts"] < window[1]
            )
            others = Counter(
                e["name"]
                for e in tr.ops
                if e["tid"] != main_tid and e["ts"] < window[1] and e["ts"] + e["dur"] > window[0]
            )
            op = (tr.op_of(k) or {}).get("name", "?")
            print(
                f"   {gap:8.1f} µs before {k['name'][:60]} ({op}), launched {late} after the "
                f"GPU went idle; main thread meanwhile: {_top(mine)}"
                + (f"; other threads: {_top(others)}" if others else "")
            )


def _top(counts: Counter, n: int = 5) -> str:
    return ", ".join(f"{name[:48]} ×{c}" for name, c in counts.most_common(n)) or "nothing"


def report_matmuls(tr: Trace, peak_tflops: float) -> None:
    per_shape: dict[tuple, list] = defaultdict(lambda: [set(), 0.0, 0])
    for k in tr.gpu:
        op = tr.op_of(k)
        if op is None or op["name"] not in MATMULS:
            continue
        a, b = MATMULS[op["name"]]
        dims = op["args"].get("Input Dims") or []
        if len(dims) <= b or len(dims[a]) != 2 or len(dims[b]) != 2:
            continue
        (m, kk), (_, n) = dims[a], dims[b]
        row = per_shape[(op["name"], m, kk, n)]
        row[0].add(op["args"].get("External id"))
        row[1] += k["dur"]
        row[2] = 2 * m * kk * n
    if not per_shape:
        print("no matmul kernels in the trace")
        return
    n_steps = max(1, len(tr.steps))
    total = ideal = 0.0
    print(f"matmuls a step: op, M × K → N | calls | ms | TFLOP/s (peak {peak_tflops:g})")
    for (name, m, kk, n), (ids, us, flops) in sorted(per_shape.items(), key=lambda r: -r[1][1]):
        calls = len(ids)
        total += us / n_steps
        ideal += flops * calls / (peak_tflops * 1e12) * 1e6 / n_steps
        print(
            f"   {name:11} {m:6} × {kk:6} → {n:6} | {calls / n_steps:5.0f} | "
            f"{us / n_steps / 1e3:7.2f} | {flops * calls / (us * 1e-6) / 1e12:6.0f}"
        )
    print(
        f"matmul kernels {total / 1e3:.1f} ms a step; the same FLOPs at {peak_tflops:g} TFLOP/s "
        f"{ideal / 1e3:.1f} ms ({ideal / total:.1%})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path, help="a bench_train.py --trace file (.json or .json.gz)")
    ap.add_argument("--gaps", type=int, default=12, help="largest gaps listed per step")
    ap.add_argument("--floor-us", type=float, default=20.0, help="a gap this long is listed")
    ap.add_argument("--peak", type=float, default=800.0, help="bf16 matmul peak, TFLOP/s")
    a = ap.parse_args()
    if not a.trace.is_file():
        raise SystemExit(f"no trace at {a.trace}: bench_train.py --trace DIR writes one per run")
    tr = Trace.load(a.trace)
    if not tr.steps:
        raise SystemExit(f"{a.trace} has no train_step annotations: not a bench_train.py trace")
    print(
        f"{a.trace.name}: {len(tr.steps)} steps, {len(tr.gpu)} GPU events, "
        f"{len(tr.ops)} host operators"
    )
    if not tr.gpu:
        print("no GPU events (a CPU run): nothing to report on the GPU's time")
        return
    report_steps(tr, a.gaps, a.floor_us)
    report_matmuls(tr, a.peak)


if __name__ == "__main__":
    main()
