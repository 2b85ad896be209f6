"""With train.deterministic on, a run SIGKILLed and resumed reproduces the uninterrupted run.

    PYTHONPATH=. python bench/acceptance/deterministic_resume.py --out OUT [--steps 40] \
        [--kill-after 15]
    PYTHONPATH=. python bench/acceptance/deterministic_resume.py --dry-run --out OUT  # CPU

On one GPU it launches the same short supervised run twice, as a user does (`m3run launch`): the
demo model on CUDA with bf16 autocast, torch.compile and the Triton scan, packed documents with
resets, `train.deterministic=true`. The reference runs to its end; the other is SIGKILLed once
it has logged --kill-after steps (between two checkpoints, so steps are replayed), and the
supervisor restarts it from its newest checkpoint. Then every logged loss and the final weights
of the two are compared bitwise. With --default-too a third run, uninterrupted and with the mode
off, shows whether the default mode gives the same numbers and what the mode costs at this size
(tokens/s from the heartbeat records). OUT gets deterministic_resume.json; exit 0 when every loss
and weight matched.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

# The helpers the bench scripts share live in bench/common, beside this script's folder.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))

import supervised as sv


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="report directory")
    ap.add_argument("--work", type=Path, help="run dirs and corpus (default: a temp dir)")
    ap.add_argument("--steps", type=int, default=40, help="train.total_steps")
    ap.add_argument("--interval", type=int, default=10, help="checkpoint.interval_steps")
    ap.add_argument("--kill-after", type=int, default=15, help="SIGKILL after this many steps")
    ap.add_argument("--default-too", action="store_true", help="also a run with the mode off")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--budget-s", type=float, default=540.0, help="give up after this long")
    ap.add_argument("--dry-run", action="store_true", help="CPU, fp32, eager: checks the script")
    a = ap.parse_args()
    if not 0 < a.interval < a.kill_after < a.steps:
        ap.error(
            f"need 0 < --interval < --kill-after < --steps, got {a.interval}, {a.kill_after}, "
            f"{a.steps}: the kill must come after a checkpoint and before the end"
        )
    if a.kill_after % a.interval == 0:
        ap.error(f"--kill-after {a.kill_after} is a checkpoint step: pick one between two")
    return a


def train_records(run_dir: Path) -> dict[int, dict]:
    """step → the last train record logged for it (a replayed step logs again)."""
    return {r["step"]: r for r in sv.metrics(run_dir) if r.get("kind") == "train"}


def final_weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    from m3run.runner.checkpoint.layout import MODEL_FILE, latest_complete

    info = latest_complete(run_dir)
    if info is None:
        raise sv.BenchError(f"{run_dir} holds no complete checkpoint")
    return load_file(str(info.path / MODEL_FILE))


def max_weight_diff(a: dict, b: dict) -> float:
    if a.keys() != b.keys():
        raise sv.BenchError("the two runs' final checkpoints hold different tensors")
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def main() -> int:
    a = parse_args()
    sv.check_packages("deterministic_resume.py", ("safetensors",))
    deadline = time.time() + a.budget_s
    work = sv.work_dirs(a.work, a.out, "m3run-determinism-")
    corpus = work / "corpus"
    sv.prepare_corpus(corpus, "bpe:512", 400_000, work / "prepare.log")
    base = sv.run_overrides(corpus, a.steps, a.interval, keep_last=a.steps // a.interval + 1)
    base += [
        "supervisor.preemption_provider=none",
        "supervisor.backoff_initial_s=0.5",
        "model.vocab_size=512",
        "data.reset_at_eos=true",
    ]
    if a.dry_run:
        base += ["train.device=cpu", "train.precision=fp32", "train.compile=false"]
    else:
        base += [
            "train.device=cuda",
            "train.precision=bf16",
            "train.compile=true",
            "model.scan_backend=triton",
        ]
    base += a.sets
    env = sv.child_env(**sv.compile_caches(work / "caches"))
    report = sv.report_start(work, overrides=base)

    def run(name: str, deterministic: bool, kill: bool) -> Path:
        run_dir = work / name
        sets = [*base, f"train.deterministic={'true' if deterministic else 'false'}"]
        launch = sv.Launch(sv.DRY_RECIPE, run_dir, sets, env, work / f"{name}.log")
        t0 = time.time()
        try:
            if kill:
                sv.wait_for(
                    f"step {a.kill_after} of {name}",
                    lambda: max(train_records(run_dir), default=0) >= a.kill_after or None,
                    launch,
                    deadline,
                    poll_s=0.05,
                )
                killed, _ = sv.kill_worker(run_dir)
                report[f"{name}_killed"] = {
                    "pid": killed,
                    "after_step": max(train_records(run_dir)),
                }
                print(
                    f"{name}: SIGKILL worker pid {killed} after step {max(train_records(run_dir))}"
                )
            code = launch.wait(max(1.0, deadline - time.time()))
        except BaseException:
            launch.kill()
            raise
        if code != 0:
            raise sv.BenchError(
                f"{name}: `m3run launch` exited {code}; last lines:\n{launch.tail()}"
            )
        recs = train_records(run_dir)
        rates = [r["tokens_per_s"] for s, r in sorted(recs.items())[2:] if r.get("tokens_per_s")]
        report[name] = {
            "seconds": round(time.time() - t0, 1),
            "steps": len(recs),
            "tokens_per_s": statistics.median(rates) if rates else None,
        }
        print(f"{name}: exit 0, {len(recs)} steps in {report[name]['seconds']} s")
        return run_dir

    code = 1
    try:
        ref = run("reference", deterministic=True, kill=False)
        chaos = run("killed", deterministic=True, kill=True)
        restarts = [e for e in sv.events(chaos) if e.get("event") == "restart"]
        report["resumed_from"] = [
            r.get("step") for r in sv.metrics(chaos) if r.get("kind") == "resume"
        ]
        la, lb = train_records(ref), train_records(chaos)
        same = [s for s in la if lb.get(s, {}).get("loss") == la[s]["loss"]]
        diff = max_weight_diff(final_weights(ref), final_weights(chaos))
        report["restarts"] = len(restarts)
        report["bitwise_equal_losses"] = f"{len(same)}/{len(la)}"
        report["final_weights_max_abs_diff"] = diff
        print(
            f"restarts: {len(restarts)}, resumed from step(s) {report['resumed_from']}; "
            f"bitwise-equal losses {len(same)}/{len(la)}; final weights max |ref - killed| = "
            f"{diff:.3g}"
        )
        ok = len(restarts) == 1 and len(same) == len(la) == a.steps and diff == 0.0
        if a.default_too:
            plain = run("default_mode", deterministic=False, kill=False)
            lp = train_records(plain)
            report["default_mode_equal_losses"] = sum(
                lp.get(s, {}).get("loss") == la[s]["loss"] for s in la
            )
            det, off = report["reference"]["tokens_per_s"], report["default_mode"]["tokens_per_s"]
            if det and off:
                report["deterministic_speed_ratio"] = det / off
            print(
                f"default mode: {report['default_mode_equal_losses']}/{len(la)} losses equal "
                f"to the deterministic run; tokens/s deterministic / default = "
                f"{report.get('deterministic_speed_ratio', float('nan')):.3f}"
            )
        code = 0 if ok else 1
        report["verdict"] = "reproduced bitwise" if ok else "NOT reproduced"
        print(report["verdict"])
    except sv.BenchError as e:
        report["error"] = str(e)
        print(f"deterministic_resume.py: {e}", file=sys.stderr)
    finally:
        sv.write_json(a.out / "deterministic_resume.json", report)
    return code


if __name__ == "__main__":
    sys.exit(main())
