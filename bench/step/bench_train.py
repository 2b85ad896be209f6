"""Throughput of m3run's real training step (the worker's `Trainer.train_step`).

    python bench/step/bench_train.py --micro-batch 8 16 [--steps 10] [--no-compile] [--profile]
    PYTHONPATH=.:<dir holding mamba_ssm/> python bench/step/bench_train.py --micro-batch 16 --anchor
        [--variant whole:train.compile_scope=model --variant h2:bwd_chunk.hpp=2]
    python bench/step/bench_train.py --dry-run --anchor      # the script itself, on CPU, in seconds

For each micro-batch size it builds the worker exactly as `m3run train` does (model, chunked
linear cross-entropy, AdamW, accumulation, bf16 autocast, torch.compile) from the A100 recipe,
times the first step (compilation) on its own, runs the other warm-up steps, then times
optimizer steps and prints tokens/s, MFU against the bf16 matmul peak measured in the same run,
peak memory, and (with --profile [N]) a breakdown of GPU time by kind of kernel, the N
kernels that take most, and the GPU's idle time with its N largest gaps and the kernels on
either side of each (where the host, not the GPU, sets the pace), over two profiled steps run
back to back as in training, so that the wait between steps is counted too. Data comes from a
small corpus prepared on the spot with the recipe's sequence length, so the data path is the
real one too. Each result lists its timed steps one by one and the Python collections that
ran among them; --trace DIR then runs two more steps under torch.profiler with the host's
threads and operator shapes and writes them as a gzipped Chrome trace, which
bench/step/trace_report.py reads (where the GPU waited and what the host did meanwhile; each matmul
shape's calls, time and TFLOP/s).

--anchor also trains, in the same process and at the same micro-batch, accumulation, autocast,
compile mode and fused AdamW, a same-size LM whose mixer is the official mamba_ssm Mamba-3
module (bench/step/anchor_lm.py), and prints its line and the ratio ours / official. Its Triton
autotuner runs in its first step, which can take minutes: that step is reported apart.

--variant NAME:KEY=VALUE,... (repeatable) then trains ours again under config overrides
(``train.compile_scope=model``), scan launch-plan edits (``bwd_chunk.hpp=2``, the fields of
bench_scan_gpu.py's --variant) and the trainer's options (``@overlap=0``: no forward run ahead
of the step's host read, no update beside it), printed as ours[NAME] with its ratio to ours and
to the anchor: a candidate is timed in the step, beside the official module, in one call.

--dry-run runs the same code on CPU with the tiny demo recipe in fp32 without compilation, and
the anchor on m3run's own mixer in place of the official one (whose kernels need a GPU); when
the official module is importable, its parameter count at the run's shapes is checked against
ours. It checks the script, not speed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# The helpers the bench scripts share live in bench/common, beside this script's folder.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))

import torch
from plan_edits import edited_plan, parse_variant
from step_probes import (
    PROFILED_STEPS,
    device_spans,
    host_trace,
    idle_gaps,
    kernel_rows,
    matmul_peak_flops,
    sync,
    timed_steps,
    timing_lines,
)

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "configs" / "pretrain_a100_434m.yaml"
DRY_RECIPE = REPO / "configs" / "demo_cpu.yaml"
# The Trainer's keyword options a --variant may set (``@NAME=0|1``): what the worker always runs
# on, turned off to time what it saves.
TRAINER_OPTIONS = ("overlap",)


def trainer_option(item: str, spec: str) -> tuple[str, bool]:
    """``@NAME=0|1`` of a --variant → (NAME, on), NAME one of TRAINER_OPTIONS, or exit."""
    name, _, value = item[1:].partition("=")
    if name not in TRAINER_OPTIONS or value not in ("0", "1"):
        raise SystemExit(
            f"--variant {spec!r}: {item!r} is not @NAME=0|1 with NAME one of "
            f"{', '.join(TRAINER_OPTIONS)}"
        )
    return name, value == "1"


def run_config(
    recipe: Path,
    micro: int,
    accum: int,
    compile_: bool,
    data_dir: Path,
    backend: str,
    dry_run: bool,
    resets: bool = True,
    scope: str = "blocks",
    sets: tuple[str, ...] = (),
):
    """The recipe with the benchmark's batch, compile (``train.compile_scope``) and backend, on
    the prepared corpus, with the scan state reset after every EOS (``data.reset_at_eos``) or
    not, and the caller's ``KEY=VALUE`` overrides last."""
    from m3run.runner.config import load_config

    overrides = [
        f"train.micro_batch_size={micro}",
        f"train.grad_accum_steps={accum}",
        f"train.compile={'true' if compile_ else 'false'}",
        f"train.compile_scope={scope}",
        "data.sources=null",
        f"data.train_path={data_dir / 'train'}",
        f"data.val_path={data_dir / 'val'}",
        "eval.interval_steps=0",
        f"model.scan_backend={backend}",
        f"data.reset_at_eos={'true' if resets else 'false'}",
    ]
    if dry_run:
        overrides += ["train.device=cpu", "train.precision=fp32"]
    return load_config(recipe, [*overrides, *sets])


def bench_one(
    cfg,
    steps: int,
    warmup: int,
    profile: int,
    peak: float | None,
    trace: Path | None = None,
    label: str = "",
    options: dict[str, bool] | None = None,
) -> dict:
    from m3run.runner.worker.trainer import Trainer

    micro = cfg.train.micro_batch_size
    run_dir = Path(tempfile.mkdtemp(prefix=f"bench-mb{micro}-"))
    trainer = Trainer(cfg, run_dir, resume="none", force=True, **(options or {}))
    trainer.setup()
    trainer.model.train()
    cuda = trainer.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(trainer.device)
    t0 = time.perf_counter()
    trainer.train_step()
    sync(trainer.device)
    first_s = time.perf_counter() - t0
    t_warm = time.perf_counter()
    for _ in range(warmup - 1):
        trainer.train_step()
    sync(trainer.device)
    warm_s = time.perf_counter() - t_warm
    # data wait: time spent reading batches across the timed steps (in peek_batch, which
    # next_batch calls and the step's run-ahead forward reads through)
    waited = [0.0]
    orig = trainer.loader.peek_batch

    def timed_peek():
        t0 = time.perf_counter()
        out = orig()
        waited[0] += time.perf_counter() - t0
        return out

    trainer.loader.peek_batch = timed_peek
    # Each step ends with the host's read of its loss, so the host's step-to-step times are the
    # steps' own: a slow one (a Python collection, a late batch, a lower clock) shows apart.
    timed = timed_steps(trainer.train_step, steps, trainer.device)
    out, dt = timed.pop("last"), timed.pop("step_s")
    tokens = trainer.tokens_per_step
    tps = tokens / dt
    result = {
        "impl": "ours"
        + ("" if cfg.data.reset_at_eos else ", no resets")
        + (", whole" if cfg.train.compile and cfg.train.compile_scope == "model" else ""),
        "micro_batch": micro,
        "grad_accum": trainer.local_accum,
        "seq_len": cfg.data.seq_len,
        "compile": cfg.train.compile,
        "compile_scope": cfg.train.compile_scope,
        "scan_backend": trainer.scan_backend,
        "params": trainer.n_params,
        "step_s": dt,
        "tokens_per_s": tps,
        "mfu": 6 * trainer.n_params * tps / peak if peak else None,
        "peak_mem_gib": torch.cuda.max_memory_allocated(trainer.device) / 2**30 if cuda else None,
        "first_step_s": first_s,
        "warmup_s": warm_s,
        "data_wait_ms_per_step": waited[0] / steps * 1e3,
        **timed,
        "last_loss": out.get("loss"),
    }
    if profile and cuda:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as prof

        # Two steps back to back, as the timed loop runs them, so that the GPU's wait between
        # one step's last kernel and the next one's first is in the span; times are per step.
        with prof(activities=[ProfilerActivity.CUDA]) as p:
            t0 = time.perf_counter()
            for _ in range(PROFILED_STEPS):
                trainer.train_step()
            torch.cuda.synchronize(trainer.device)
            wall_ms = (time.perf_counter() - t0) * 1e3 / PROFILED_STEPS
        rows = [
            {**r, "ms": r["ms"] / PROFILED_STEPS, "calls": r["calls"] // PROFILED_STEPS}
            for r in kernel_rows(p.key_averages())
        ]
        by_cat: dict[str, float] = {}
        for row in rows:
            by_cat[row["kind"]] = by_cat.get(row["kind"], 0.0) + row["ms"]
        total = sum(by_cat.values()) or 1.0
        result["gpu_time_breakdown"] = {k: round(v / total, 4) for k, v in sorted(by_cat.items())}
        result["gpu_ms_per_step"] = total
        result["profiled_step_ms"] = wall_ms
        result["top_kernels"] = [{**r, "ms": round(r["ms"], 3)} for r in rows[:profile]]
        result["gpu_idle"] = idle_gaps(device_spans(p.events()), top=profile)
    if trace:
        name = result["impl"] + (f"[{label}]" if label else "")
        result["trace"] = str(host_trace(trainer, trace, name))
    trainer.close()
    del trainer
    # Compiled graphs and their caches go too: the next model (another micro-batch, the
    # anchor) compiles from scratch and finds the GPU memory free.
    torch._dynamo.reset()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def line(r: dict) -> str:
    mfu = f"MFU {r['mfu'] * 100:5.1f}%" if r["mfu"] is not None else "MFU    -"
    mem = (
        f"peak mem {r['peak_mem_gib']:5.1f} GiB" if r["peak_mem_gib"] is not None else "peak mem -"
    )
    extra = f" | scan {r['scan_backend']}" if "scan_backend" in r else ""
    if r["compile"] and "compile_scope" in r:
        extra = f" ({r['compile_scope']}){extra}"
    return (
        f"{r['impl']:15} mb {r['micro_batch']:>2} × accum {r['grad_accum']} × seq {r['seq_len']} | "
        f"{r['tokens_per_s'] / 1e3:7.1f}k tok/s | {mfu} | {mem} | step {r['step_s'] * 1e3:7.1f} ms"
        f" | first step {r['first_step_s']:6.1f} s | data wait {r['data_wait_ms_per_step']:.2f} "
        f"ms/step | compile {r['compile']}{extra}"
    )


def anchor_factory(cfg, dry_run: bool):
    """layer index -> the anchor's mixer: the official module, or under --dry-run ours (the
    official kernels need a GPU), after checking the official module's parameter count at
    these shapes when it is importable."""
    from anchor_lm import AnchorLM, AnchorUnavailable, official_mixer_factory

    from m3run.model.mixer import Mamba3Mixer

    try:
        official = official_mixer_factory(cfg.model)
    except AnchorUnavailable as e:
        if not dry_run:
            raise SystemExit(f"bench_train.py --anchor: {e}") from None
        print(f"dry run: official module not checked ({e})")
        official = None
    if official is not None:
        with torch.device("meta"):
            theirs = AnchorLM(cfg.model, official).num_params()
            ours = AnchorLM(cfg.model, lambda i: Mamba3Mixer(cfg.model, i)).num_params()
        if theirs != ours:
            raise SystemExit(
                f"bench_train.py --anchor: the official-mixer LM has {theirs:,} parameters "
                f"against {ours:,} for ours at the same shapes: the constructor mapping in "
                "bench/step/anchor_lm.py (official_mixer_kwargs) no longer matches"
            )
        print(f"anchor: official Mamba-3 mixer, {theirs:,} parameters (ours: the same)")
    if dry_run:
        print("dry run: the anchor trains m3run's own mixer in place of the official one")
        return lambda i: Mamba3Mixer(cfg.model, i)
    return official


def run_anchor(cfg, make_mixer, device, steps: int, warmup: int, peak, impl: str) -> dict:
    """bench_anchor under the recipe's compile mode; if torch.compile cannot take the official
    module, the reason in one line and the anchor timed eagerly instead (labelled so)."""
    from anchor_lm import bench_anchor

    try:
        return bench_anchor(cfg, make_mixer, device, steps, warmup, peak, impl)
    except Exception as e:
        if not cfg.train.compile:
            raise
        first = (str(e).strip().splitlines() or [""])[0][:200]
        print(
            f"anchor: under torch.compile it failed ({type(e).__name__}: {first}); "
            "timing it without compilation",
            flush=True,
        )
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    eager = cfg.model_copy(update={"train": cfg.train.model_copy(update={"compile": False})})
    return bench_anchor(eager, make_mixer, device, steps, warmup, peak, f"{impl}-eager")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--micro-batch", type=int, nargs="+", default=None, help="default 8 16")
    ap.add_argument("--accum", type=int, default=None, help="default 32 / micro-batch")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 10)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps, the first included")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument(
        "--profile",
        type=int,
        nargs="?",
        const=20,
        default=0,
        metavar="N",
        help="profile two steps: GPU time by kind, the N kernels that take most and the N "
        "largest idle gaps (default 20)",
    )
    ap.add_argument(
        "--trace",
        type=Path,
        metavar="DIR",
        help="after the timings, two steps of each of ours under torch.profiler with the host's "
        "threads and operator shapes, as DIR/trace-<impl>.json.gz (Chrome trace format)",
    )
    ap.add_argument("--backend", default="auto", choices=["auto", "triton", "pytorch"])
    ap.add_argument("--anchor", action="store_true", help="also the official-module LM")
    ap.add_argument(
        "--resets",
        choices=("on", "off", "both"),
        default="on",
        help="ours with data.reset_at_eos on (the default), off, or both (the cost of resets)",
    )
    ap.add_argument(
        "--compile-scope",
        choices=("blocks", "model", "both"),
        default="blocks",
        help="ours with train.compile_scope blocks (the default), model, or both (first blocks)",
    )
    ap.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for ours, e.g. train.deterministic=true (its cost); process-wide "
        "switches such as that one stay on for every later run of the process",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE,...",
        help="after the anchor, also ours with these config overrides (on top of --set), "
        "scan launch-plan edits (KERNEL.FIELD=VALUE, e.g. bwd_chunk.hpp=2) and trainer options "
        f"(@NAME=0|1, NAME one of {', '.join(TRAINER_OPTIONS)}), as ours[NAME] (repeatable)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        metavar="N",
        help="with --anchor: time ours and the official LM N times, alternating, and print "
        "each round's ratio and the median (default 1)",
    )
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny recipe: checks the script")
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args()
    if a.steps is not None and a.steps < 1:
        raise SystemExit(f"--steps must be ≥ 1, got {a.steps}")
    if a.warmup < 1:
        raise SystemExit(f"--warmup must be ≥ 1 (the first step is timed apart), got {a.warmup}")
    if a.rounds < 1 or (a.rounds > 1 and not a.anchor):
        raise SystemExit(f"--rounds must be ≥ 1 and needs --anchor beyond 1, got {a.rounds}")
    # (name, config overrides, plan edits, trainer options); a misspelt option fails now, not
    # after the anchor's minutes.
    variants = []
    for spec in a.variant:
        name, sets, edits = parse_variant(spec, config_keys=True)
        options = dict(trainer_option(s, spec) for s in sets if s.startswith("@"))
        variants.append((name, [s for s in sets if not s.startswith("@")], edits, options))
    micro_batches = a.micro_batch or ([4] if a.dry_run else [8, 16])
    steps = a.steps or (2 if a.dry_run else 10)
    if not a.dry_run and not torch.cuda.is_available():
        raise SystemExit(
            "bench_train.py needs a CUDA GPU (the 434m step is not a CPU workload); "
            "--dry-run checks the script on CPU"
        )
    from m3run.runner.data.prepare import prepare_data

    device = torch.device("cpu" if a.dry_run else "cuda")
    recipe = DRY_RECIPE if a.dry_run else RECIPE
    data_dir = Path(tempfile.mkdtemp(prefix="bench-data-")) / "data"
    vocab, max_bytes = ("bpe:512", 400_000) if a.dry_run else ("bpe:8192", 6_000_000)
    prepare_data(
        ["stdlib"],
        data_dir,
        tokenizer=vocab,
        max_bytes=max_bytes,
        val_fraction=0.01,
        progress=False,
    )
    if a.dry_run:
        peak = None
        print(f"dry run on CPU | torch {torch.__version__} | recipe {recipe.name}")
    else:
        import triton

        peak = matmul_peak_flops(device)
        print(
            f"GPU {torch.cuda.get_device_name(device)} | torch {torch.__version__} | triton "
            f"{triton.__version__} | measured bf16 matmul peak {peak / 1e12:.0f} TFLOP/s"
        )
    results: list[dict] = []

    def keep(result: dict) -> None:
        """Each result is written as soon as it exists: a later failure keeps the earlier ones."""
        results.append(result)
        if a.json:
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(json.dumps({"peak_flops": peak, "results": results}, indent=2))

    compile_ = not a.no_compile and not a.dry_run
    backend = "pytorch" if a.dry_run else a.backend
    for micro in micro_batches:
        accum = a.accum or (2 if a.dry_run else max(1, 32 // micro))
        scope = "model" if a.compile_scope == "model" else "blocks"

        def ours(
            resets: bool,
            scope: str,
            micro: int = micro,
            accum: int = accum,
            variant: tuple[str, list[str], dict, dict[str, bool]] | None = None,
        ) -> dict:
            name, sets, edits, options = variant or ("", [], {}, {})
            c = run_config(
                recipe,
                micro,
                accum,
                compile_,
                data_dir,
                backend,
                a.dry_run,
                resets=resets,
                scope=scope,
                sets=(*a.sets, *sets),
            )
            with edited_plan(edits):
                res = bench_one(c, steps, a.warmup, a.profile, peak, a.trace, name, options)
            if name:
                res["impl"] += f"[{name}]"
                res["variant"] = {"sets": sets, "plan_edits": edits, "trainer": options}
            keep(res)
            print(line(res), flush=True)
            for text in timing_lines(res):
                print(f"   {text}", flush=True)
            if "gpu_time_breakdown" in res:
                print("   GPU time:", json.dumps(res["gpu_time_breakdown"]))
                print(
                    f"   {res['gpu_ms_per_step']:.1f} ms of GPU time a step in a profiled "
                    f"{res['profiled_step_ms']:.1f} ms ({PROFILED_STEPS} steps back to back, "
                    "times per step); top kernels:"
                )
                for k in res["top_kernels"]:
                    print(f"   {k['ms']:9.3f} ms {k['calls']:5d}× {k['kind']:18} {k['kernel']}")
                idle = res["gpu_idle"]
                print(
                    f"   GPU idle {idle['idle_ms']:.1f} ms of the steps' {idle['span_ms']:.1f} "
                    f"ms span, {idle['gaps_ms']:.1f} ms of it in {idle['gaps']} gaps of 20 µs "
                    "or more; largest:"
                )
                for g in idle["largest"]:
                    print(f"   {g['us']:9.1f} µs after {g['after']} | before {g['before']}")
            return res

        # The anchor's import fails before minutes are spent on ours.
        cfg = run_config(recipe, micro, accum, compile_, data_dir, backend, a.dry_run)
        make_mixer = anchor_factory(cfg, a.dry_run) if a.anchor else None
        r = ours(a.resets != "off", scope)
        if a.resets == "both":
            r_off = ours(False, scope)
            print(
                f"resets on / off at mb {micro}: step time {r['step_s'] / r_off['step_s']:.3f}×",
                flush=True,
            )
        if make_mixer is not None:
            impl = "stand-in" if a.dry_run else "official"
            ratios = []
            for round_ in range(1, a.rounds + 1):
                if round_ > 1:
                    r = ours(a.resets != "off", scope)
                o = run_anchor(cfg, make_mixer, device, steps, a.warmup, peak, impl)
                keep(o)
                print(line(o), flush=True)
                for text in timing_lines(o):
                    print(f"   {text}", flush=True)
                mem = (
                    f", peak memory {r['peak_mem_gib'] / o['peak_mem_gib']:.2f}×"
                    if r["peak_mem_gib"] and o["peak_mem_gib"]
                    else ""
                )
                ratios.append(r["tokens_per_s"] / o["tokens_per_s"])
                of = f" (round {round_} of {a.rounds})" if a.rounds > 1 else ""
                print(
                    f"ours / {impl} at mb {micro}{of}: tokens/s {ratios[-1]:.3f}×{mem}", flush=True
                )
            if a.rounds > 1:
                each = " ".join(f"{x:.3f}" for x in ratios)
                print(
                    f"ours / {impl} at mb {micro} over {a.rounds} rounds: median "
                    f"{statistics.median(ratios):.3f}×, min {min(ratios):.3f}× ({each})",
                    flush=True,
                )
        # After the anchor: its line matters more than these if the time runs out.
        for variant in variants:
            rv = ours(a.resets != "off", scope, variant=variant)
            against = (
                f", / {impl} {rv['tokens_per_s'] / o['tokens_per_s']:.2f}×" if make_mixer else ""
            )
            print(
                f"ours[{variant[0]}] / ours at mb {micro}: tokens/s "
                f"{rv['tokens_per_s'] / r['tokens_per_s']:.3f}×{against}",
                flush=True,
            )
        if a.compile_scope == "both" and compile_:
            r_whole = ours(a.resets != "off", "model")
            first = f"{r['first_step_s']:.1f} s / {r_whole['first_step_s']:.1f} s"
            ratio = r["step_s"] / r_whole["step_s"]
            print(
                f"compile scope blocks / model at mb {micro}: step time {ratio:.3f}×, "
                f"first step {first}",
                flush=True,
            )


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
