"""What the model learns per token: Mamba3LM against the same LM on the official Mamba-3 module.

    PYTHONPATH=.:<dir holding mamba_ssm/> python3 bench/step/bench_quality.py
        [--seeds 0 1 2] [--steps 500] [--micro-batch 8] [--models official ours]
        [--variant softplus:model.A_activation=softplus] [--data DIR] [--json FILE]
    PYTHONPATH=. python3 bench/step/bench_quality.py --dry-run     # the script, on CPU

Every model trains in this one process on one token stream (the same windows in the same
order for every model and seed), with the same loop: AdamW over the same parameter groups
(runner.worker.build.build_optimizer), the worker's learning-rate schedule (warmup, cosine),
gradient clipping, bf16 autocast, torch.compile in the recipe's mode, one micro-batch size.
Only the init seed changes from run to run; all models draw their non-mixer weights by the
same rule (bench/step/anchor_lm.py). Per run it prints the mean training loss of the last 25 steps
and the loss on a fixed held-out set, then per model their mean and spread over the seeds and
the difference from the official module.

Models (--models, in this order within each seed):
- ``official``: AnchorLM around the official mamba_ssm Mamba3 module (its Triton kernels);
- ``ours``: Mamba3LM, as the worker builds and compiles it (our scan, fused block kernels,
  chunked cross-entropy);
- ``ours-in-anchor``: our mixer inside AnchorLM's plain PyTorch block, which separates what
  the mixer learns from what our fused block kernels do;
- ``--variant NAME:KEY=VALUE,...`` adds ours[NAME] under config overrides (model.* or train.*).

The corpus is prepared on the spot with m3run's own prepare-data and a byte-level BPE
tokenizer trained on it (Python's standard library sources unless --text names other local
text; nothing is downloaded), or read from --data, a folder an earlier call prepared. Windows
are not reset at document ends (data.reset_at_eos off) for any model: the official module's
training path takes none. The model's vocabulary is the tokenizer's.

--dry-run runs the same code on CPU with the tiny demo recipe in fp32 without compilation, the
official module replaced by ours (its kernels need a GPU): it checks the script, not quality.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# The helpers the bench scripts share live in bench/common, beside this script's folder.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))

import torch
from plan_edits import parse_variant
from step_probes import sync

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "configs" / "pretrain_a100_434m.yaml"
DRY_RECIPE = REPO / "configs" / "demo_cpu.yaml"
# The training loss reported for a run: the mean over its last LAST_STEPS steps.
LAST_STEPS = 25
MODELS = ("official", "ours", "ours-in-anchor")


def prepare(a: argparse.Namespace) -> Path:
    """The corpus: --data as it is, or a fresh one from --text (or the stdlib) in a temp dir."""
    if a.data is not None and (a.data / "train" / "manifest.json").exists():
        print(f"data: {a.data} (prepared earlier)", flush=True)
        return a.data
    from m3run.runner.data.prepare import prepare_data

    out = a.data or Path(tempfile.mkdtemp(prefix="bench-quality-")) / "data"
    vocab, max_bytes = ("bpe:512", 400_000) if a.dry_run else (a.tokenizer, a.max_bytes)
    t0 = time.perf_counter()
    summary = prepare_data(
        a.text or ["stdlib"],
        out,
        tokenizer=vocab,
        max_bytes=max_bytes,
        val_fraction=a.val_fraction,
        progress=False,
        skip_bad=a.skip_bad,
    )
    print(
        f"data: {out} from {' '.join(a.text or ['stdlib'])}, tokenizer {vocab}, "
        f"{time.perf_counter() - t0:.1f} s: {json.dumps(summary, default=str)[:300]}",
        flush=True,
    )
    return out


def run_config(a: argparse.Namespace, data_dir: Path, sets: list[str] = ()):
    """bench_train's config (the recipe with the benchmark's batch, compile, backend and data,
    no eval) with this benchmark's schedule, sequence length and vocabulary, no resets; the
    caller's overrides last."""
    from bench_train import run_config as train_run_config

    from m3run.runner.data.loader import TokenWindows

    windows = TokenWindows(data_dir / "train", 8)
    try:
        vocab = int(windows.manifest["vocab_size"])
    finally:
        windows.close()
    ours = [
        f"model.vocab_size={vocab}",
        f"train.total_steps={a.steps}",
        f"train.warmup_steps={a.warmup}",
        f"train.lr={a.lr}",
        "train.schedule=cosine",
        f"data.seq_len={a.seq_len}",
    ]
    recipe = DRY_RECIPE if a.dry_run else RECIPE
    backend = "pytorch" if a.dry_run else "auto"
    compile_ = not (a.dry_run or a.no_compile)
    return train_run_config(
        recipe,
        a.micro_batch,
        a.accum,
        compile_,
        data_dir,
        backend,
        a.dry_run,
        resets=False,
        sets=(*ours, *sets),
    )


def build(kind: str, cfg, device: torch.device, official: Callable | None):
    """(the module, what a training step calls) for one model kind, initialised by
    cfg.train.seed."""
    from anchor_lm import AnchorLM

    from m3run.model.lm import compile_options
    from m3run.model.mixer import Mamba3Mixer
    from m3run.runner.worker.build import build_model, compile_for_training

    t = cfg.train
    if kind == "ours":
        model = build_model(cfg, device)
        return model, compile_for_training(model, t)
    make_mixer = official if kind == "official" else lambda i: Mamba3Mixer(cfg.model, i)
    torch.manual_seed(t.seed)
    with torch.device(device):
        model = AnchorLM(cfg.model, make_mixer)
    if not t.compile:
        return model, model
    return model, torch.compile(model, options=compile_options(t.compile_mode))


def train_one(kind: str, cfg, device: torch.device, official, eval_set, data_seed: int) -> dict:
    """Train one model for train.total_steps on the shared token stream; its losses."""
    from m3run.runner.data.mixture import train_loader
    from m3run.runner.schedule import lr_at
    from m3run.runner.worker.build import autocast, build_optimizer, resolve_precision

    t, d = cfg.train, cfg.data
    model, step_model = build(kind, cfg, device, official)
    model.train()
    optimizer = build_optimizer(model, device, t, lr=lr_at(cfg, 1), eps=t.eps)
    amp = resolve_precision(cfg, device)
    loader = train_loader(
        d.train_path,
        None,
        d.seq_len,
        t.micro_batch_size,
        data_seed,
        rank=0,
        world_size=1,
        prefetch=d.prefetch,
        pin_memory=device.type == "cuda",
        force=False,
    )
    losses: list[torch.Tensor] = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    timed_from, diverged = None, None
    try:
        for step in range(1, t.total_steps + 1):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(cfg, step)
            loss_sum = torch.zeros((), device=device)
            for _ in range(t.grad_accum_steps):
                x, y = loader.next_batch()
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with autocast(device, amp):
                    loss = step_model(x, y)
                (loss / t.grad_accum_steps).backward()
                loss_sum += loss.detach().float()
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss_sum / t.grad_accum_steps)
            if step == min(10, t.total_steps):  # compilation and autotuning are behind us
                sync(device)
                timed_from = (step, time.perf_counter())
            if step % 50 == 0 and not math.isfinite(float(losses[-1])):
                diverged = step
                break
        sync(device)
        wall = time.perf_counter() - t0
        step0, t_start = timed_from
        steps_timed = len(losses) - step0
        tokens_per_step = t.micro_batch_size * t.grad_accum_steps * d.seq_len
        tps = steps_timed * tokens_per_step / (time.perf_counter() - t_start) if steps_timed else 0
        curve = torch.stack(losses).tolist()
        held_out = evaluate(model, eval_set, device, amp)
    finally:
        loader.close()
    params = sum(p.numel() for p in model.parameters())
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    del model, step_model, optimizer
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "params": params,
        "steps": len(curve),
        "diverged_at": diverged,
        "train_loss": statistics.fmean(curve[-LAST_STEPS:]),
        "held_out_loss": held_out,
        "first_loss": curve[0],
        "tokens_per_s": tps,
        "peak_mem_gib": peak,
        "wall_s": wall,
        "curve": [round(v, 4) for v in curve],
    }


@torch.no_grad()
def evaluate(model, eval_set, device: torch.device, amp) -> float:
    """Mean loss over the fixed held-out batches in eval mode, under autocast, eagerly (the
    blocks that ours compiled in place run their Python code: no inference graphs to compile)."""
    from m3run.runner.worker.build import autocast

    model.eval()
    total = 0.0
    with torch.compiler.set_stance("force_eager"):
        for x, y in eval_set:
            with autocast(device, amp):
                total += float(model(x.to(device), y.to(device)))
    return total / len(eval_set)


def spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    sd = statistics.stdev(values)
    return f"{statistics.fmean(values):.4f} ± {sd:.4f} (range {max(values) - min(values):.4f})"


def summary(results: list[dict]) -> list[str]:
    """Per model: mean and spread over seeds; the difference in means from the official."""
    by_model: dict[str, list[dict]] = {}
    for r in results:
        by_model.setdefault(r["model"], []).append(r)
    ref = by_model.get("official") or by_model.get("stand-in")
    lines = []
    for name, runs in by_model.items():
        held = [r["held_out_loss"] for r in runs]
        train = [r["train_loss"] for r in runs]
        seeds = " ".join(str(r["seed"]) for r in runs)
        diff = ""
        if ref is not None and runs is not ref:
            ref_held = statistics.fmean(r["held_out_loss"] for r in ref)
            ref_train = statistics.fmean(r["train_loss"] for r in ref)
            diff = (
                f" | Δ held-out {statistics.fmean(held) - ref_held:+.4f}, Δ train "
                f"{statistics.fmean(train) - ref_train:+.4f} nats"
            )
        lines.append(
            f"{name:22} seeds {seeds:8} | held-out {spread(held)} | train (last "
            f"{LAST_STEPS}) {spread(train)}{diff}"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=None, help="init seeds (0 1 2)")
    ap.add_argument("--data-seed", type=int, default=0, help="the token stream's order")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default 500)")
    ap.add_argument("--warmup", type=int, default=None, help="warmup steps (default steps/10)")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (1e-3)")
    ap.add_argument("--micro-batch", type=int, default=None, help="default 8 (dry run 2)")
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per step (1)")
    ap.add_argument("--seq-len", type=int, default=None, help="default 2048 (dry run 64)")
    ap.add_argument("--eval-batches", type=int, default=16, help="held-out micro-batches (16)")
    ap.add_argument(
        "--models", nargs="+", default=None, choices=MODELS, help="default: official ours"
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE,...",
        help="also ours under these config overrides, as ours[NAME] (repeatable)",
    )
    ap.add_argument("--data", type=Path, help="a prepared corpus to read, or where to write one")
    ap.add_argument("--text", nargs="+", help="local text to prepare (default: stdlib)")
    ap.add_argument("--tokenizer", default="bpe:8192", help="prepare-data's --tokenizer")
    ap.add_argument("--max-bytes", type=int, default=40_000_000, help="of text to prepare")
    ap.add_argument("--val-fraction", type=float, default=0.02)
    ap.add_argument("--skip-bad", action="store_true", help="prepare-data's --skip-bad")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny recipe: checks the script")
    ap.add_argument("--json", type=Path, help="also write the results here, after every run")
    a = ap.parse_args()
    a.seeds = a.seeds if a.seeds is not None else ([0, 1] if a.dry_run else [0, 1, 2])
    a.steps = a.steps or (6 if a.dry_run else 500)
    a.warmup = a.warmup or max(1, a.steps // 10)
    a.micro_batch = a.micro_batch or (2 if a.dry_run else 8)
    a.seq_len = a.seq_len or (64 if a.dry_run else 2048)
    if a.steps < LAST_STEPS and not a.dry_run:
        raise SystemExit(
            f"--steps must be ≥ {LAST_STEPS} (the reported training loss is the "
            f"mean of the last {LAST_STEPS}), got {a.steps}"
        )
    variants = []
    for spec in a.variant:
        name, sets, edits = parse_variant(spec, config_keys=True)
        if edits or any(s.startswith("@") for s in sets):
            raise SystemExit(f"--variant {spec}: only config overrides (KEY=VALUE) are taken here")
        variants.append((name, sets))
    if not a.dry_run and not torch.cuda.is_available():
        raise SystemExit("bench_quality.py needs a CUDA GPU; --dry-run checks the script on CPU")
    device = torch.device("cpu" if a.dry_run else "cuda")
    data_dir = prepare(a)
    cfg = run_config(a, data_dir)
    models = a.models or ["official", "ours"]
    official = None
    if "official" in models:
        from bench_train import anchor_factory

        official = anchor_factory(cfg, a.dry_run)  # the official module, or ours in a dry run
    from m3run.runner.data.loader import eval_batches

    eval_set = eval_batches(data_dir / "val", a.seq_len, a.micro_batch, a.eval_batches)
    tokens = a.steps * a.micro_batch * a.accum * a.seq_len
    print(
        f"{a.steps} steps × {a.micro_batch} × {a.accum} × {a.seq_len} = {tokens / 1e6:.2f}M "
        f"tokens a run, lr {a.lr} (warmup {a.warmup}, cosine), held-out "
        f"{len(eval_set) * a.micro_batch * a.seq_len / 1e3:.0f}k tokens, vocab "
        f"{cfg.model.vocab_size}, torch {torch.__version__}"
        + (f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ", CPU"),
        flush=True,
    )
    runs = [(m, m, []) for m in models] + [(f"ours[{n}]", "ours", sets) for n, sets in variants]
    results: list[dict] = []
    for seed in a.seeds:
        for name, kind, sets in runs:
            c = run_config(a, data_dir, [*sets, f"train.seed={seed}"])
            label = "stand-in" if kind == "official" and a.dry_run else name
            r = {
                "model": label,
                "kind": kind,
                "sets": sets,
                "seed": seed,
                **train_one(kind, c, device, official, eval_set, a.data_seed),
            }
            results.append(r)
            mem = f" | peak {r['peak_mem_gib']:.1f} GiB" if r["peak_mem_gib"] else ""
            bad = f" | DIVERGED at step {r['diverged_at']}" if r["diverged_at"] else ""
            print(
                f"{label:22} seed {seed} | train {r['train_loss']:.4f} | held-out "
                f"{r['held_out_loss']:.4f} | first {r['first_loss']:.3f} | "
                f"{r['tokens_per_s'] / 1e3:.1f}k tok/s | {r['wall_s']:.0f} s{mem}{bad}",
                flush=True,
            )
            if a.json:
                a.json.parent.mkdir(parents=True, exist_ok=True)
                a.json.write_text(
                    json.dumps({"args": vars(a), "results": results}, indent=1, default=str)
                )
    print("summary (mean ± sample std over seeds; Δ: mean minus the official's mean):")
    for text in summary(results):
        print(f"  {text}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
