"""A supervised run on one GPU as a user runs it, through a crash and a spot preemption.

    PYTHONPATH=. python bench/acceptance/gpu_acceptance.py --out OUT --bench-tokens-per-s 104400
    PYTHONPATH=. python bench/acceptance/gpu_acceptance.py --dry-run --out OUT   # CPU: the script

1. prepares a corpus from this Python's standard library sources (`m3run prepare-data stdlib`,
   no download);
2. `m3run launch configs/pretrain_a100_434m.yaml` as a short run on it, with the supervisor's
   preemption watcher pointed at a fake cloud metadata server on 127.0.0.1
   (`supervisor.preemption_provider` and `supervisor.metadata_url`; the server is the tests' own,
   tests/helpers/metadata_server.py);
3. once a checkpoint is complete, the supervisor has verified it, and the run is half-way to the
   next one, SIGKILLs the worker: the supervisor must restart it from that checkpoint;
4. a few steps into the restarted worker, the metadata server announces a preemption: the
   worker must save a checkpoint and exit 75, and the supervisor exit 75;
5. the notice withdrawn (a rescheduled job lands on a VM without one), the same launch again:
   it resumes from the preemption checkpoint and trains to the end (exit 0).

It reports tokens/s from the heartbeat against the benchmark figure given, each checkpoint's
training stall and write time (the worker's "saved checkpoint" lines), the restart time split
into phases (as bench/runner/restart_breakdown.py does), the preemption's save-and-exit time, every
checkpoint before and after each event with a full sha256 verification at the end (no complete
checkpoint may be lost), and the loss curve (`m3run plot`). OUT gets gpu_acceptance.json,
gpu_acceptance.md, loss.png and events.jsonl; the run dir, the corpus and the compile caches
stay under --work (a temp dir by default). Exit 0 when every check passed.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

# The helpers the bench scripts share live in bench/common, beside this script's folder.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))

import supervised as sv

SAVED = re.compile(
    r"saved checkpoint step (\d+) \(([\d.]+) MiB\): training stalled ([\d.]+)s, "
    r"written in the background in ([\d.]+)s"
)
SAVED_SYNC = re.compile(r"saved checkpoint step (\d+) in ([\d.]+)s \(([\d.]+) MiB\)")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="report directory")
    ap.add_argument("--work", type=Path, help="run dir, corpus and caches (default: a temp dir)")
    ap.add_argument("--config", type=Path, help="recipe (default: the A100 one; demo on --dry-run)")
    ap.add_argument("--bench-tokens-per-s", type=float, help="bench_train.py's figure to compare")
    ap.add_argument("--provider", choices=["gcp", "aws", "azure"], default="gcp")
    ap.add_argument("--corpus", type=Path, help="a prepared corpus to reuse (train/ and val/)")
    ap.add_argument("--steps", type=int, help="train.total_steps (default 80; dry run 60)")
    ap.add_argument("--interval", type=int, help="checkpoint.interval_steps (default 20; dry 5)")
    ap.add_argument("--keep-last", type=int, default=8, help="checkpoint.keep_last")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--budget-s", type=float, default=570.0, help="give up after this long")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny demo recipe, a small corpus")
    return ap.parse_args()


class Heartbeats:
    """heartbeat.json sampled while the scripts waits: what `m3run status` would have shown."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.samples: list[dict] = []

    def poll(self) -> None:
        from m3run.runner.runstate import read_heartbeat

        hb = read_heartbeat(self.run_dir)
        if hb is not None and (not self.samples or self.samples[-1]["ts"] != hb.ts):
            self.samples.append(hb.to_dict())

    def tokens_per_s(self) -> float | None:
        """Median over training heartbeats, each worker's first logged step (compilation)
        left out."""
        first: dict[int, int] = {}
        for s in self.samples:
            if s["phase"] == "training" and s["tokens_per_s"] and s["step"] is not None:
                first[s["pid"]] = min(first.get(s["pid"], s["step"]), s["step"])
        values = [
            s["tokens_per_s"]
            for s in self.samples
            if s["phase"] == "training" and s["tokens_per_s"] and s["step"] > first[s["pid"]]
        ]
        return statistics.median(values) if values else None


def checkpoint_table(run_dir: Path, verify: bool) -> list[dict]:
    from m3run.runner.checkpoint.layout import dir_bytes, list_checkpoints

    return [
        {
            "step": c.step,
            "complete": c.complete,
            "reason": c.reason,
            "gib": round(dir_bytes(c.path) / 2**30, 3),
        }
        for c in list_checkpoints(run_dir, verify=verify)
    ]


def saves(run_dir: Path) -> list[dict]:
    from m3run.runner.protocol import WORKER_LOG

    out = []
    for line in (run_dir / WORKER_LOG).read_text(errors="replace").splitlines():
        if m := SAVED.search(line):
            step, mib, stall, write = m.groups()
            out.append(
                {
                    "step": int(step),
                    "mib": float(mib),
                    "stall_s": float(stall),
                    "write_s": float(write),
                }
            )
        elif m := SAVED_SYNC.search(line):
            step, stall, mib = m.groups()
            out.append(
                {"step": int(step), "mib": float(mib), "stall_s": float(stall), "write_s": None}
            )
    return out


def steps_during_writes(run_dir: Path, report_saves: list[dict]) -> dict | None:
    """The step times (metrics.jsonl, one record a step, stalls excluded) of the steps that ran
    while a checkpoint was being written in the background, against the median step: the
    issue's bar is no such step slower than 1.1x the median."""
    from m3run.runner.files import read_jsonl

    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "train"]
    # Per step, the latest record (a restarted worker replays steps). A record carries tokens
    # per second; the step's time is proportional to its inverse, which is all a ratio needs.
    by_step = {r["step"]: r for r in train if r.get("tokens_per_s")}
    if len(by_step) < 3:
        return None
    times = {k: 1.0 / r["tokens_per_s"] for k, r in by_step.items()}
    median = statistics.median(times.values())
    during = set()
    for save in report_saves:
        start = by_step.get(save["step"])
        if start is None or not save.get("write_s"):
            continue
        end = start["time"] + save["stall_s"] + save["write_s"]
        during |= {k for k, r in by_step.items() if start["time"] < r["time"] <= end}
    if not during:
        return None
    slowest = max(during, key=times.__getitem__)
    return {
        "steps while writing": len(during),
        "slowest step while writing / median step": round(times[slowest] / median, 3),
        "slowest step": slowest,
    }


def lost_checkpoints(snapshots: dict[str, list[int]], final: list[int], keep_last: int) -> list:
    """Steps complete at some snapshot and gone at the end, retention aside (it keeps the
    newest keep_last)."""
    kept_from = sorted(final)[-keep_last] if len(final) >= keep_last else -1
    return sorted(
        {s for steps in snapshots.values() for s in steps if s not in final and s >= kept_from}
    )


def markdown(report: dict) -> str:
    out = [f"# GPU acceptance run — {report['started']}", "", f"`{report['command']}`", ""]
    out += ["| check | result | detail |", "| --- | --- | --- |"]
    for c in report["checks"]:
        out.append(f"| {c['check']} | {'pass' if c['ok'] else 'FAIL'} | {c['detail']} |")
    speed = report.get("speed", {})
    if speed:
        out += ["", "## Speed", ""] + [f"- {k}: {v}" for k, v in speed.items()]
    if report.get("saves"):
        out += [
            "",
            "## Checkpoints saved",
            "",
            "| step | MiB | stall s | write s |",
            "| ---: | ---: | ---: | ---: |",
        ]
        for s in report["saves"]:
            out.append(f"| {s['step']} | {s['mib']:.0f} | {s['stall_s']:.2f} | {s['write_s']} |")
    for m in report["measurements"]:
        out += ["", f"## {m['title']}", "", "| phase | s | note |", "| --- | ---: | --- |"]
        for r in m["rows"]:
            s = f"{r['s']:.2f}" if r["s"] is not None else "-"
            out.append(f"| {r['phase']} | {s} | {r['note']} |")
    if report.get("checkpoints"):
        out += ["", "## Checkpoints", ""]
        for when, table in report["checkpoints"].items():
            rows = ", ".join(
                f"{c['step']}{'' if c['complete'] else ' (incomplete)'}" for c in table
            )
            out.append(f"- {when}: {rows or 'none'}")
    if report.get("error"):
        out += ["", "## Stopped early", "", "```", report["error"], "```"]
    return "\n".join(out) + "\n"


def main() -> int:
    a = parse_args()
    sv.check_packages("gpu_acceptance.py")
    sys.path.insert(0, str(sv.REPO / "tests"))
    from helpers.metadata_server import FakeMetadataServer

    deadline = time.time() + a.budget_s
    config = a.config or (sv.DRY_RECIPE if a.dry_run else sv.RECIPE)
    work = sv.work_dirs(a.work, a.out, "m3run-acceptance-")
    steps = a.steps or (60 if a.dry_run else 80)
    interval = a.interval or (5 if a.dry_run else 20)
    report = sv.report_start(work, config=str(config), checks=[], measurements=[], checkpoints={})
    run_dir = work / "run"

    def save() -> None:
        sv.write_json(a.out / "gpu_acceptance.json", report)
        (a.out / "gpu_acceptance.md").write_text(markdown(report))

    def check(name: str, ok: bool, detail: str = "") -> None:
        report["checks"].append({"check": name, "ok": bool(ok), "detail": detail})
        print(f"{'pass' if ok else 'FAIL'}: {name}{f' ({detail})' if detail else ''}", flush=True)
        save()

    def snapshot(when: str) -> list[int]:
        table = checkpoint_table(run_dir, verify=False)
        report["checkpoints"][when] = table
        return [c["step"] for c in table if c["complete"]]

    corpus = a.corpus or work / "corpus"
    tokenizer, max_bytes = ("bpe:512", 400_000) if a.dry_run else ("bpe:8192", 6_000_000)
    report["prepare_s"] = sv.prepare_corpus(corpus, tokenizer, max_bytes, work / "prepare.log")
    env = sv.child_env(**sv.compile_caches(work / "caches"))
    beats = Heartbeats(run_dir)
    server = FakeMetadataServer(a.provider).start()
    sets = [
        *sv.run_overrides(corpus, steps, interval, a.keep_last),
        f"supervisor.preemption_provider={a.provider}",
        f"supervisor.metadata_url={server.base_url}",
        "supervisor.preemption_poll_s=0.5",
        *a.sets,
    ]
    launch = None
    snapshots: dict[str, list[int]] = {}
    code = 1
    try:
        # -- 1. launch, first step
        launch = sv.Launch(config, run_dir, sets, env, work / "launch1.log")
        _, rows = sv.launch_to_first_step(launch, "the first step", deadline, beats.poll)
        report["measurements"].append({"title": "launch to first step", "rows": rows})
        check("launch trained", True, f"first step {rows[-1]['s']:.1f} s after `m3run launch`")

        # -- 2. kill -9 mid-interval after a complete checkpoint
        ckpt = sv.wait_for(
            "a complete checkpoint",
            lambda: sv.newer_checkpoint(run_dir, None),
            launch,
            deadline,
            on_poll=beats.poll,
        )
        # ... and verified by the supervisor (see sv.verified_by_supervisor).
        sv.wait_for(
            f"the supervisor's verification of checkpoint {ckpt}",
            lambda: sv.verified_by_supervisor(run_dir, ckpt),
            launch,
            deadline,
            on_poll=beats.poll,
        )
        mid = ckpt + max(1, interval // 2)
        sv.wait_for(
            f"step {mid}", lambda: _at_step(beats, mid), launch, deadline, on_poll=beats.poll
        )
        killed, t_kill = sv.kill_worker(run_dir)
        sv.wait_gone(killed)
        # Taken once the worker is dead: nothing can complete a checkpoint until the restart.
        snapshots["at the kill"] = snapshot("at the kill")
        newest = max(snapshots["at the kill"])
        new = sv.wait_for(
            "the restarted worker's first step",
            lambda: sv.started_worker(run_dir, t_kill, exclude=killed),
            launch,
            deadline,
            on_poll=beats.poll,
        )
        rows = sv.restart_rows(
            run_dir, t_kill, new, sv.steady_step(run_dir, new, launch, deadline, beats.poll)
        )
        report["measurements"].append(
            {"title": f"restart: kill -9 at step ≈{mid} to the first new step", "rows": rows}
        )
        check(
            "kill -9 restarts from the newest complete checkpoint",
            new.get("resumed_from") == newest,
            f"resumed from {new.get('resumed_from')}, newest complete {newest}; "
            f"{rows[-1]['s']:.1f} s to the first new step",
        )

        # -- 3. preemption notice: save, exit 75
        snapshots["before the notice"] = snapshot("before the notice")
        notice_step = _current_step(beats)
        t_notice = time.time()
        server.announce()
        sup_code = sv.wait_for(
            "the supervisor's exit after the notice",
            launch.exit_code,
            launch,
            deadline,
            on_poll=beats.poll,
        )
        t_exit = time.time()
        exited = sv.first_event(run_dir, "worker_exit", t_notice)
        seen = sv.first_event(run_dir, "stop_requested", t_notice)
        after_notice = snapshot("after the preemption")
        saved_at = max(after_notice) if after_notice else None
        report["preemption"] = {
            "notice_step": notice_step,
            "saved_step": saved_at,
            "notice_seen_s": seen["time"] - t_notice if seen else None,
            "worker_exit_s": exited["time"] - t_notice if exited else None,
            "supervisor_exit_s": t_exit - t_notice,
        }
        check(
            "preemption: worker saved and exited 75",
            exited is not None
            and exited.get("exit_code") == 75
            and saved_at is not None
            and notice_step is not None
            and saved_at >= notice_step,
            f"notice at step {notice_step}, checkpoint {saved_at}, worker exit "
            f"{exited.get('exit_code') if exited else None} "
            f"{report['preemption']['worker_exit_s'] or 0:.1f} s after the notice",
        )
        check("preemption: supervisor exit 75", sup_code == 75, f"exit {sup_code}")

        # -- 4. relaunch, resume, finish
        server.clear()
        snapshots["after the preemption"] = after_notice
        launch = sv.Launch(config, run_dir, sets, env, work / "launch2.log")
        again, rows = sv.launch_to_first_step(
            launch, "the relaunch's first step", deadline, beats.poll
        )
        report["measurements"].append({"title": "relaunch to first step", "rows": rows})
        check(
            "relaunch resumes from the preemption checkpoint",
            again.get("resumed_from") == saved_at,
            f"resumed from {again.get('resumed_from')}; {rows[-1]['s']:.1f} s to first step",
        )
        final_code = sv.wait_for(
            "the end of the run", launch.exit_code, launch, deadline, poll_s=0.5, on_poll=beats.poll
        )
        done = _current_step(beats)
        check("run finished", final_code == 0 and done == steps, f"exit {final_code}, step {done}")

        # -- 5. every checkpoint verified, none lost
        table = checkpoint_table(run_dir, verify=True)
        report["checkpoints"]["at the end (sha256 verified)"] = table
        final = [c["step"] for c in table if c["complete"]]
        bad = [c for c in table if not c["complete"]]
        check(
            "every checkpoint verifies (sha256)",
            not bad and bool(final),
            f"{len(final)} complete: {final}" + (f"; not: {bad}" if bad else ""),
        )
        lost = lost_checkpoints(snapshots, final, a.keep_last)
        check("no complete checkpoint lost", not lost, f"lost: {lost}" if lost else "")
        code = 0 if all(c["ok"] for c in report["checks"]) else 1
    except (sv.BenchError, subprocess.TimeoutExpired) as e:
        report["error"] = str(e)
        print(f"gpu_acceptance.py: {e}", file=sys.stderr)
    finally:
        if launch is not None and launch.exit_code() is None:
            launch.kill()
        server.close()
        _finish(report, run_dir, beats, a)
        save()
    print(f"report: {a.out / 'gpu_acceptance.md'}")
    return code


def _at_step(beats: Heartbeats, step: int) -> int | None:
    now = _current_step(beats)
    return now if now is not None and now >= step else None


def _current_step(beats: Heartbeats) -> int | None:
    beats.poll()
    return beats.samples[-1]["step"] if beats.samples else None


def _finish(report: dict, run_dir: Path, beats: Heartbeats, a: argparse.Namespace) -> None:
    """What the report takes from the run dir however far the run got."""
    if not run_dir.exists():
        return
    tps = beats.tokens_per_s()
    speed: dict = {"tokens_per_s (heartbeat median)": round(tps) if tps else None}
    if a.bench_tokens_per_s and tps:
        speed["benchmark tokens_per_s"] = a.bench_tokens_per_s
        speed["heartbeat / benchmark"] = round(tps / a.bench_tokens_per_s, 3)
    peak = [s["vram_bytes"] for s in beats.samples if s.get("vram_bytes")]
    if peak:
        speed["peak VRAM GiB (heartbeat)"] = round(max(peak) / 2**30, 1)
    report["speed"] = speed
    try:
        report["saves"] = saves(run_dir)
    except OSError as e:
        report["saves_error"] = str(e)
    stalls = [s["stall_s"] for s in report.get("saves", [])]
    if stalls:
        speed["checkpoint stall s (max)"] = max(stalls)
        try:
            if during := steps_during_writes(run_dir, report["saves"]):
                speed.update(during)
        except (OSError, ValueError, KeyError) as e:
            report["steps_during_writes_error"] = str(e)
    events = run_dir / "events.jsonl"
    if events.exists():
        shutil.copyfile(events, a.out / "events.jsonl")
    plot = subprocess.run(
        sv.m3run("plot", str(run_dir), "--out", str(a.out / "loss.png")),
        env=sv.child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    report["plot"] = {"code": plot.returncode, "output": (plot.stdout + plot.stderr)[-500:]}


if __name__ == "__main__":
    sys.exit(main())
