"""Throughput of m3run's real training step (the worker's `Trainer.train_step`).

    python bench/bench_train.py --micro-batch 8 16 [--steps 10] [--no-compile] [--profile]

For each micro-batch size it builds the worker exactly as `m3run train` does (model, chunked
linear cross-entropy, AdamW, accumulation, bf16 autocast, torch.compile) from the A100 recipe,
runs warm-up steps, then times optimizer steps and prints tokens/s, MFU against the bf16 matmul
peak measured in the same run, peak memory, and (with --profile) a breakdown of GPU time by
kind of kernel. Data comes from a small corpus prepared on the spot with the recipe's
sequence length, so the data path is the real one too.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "pretrain_a100_434m.yaml"


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
    ("loss", ("logsumexp", "cross_entropy", "scatter", "gather", "log_softmax")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "_fused_adamw")),
    ("matmul", ("gemm", "sm90", "cutlass", "nvjet", "matmul", "mm_", "cublas")),
    ("norms/elementwise", ("norm", "elementwise", "vectorized", "triton_", "reduce", "silu")),
]


def categorise(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def bench_one(micro: int, steps: int, warmup: int, compile_: bool, profile: bool,
              data_dir: Path, peak: float, backend: str) -> dict:  # fmt: skip
    from runner.config import load_config
    from runner.worker.trainer import Trainer

    overrides = [
        f"train.micro_batch_size={micro}",
        f"train.grad_accum_steps={max(1, 32 // micro)}",
        f"train.compile={'true' if compile_ else 'false'}",
        f"data.train_path={data_dir / 'train'}",
        f"data.val_path={data_dir / 'val'}",
        "eval.interval_steps=0",
        f"model.scan_backend={backend}",
    ]
    cfg = load_config(RECIPE, overrides)
    run_dir = Path(tempfile.mkdtemp(prefix=f"bench-mb{micro}-"))
    trainer = Trainer(cfg, run_dir, resume="none", force=True)
    trainer.setup()
    trainer.model.train()
    torch.cuda.reset_peak_memory_stats(trainer.device)
    t_compile = time.perf_counter()
    for _ in range(warmup):
        trainer.train_step()
    torch.cuda.synchronize(trainer.device)
    warm_s = time.perf_counter() - t_compile
    # data wait: time spent inside next_batch across the timed steps
    waited = [0.0]
    orig = trainer.loader.next_batch

    def timed_next():
        t0 = time.perf_counter()
        out = orig()
        waited[0] += time.perf_counter() - t0
        return out

    trainer.loader.next_batch = timed_next
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    torch.cuda.synchronize(trainer.device)
    dt = (time.perf_counter() - t0) / steps
    tokens = trainer.tokens_per_step
    tps = tokens / dt
    result = {
        "micro_batch": micro,
        "grad_accum": trainer.local_accum,
        "seq_len": cfg.data.seq_len,
        "compile": compile_,
        "scan_backend": trainer.scan_backend,
        "params": trainer.n_params,
        "step_s": dt,
        "tokens_per_s": tps,
        "mfu": 6 * trainer.n_params * tps / peak,
        "peak_mem_gib": torch.cuda.max_memory_allocated(trainer.device) / 2**30,
        "warmup_s": warm_s,
        "data_wait_ms_per_step": waited[0] / steps * 1e3,
    }
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as prof

        with prof(activities=[ProfilerActivity.CUDA]) as p:
            trainer.train_step()
            torch.cuda.synchronize(trainer.device)
        by_cat: dict[str, float] = {}
        for evt in p.key_averages():
            us = getattr(evt, "self_device_time_total", 0) or getattr(
                evt, "self_cuda_time_total", 0
            )
            if us:
                by_cat[categorise(evt.key)] = by_cat.get(categorise(evt.key), 0.0) + us
        total = sum(by_cat.values()) or 1.0
        result["gpu_time_breakdown"] = {k: round(v / total, 4) for k, v in sorted(by_cat.items())}
        result["gpu_ms_per_step"] = total / 1e3
    trainer.close()
    del trainer
    torch.cuda.empty_cache()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--micro-batch", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--backend", default="auto", choices=["auto", "triton", "pytorch"])
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_train.py needs a CUDA GPU (the 434m step is not a CPU workload)")
    from runner.data.prepare import prepare_data

    device = torch.device("cuda")
    peak = matmul_peak_flops(device)
    data_dir = Path(tempfile.mkdtemp(prefix="bench-data-")) / "data"
    prepare_data(["stdlib"], data_dir, tokenizer="bpe:8192", max_bytes=6_000_000,
                 val_fraction=0.01, progress=False)  # fmt: skip
    import triton

    gpu = torch.cuda.get_device_name(device)
    print(
        f"GPU {gpu} | torch {torch.__version__} | triton {triton.__version__} | "
        f"measured bf16 matmul peak {peak / 1e12:.0f} TFLOP/s"
    )
    results = []
    for micro in a.micro_batch:
        r = bench_one(micro, a.steps, a.warmup, not a.no_compile, a.profile, data_dir, peak,
                      a.backend)  # fmt: skip
        results.append(r)
        print(
            f"mb {micro:>2} × accum {r['grad_accum']} × seq {r['seq_len']} | "
            f"{r['tokens_per_s'] / 1e3:7.1f}k tok/s | MFU {r['mfu'] * 100:5.1f}% | "
            f"peak mem {r['peak_mem_gib']:5.1f} GiB | step {r['step_s'] * 1e3:7.1f} ms | "
            f"data wait {r['data_wait_ms_per_step']:.2f} ms/step | compile {r['compile']} "
            f"| scan {r['scan_backend']}",
            flush=True,
        )
        if "gpu_time_breakdown" in r:
            print("   GPU time:", json.dumps(r["gpu_time_breakdown"]))
    if a.json:
        a.json.write_text(json.dumps({"peak_flops": peak, "results": results}, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
