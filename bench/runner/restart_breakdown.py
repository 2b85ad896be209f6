"""Where the time goes from `m3run launch` to the first training step, and from a SIGKILLed
worker to the first optimizer step of the worker the supervisor restarts from a checkpoint.

    PYTHONPATH=. python bench/runner/restart_breakdown.py --out OUT [--restarts cold warm] \
        [--caches DIR]
    PYTHONPATH=. python bench/runner/restart_breakdown.py --dry-run --out OUT  # CPU: the script

On one GPU it prepares a corpus from this Python's standard library sources (no download),
launches the A100 recipe as a short run on it the way a user does (`m3run launch
configs/pretrain_a100_434m.yaml --set …`: health gate, smoke test, the worker under the
supervisor), and waits for the first completed step. Then, for each restart asked for, it waits
for a complete checkpoint newer than the one last loaded and for the supervisor's verification
of it (sha256; a crash at a random step finds it done), SIGKILLs the worker, and waits for the
restarted worker's first completed step. A `cold` restart empties the compile caches
(TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR) right after the kill; a `warm` one keeps what
the earlier processes compiled. The caches start empty (a fresh directory, so the launch is a
cold start) unless --caches names a directory kept between runs. Last it stops the run
(`m3run stop`) and writes OUT/restart_breakdown.json and OUT/restart_breakdown.md, after each
measurement, so a run cut short still leaves what it measured.

Each start is split into phases from the run dir alone: the supervisor's events.jsonl (launch,
health, smoke, worker_exit, restart with its backoff, gpu_memory_wait, worker_start) and the
worker's `startup_times` record in metrics.jsonl (process start, imports done, setup start,
device ready, model initialised, optimizer built, resume start and end, compile wrapped, setup
end, first step end). "compile" is the first step less the median of the steps
logged after it. The run dir, the corpus and the caches live under --work (a temp dir by
default), never under --out: checkpoints of the 434m model are 5 GB each.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

# The helpers the bench scripts share live in bench/common, beside this script's folder.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))

import supervised as sv


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="report directory")
    ap.add_argument("--work", type=Path, help="run dir, corpus and caches (default: a temp dir)")
    ap.add_argument("--config", type=Path, help="recipe (default: the A100 one; demo on --dry-run)")
    ap.add_argument("--restarts", nargs="*", choices=["cold", "warm"], default=["cold", "warm"])
    ap.add_argument("--caches", type=Path, help="compile caches kept between runs (default: empty)")
    ap.add_argument("--corpus", type=Path, help="a prepared corpus to reuse (train/ and val/)")
    ap.add_argument("--steps", type=int, help="train.total_steps (default 400; dry run 300)")
    ap.add_argument("--interval", type=int, help="checkpoint.interval_steps (default 20; dry 5)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--budget-s", type=float, default=540.0, help="give up after this long")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny demo recipe, a small corpus")
    return ap.parse_args()


def markdown(report: dict) -> str:
    out = [f"# Start and restart times — {report['started']}", "", f"`{report['command']}`", ""]
    for m in report["measurements"]:
        out += [f"## {m['title']}", "", "| phase | s | note |", "| --- | ---: | --- |"]
        for r in m["rows"]:
            s = f"{r['s']:.2f}" if r["s"] is not None else "-"
            out.append(f"| {r['phase']} | {s} | {r['note']} |")
        out.append("")
    if report.get("error"):
        out += ["## Stopped early", "", "```", report["error"], "```"]
    return "\n".join(out) + "\n"


def main() -> int:
    a = parse_args()
    sv.check_packages("restart_breakdown.py")
    deadline = time.time() + a.budget_s
    config = a.config or (sv.DRY_RECIPE if a.dry_run else sv.RECIPE)
    work = sv.work_dirs(a.work, a.out, "m3run-restarts-")
    report = sv.report_start(work, config=str(config), measurements=[])

    def save() -> None:
        sv.write_json(a.out / "restart_breakdown.json", report)
        (a.out / "restart_breakdown.md").write_text(markdown(report))

    def measured(title: str, rows: list[dict], **extra) -> None:
        report["measurements"].append({"title": title, "rows": rows, **extra})
        print(sv.format_rows(title, rows), flush=True)
        save()

    corpus = a.corpus or work / "corpus"
    tokenizer, max_bytes = ("bpe:512", 400_000) if a.dry_run else ("bpe:8192", 6_000_000)
    report["prepare_s"] = sv.prepare_corpus(corpus, tokenizer, max_bytes, work / "prepare.log")
    caches = sv.compile_caches(a.caches or work / "caches")
    report["caches"] = caches
    steps = a.steps or (300 if a.dry_run else 400)
    interval = a.interval or (5 if a.dry_run else 20)
    sets = sv.run_overrides(corpus, steps, interval, keep_last=3)
    sets += ["supervisor.preemption_provider=none", *a.sets]
    run_dir = work / "run"
    print(f"launching {config.name} into {run_dir} (caches {caches['TRITON_CACHE_DIR']})")
    launch = sv.Launch(config, run_dir, sets, sv.child_env(**caches), work / "launch.log")
    code = 0
    try:
        first, rows = sv.launch_to_first_step(launch, "the first worker's first step", deadline)
        measured("launch to first step", rows, caches="as given" if a.caches else "empty")
        loaded = first.get("resumed_from")
        for kind in a.restarts:
            step = sv.wait_for(
                f"a complete checkpoint newer than step {loaded}",
                lambda last=loaded: sv.newer_checkpoint(run_dir, last),
                launch,
                deadline,
            )
            sv.wait_for(
                f"the supervisor's verification of checkpoint {step}",
                lambda s=step: sv.verified_by_supervisor(run_dir, s),
                launch,
                deadline,
            )
            killed, t_kill = sv.kill_worker(run_dir)
            sv.wait_gone(killed)
            step = max(sv.complete_steps(run_dir))  # one may have completed since the wait
            t_emptied = None
            if kind == "cold":
                sv.empty_caches(caches)
                t_emptied = time.time()
            new = sv.wait_for(
                f"the first step of the worker restarted after the kill of pid {killed}",
                lambda t=t_kill, old=killed: sv.started_worker(run_dir, t, exclude=old),
                launch,
                deadline,
            )
            spawn = sv.first_event(run_dir, "worker_start", t_kill, pid=new["pid"])
            note = None
            if t_emptied is not None and spawn["time"] < t_emptied:
                note = "not cold: the worker started before its caches were emptied"
            rows = sv.restart_rows(
                run_dir, t_kill, new, sv.steady_step(run_dir, new, launch, deadline)
            )
            measured(
                f"{kind} restart: SIGKILL after checkpoint step {step} to the first new step",
                rows,
                checkpoint_step=step,
                resumed_from=new.get("resumed_from"),
                warning=note,
            )
            if new.get("resumed_from") != step:
                raise sv.BenchError(
                    f"the restarted worker resumed from {new.get('resumed_from')}, not from the "
                    f"newest complete checkpoint {step}"
                )
            loaded = step
        stop = subprocess.run(
            sv.m3run("stop", str(run_dir), "--grace", "120"),
            env=sv.child_env(),
            capture_output=True,
            text=True,
            timeout=max(30.0, deadline - time.time()),
        )
        report["stop"] = {"code": stop.returncode, "launch_exit": launch.wait(60)}
    except (sv.BenchError, subprocess.TimeoutExpired) as e:
        report["error"] = str(e)
        print(f"restart_breakdown.py: {e}", file=sys.stderr)
        code = 1
    finally:
        if launch.exit_code() is None:
            launch.kill()
        save()
    print(f"report: {a.out / 'restart_breakdown.md'}")
    return code


if __name__ == "__main__":
    sys.exit(main())
