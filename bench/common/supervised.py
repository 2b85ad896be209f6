"""What bench/runner/restart_breakdown.py and bench/acceptance/ (gpu_acceptance.py,
deterministic_resume.py) share: a corpus prepared from local text, `m3run launch` in a
subprocess as a user runs it, waiting on what the run dir says, SIGKILLing the worker, and
splitting a start or a restart into its phases from events.jsonl (supervisor) and the worker's
`startup_times` record in metrics.jsonl.

Torch-free: like the supervisor, these scripts never hold GPU memory themselves.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "configs" / "pretrain_a100_434m.yaml"
DRY_RECIPE = REPO / "configs" / "demo_cpu.yaml"
STEADY_STEPS = 3  # steps logged after a first step, for its steady step time
# What `m3run launch` and the worker import (module names).
NEEDS = (
    "torch",
    "pydantic",
    "yaml",
    "structlog",
    "psutil",
    "typer",
    "rich",
    "numpy",
    "safetensors",
    "tokenizers",
    "pyarrow",
    "zstandard",
    "fsspec",
    "pynvml",
)


class BenchError(RuntimeError):
    """The scenario could not go on; the message says where it stopped and where to look."""


def check_packages(script: str, extra: tuple[str, ...] = ()) -> None:
    """Exit with one line naming every missing package, before anything is started."""
    missing = [m for m in (*NEEDS, *extra) if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(
            f"{script}: {sys.executable} lacks the Python package(s) {', '.join(missing)} that "
            "m3run needs (pynvml is nvidia-ml-py, yaml is pyyaml). Fix: install them, or carry "
            "their wheels and put them on PYTHONPATH"
        )
    if importlib.util.find_spec("m3run") is None:
        raise SystemExit(f"{script}: m3run is not importable. Fix: PYTHONPATH={REPO}")


def m3run(*args: str) -> list[str]:
    return [sys.executable, "-m", "m3run.runner.cli", *args]


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("M3RUN_FAULT", None)
    env.update(extra)
    return env


def work_dirs(work: Path | None, out: Path, prefix: str) -> Path:
    """The script's work dir (`work`, or a new temp dir) and its report dir `out`, both made;
    returns the work dir. Checkpoints of the 434m model are 5 GB each: they stay out of `out`."""
    work = work or Path(tempfile.mkdtemp(prefix=prefix))
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    return work


def report_start(work: Path, **fields: Any) -> dict:
    """The first fields of a script's JSON report: its command line, start time and work dir."""
    return {
        "command": " ".join(sys.argv),
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "work": str(work),
        **fields,
    }


def prepare_corpus(out: Path, tokenizer: str, max_bytes: int, log: Path) -> float:
    """`m3run prepare-data stdlib` (this Python's standard library sources, no download) into
    `out`, unless it is already there. Returns the seconds it took (0 when reused)."""
    if (out / "train" / "manifest.json").exists():
        return 0.0
    t0 = time.time()
    argv = m3run(
        "prepare-data",
        "stdlib",
        "--out",
        str(out),
        "--tokenizer",
        tokenizer,
        "--max-bytes",
        str(max_bytes),
        "--val-fraction",
        "0.01",
    )
    with open(log, "ab") as f:
        code = subprocess.call(argv, env=child_env(), stdout=f, stderr=subprocess.STDOUT)
    if code:
        raise BenchError(f"m3run prepare-data exited {code}; see {log}")
    return time.time() - t0


def run_overrides(corpus: Path, total_steps: int, interval: int, keep_last: int) -> list[str]:
    """A recipe turned into a short run on the prepared corpus: one record per step."""
    return [
        "data.sources=null",
        f"data.train_path={corpus / 'train'}",
        f"data.val_path={corpus / 'val'}",
        f"train.total_steps={total_steps}",
        f"train.warmup_steps={min(10, total_steps)}",
        f"checkpoint.interval_steps={interval}",
        f"checkpoint.keep_last={keep_last}",
        "eval.interval_steps=0",
        "log.interval_steps=1",
        "log.heartbeat_interval_s=0.5",
    ]


def compile_caches(root: Path) -> dict[str, str]:
    """TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR under `root` (created)."""
    env = {
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
        "TRITON_CACHE_DIR": str(root / "triton"),
    }
    for path in env.values():
        Path(path).mkdir(parents=True, exist_ok=True)
    return env


def empty_caches(env: dict[str, str]) -> None:
    for path in env.values():
        shutil.rmtree(path, ignore_errors=True)
        Path(path).mkdir(parents=True, exist_ok=True)


class Launch:
    """`m3run launch CONFIG --run-dir RUN_DIR --set …` in the foreground of a subprocess (its
    console in `log`), as a user types it."""

    def __init__(
        self, config: Path, run_dir: Path, sets: list[str], env: dict[str, str], log: Path
    ):
        self.run_dir = run_dir
        self.log = log
        argv = m3run("launch", str(config), "--run-dir", str(run_dir))
        for kv in sets:
            argv += ["--set", kv]
        self.argv = argv
        self._out = open(log, "ab")  # noqa: SIM115 (closed in wait/kill)
        self.t0 = time.time()
        self.proc = subprocess.Popen(argv, env=env, stdout=self._out, stderr=subprocess.STDOUT)

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        finally:
            if self.proc.poll() is not None:
                self._out.close()

    def tail(self, n: int = 15) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def kill(self) -> None:
        """The run's processes, now: the supervisor first (so it restarts nothing), then its
        orphaned worker (by state.json's pid, checked against worker.lock)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        kill_worker(self.run_dir, quiet=True)
        self._out.close()


def wait_for(
    what: str,
    probe: Callable[[], Any],
    launch: Launch,
    deadline: float,
    poll_s: float = 0.2,
    on_poll: Callable[[], None] | None = None,
) -> Any:
    """Poll `probe` until it returns something other than None; BenchError if the launch ended
    first or the deadline (time.time()) passed."""
    while True:
        if on_poll is not None:
            on_poll()
        value = probe()
        if value is not None:
            return value
        code = launch.exit_code()
        if code is not None:
            value = probe()  # what it wrote on its way out
            if value is not None:
                return value
            raise BenchError(
                f"`m3run launch` exited {code} while waiting for {what}; its last lines:\n"
                + launch.tail()
            )
        if time.time() > deadline:
            raise BenchError(
                f"out of time waiting for {what}; the launch's last lines:\n" + launch.tail()
            )
        time.sleep(poll_s)


# ---------------------------------------------------------------------------- the run dir


def events(run_dir: Path) -> list[dict]:
    from m3run.runner.files import read_jsonl
    from m3run.runner.protocol import EVENTS_FILE

    return read_jsonl(run_dir / EVENTS_FILE)


def metrics(run_dir: Path) -> list[dict]:
    from m3run.runner.files import read_jsonl
    from m3run.runner.protocol import METRICS_FILE

    return read_jsonl(run_dir / METRICS_FILE)


def first_event(run_dir: Path, name: str, after: float, **match: Any) -> dict | None:
    for e in events(run_dir):
        fits = all(e.get(k) == v for k, v in match.items())
        if e.get("event") == name and e.get("time", 0) >= after and fits:
            return e
    return None


def startup_record(run_dir: Path, pid: int) -> dict | None:
    for r in metrics(run_dir):
        if r.get("kind") == "startup_times" and r.get("pid") == pid:
            return r
    return None


def complete_steps(run_dir: Path, verify: bool = False) -> list[int]:
    from m3run.runner.checkpoint.layout import list_checkpoints

    return [c.step for c in list_checkpoints(run_dir, verify=verify) if c.complete]


def tokens_per_step(run_dir: Path) -> int:
    from m3run.runner.config import load_config
    from m3run.runner.protocol import CONFIG_FILE

    cfg = load_config(run_dir / CONFIG_FILE)
    return cfg.train.micro_batch_size * cfg.train.grad_accum_steps * cfg.data.seq_len


def step_times(run_dir: Path, after: float, until: float | None = None) -> list[float]:
    """Seconds per step of the train records logged after `after` (and before `until`), the
    first one dropped: its window holds the compilation of a worker that started then."""
    per_step = tokens_per_step(run_dir)
    recs = [r for r in metrics(run_dir) if r.get("kind") == "train" and r.get("time", 0) > after]
    if until is not None:
        recs = [r for r in recs if r["time"] < until]
    return [per_step / r["tokens_per_s"] for r in recs[1:] if r.get("tokens_per_s")]


def worker_pid(run_dir: Path) -> int | None:
    """The run's live worker, by state.json's pid checked against its create time and lock."""
    from m3run.runner.files import read_json
    from m3run.runner.procs import owns_lock
    from m3run.runner.protocol import STATE_FILE, WORKER_LOCK_FILE, RunState

    state = RunState.from_dict(read_json(run_dir / STATE_FILE))
    if state is None or state.worker_pid is None:
        return None
    if not owns_lock(state.worker_pid, state.worker_create_time, run_dir / WORKER_LOCK_FILE):
        return None
    return state.worker_pid


def kill_worker(run_dir: Path, quiet: bool = False) -> tuple[int, float] | None:
    """SIGKILL the worker (only its pid: what an OOM kill or a segfault does; the supervisor
    cleans up its process group). Returns (pid, the time of the kill), None if none ran."""
    pid = worker_pid(run_dir)
    if pid is None:
        if not quiet:
            raise BenchError(f"no live worker to kill in {run_dir}")
        return None
    t = time.time()
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        if not quiet:
            raise BenchError(f"worker pid {pid} exited before it could be killed") from None
        return None
    return pid, t


def wait_gone(pid: int, timeout_s: float = 30.0) -> None:
    from m3run.runner.procs import create_time

    deadline = time.time() + timeout_s
    while create_time(pid) is not None and time.time() < deadline:
        time.sleep(0.05)


def first_worker_start(run_dir: Path, after: float, exclude: int | None = None) -> dict | None:
    for e in events(run_dir):
        if (
            e.get("event") == "worker_start"
            and e.get("time", 0) >= after
            and e.get("pid") != exclude
        ):
            return e
    return None


def started_worker(run_dir: Path, after: float, exclude: int | None = None):
    """The first worker started after `after` once it has completed its first step."""
    spawn = first_worker_start(run_dir, after, exclude)
    return startup_record(run_dir, spawn["pid"]) if spawn else None


def steady_step(
    run_dir: Path,
    start: dict,
    launch: Launch,
    deadline: float,
    on_poll: Callable[[], None] | None = None,
) -> float | None:
    """The median step time of STEADY_STEPS steps after this worker's first one."""
    after = start["first_step_end"]
    times = wait_for(
        f"{STEADY_STEPS} steps after the first",
        lambda: t if len(t := step_times(run_dir, after)) >= STEADY_STEPS else None,
        launch,
        deadline,
        on_poll=on_poll,
    )
    return steady(times[:STEADY_STEPS])


def verified_by_supervisor(run_dir: Path, step: int) -> int | None:
    """``step`` once the supervisor has logged that checkpoint verified complete (sha256),
    else None. It hashes every new checkpoint in the seconds after it completes; a kill before
    that measures a restart that waits for the hash, which a crash at a random step does not."""
    for e in events(run_dir):
        if e.get("event") == "checkpoint" and e.get("step") == step:
            return step
    return None


def newer_checkpoint(run_dir: Path, than: int | None) -> int | None:
    steps = [s for s in complete_steps(run_dir) if than is None or s > than]
    return steps[-1] if steps else None


# ---------------------------------------------------------------------------- phases


def _row(name: str, seconds: float | None, note: str = "") -> dict:
    return {"phase": name, "s": None if seconds is None else round(seconds, 3), "note": note}


def worker_rows(
    start: dict, spawned_at: float, steady_s: float | None, spare: bool = False
) -> list[dict]:
    """A worker's way from its spawn to its first completed step, from its startup_times;
    ``spare``: it was the supervisor's warm spare, its imports done before it was needed."""
    first = start["first_step_end"] - start["setup_end"]
    loaded = start.get("resumed_from")
    what = f"step {loaded}: choose, sha256, load" if loaded is not None else "none to load"
    if steady_s is None:
        compile_s, step_s, step_note = None, first, "no steady step seen: all of it"
    else:
        compile_s, step_s, step_note = first - steady_s, steady_s, "one steady step"
    s = start
    return [
        _row(
            "process start",
            max(0.0, s["imported"] - spawned_at),
            "the warm spare: exec and imports done before" if spare else "exec, imports",
        ),
        _row("config", s["setup_start"] - s["imported"], "load and check the config"),
        _row("device", s["device_ready"] - s["setup_start"], "run-dir claim, CUDA device"),
        _row("model build", s["model_init"] - s["device_ready"], "telemetry, model init"),
        _row("optimizer", s["model_built"] - s["model_init"], "AdamW"),
        _row("data loader", s["resume_start"] - s["model_built"], "shards, checkpointer"),
        _row("checkpoint load", s["resume_end"] - s["resume_start"], what),
        _row("compile wrapper", s["compile_wrapped"] - s["resume_end"], "torch.compile, DDP"),
        _row("setup rest", s["setup_end"] - s["compile_wrapped"], "tracker"),
        _row("compile", compile_s, "first step less one steady step" + _phases(s)),
        _row("first step", step_s, step_note),
    ]


def _phases(start: dict) -> str:
    """torch.compile's own timers from the record, as a note (nested: they do not add up)."""
    phases = start.get("compile_phases") or {}
    said = ", ".join(f"{k} {v:.1f}" for k, v in phases.items())
    return f"; torch.compile's timers (s, nested): {said}" if said else ""


def smoke_check_rows(run_dir: Path, since: float) -> list[dict]:
    """The smoke test's checks with their seconds (RUN_DIR/smoke.json), as rows inside its own:
    they do not add to the total (process start and imports are outside every check). None
    where the file predates ``since``: a skipped smoke test leaves an earlier launch's there."""
    from m3run.runner.protocol import SMOKE_FILE

    try:
        path = run_dir / SMOKE_FILE
        if path.stat().st_mtime < since:
            return []
        checks = json.loads(path.read_text()).get("checks", [])
    except (OSError, ValueError):
        return []
    return [
        _row(
            f"· check {c['number']}",
            c["seconds"],
            f"{c['name']} ({c['status']}), in the smoke test",
        )
        for c in checks
    ]


def launch_rows(run_dir: Path, t_launch: float, start: dict, steady_s: float | None) -> list[dict]:
    """`m3run launch` (at t_launch) to the first completed step of its first worker."""
    ev_launch = first_event(run_dir, "launch", t_launch - 1)
    health = first_event(run_dir, "health", t_launch - 1, when="preflight")
    smoke = first_event(run_dir, "smoke", t_launch - 1)
    spawn = first_event(run_dir, "worker_start", t_launch - 1, pid=start["pid"])
    if ev_launch is None or spawn is None:
        raise BenchError(f"events.jsonl of {run_dir} lacks the launch or worker_start event")
    rows = [_row("supervisor start", ev_launch["time"] - t_launch, "CLI, lock, config freeze")]
    at = ev_launch["time"]
    if health is not None:
        rows.append(_row("health gate", health["time"] - at, "and the checkpoint scan before it"))
        at = health["time"]
    if smoke is not None:
        rows.append(_row("smoke test", smoke["time"] - at, str(smoke.get("reason", ""))[:70]))
        rows += smoke_check_rows(run_dir, t_launch)
        at = smoke["time"]
    rows.append(_row("worker spawn", spawn["time"] - at))
    rows += worker_rows(start, spawn["time"], steady_s, bool(spawn.get("warm_spare")))
    rows.append(_row("total", start["first_step_end"] - t_launch, "launch to first step"))
    return rows


def launch_to_first_step(
    launch: Launch, what: str, deadline: float, on_poll: Callable[[], None] | None = None
) -> tuple[dict, list[dict]]:
    """Wait for `launch`'s first worker to complete its first step and STEADY_STEPS more; its
    startup record and the rows of `launch_rows`."""
    run_dir = launch.run_dir
    start = wait_for(
        what, lambda: started_worker(run_dir, launch.t0 - 1), launch, deadline, on_poll=on_poll
    )
    steady_s = steady_step(run_dir, start, launch, deadline, on_poll)
    return start, launch_rows(run_dir, launch.t0, start, steady_s)


def restart_rows(run_dir: Path, t_kill: float, start: dict, steady_s: float | None) -> list[dict]:
    """A worker SIGKILLed at t_kill to the first completed step of the one restarted after it."""
    exited = first_event(run_dir, "worker_exit", t_kill)
    restart = first_event(run_dir, "restart", t_kill)
    spawn = first_event(run_dir, "worker_start", t_kill, pid=start["pid"])
    if exited is None or restart is None or spawn is None:
        raise BenchError(f"events.jsonl of {run_dir} lacks worker_exit, restart or worker_start")
    # What is left of the backoff after the settle, which counts toward it.
    backoff = float(restart.get("wait_s", restart.get("backoff_s")) or 0.0)
    released = first_event(run_dir, "gpu_memory_wait", restart["time"])
    health = first_event(run_dir, "health", restart["time"], when="before restart")
    settle = float(exited.get("settle_s") or 0.0)
    rows = [
        _row("exit seen", exited["time"] - settle - t_kill, "SIGKILL to the supervisor's wait"),
        _row("checkpoint settle", settle, "the supervisor's hash of what the worker left"),
        _row("restart decision", restart["time"] - exited["time"], "policy"),
        _row("supervisor backoff", backoff),
    ]
    at = restart["time"] + backoff
    if released is not None and released["time"] < spawn["time"]:
        rows.append(_row("GPU memory release", released["time"] - at, "dead worker's memory"))
        at = released["time"]
    if health is not None and health["time"] <= spawn["time"]:
        rows.append(_row("health gate", health["time"] - at, "with any release wait under 1 s"))
        at = health["time"]
    rows.append(_row("smoke test", 0.0, "not run on a supervisor restart"))
    rows.append(_row("worker spawn", spawn["time"] - at))
    rows += worker_rows(start, spawn["time"], steady_s, bool(spawn.get("warm_spare")))
    rows.append(_row("total", start["first_step_end"] - t_kill, "SIGKILL to first new step"))
    return rows


def steady(times: list[float]) -> float | None:
    return statistics.median(times) if times else None


def format_rows(title: str, rows: list[dict]) -> str:
    width = max(len(r["phase"]) for r in rows)
    out = [title]
    for r in rows:
        s = f"{r['s']:9.2f} s" if r["s"] is not None else "        - "
        out.append(f"  {r['phase']:<{width}} {s}  {r['note']}")
    return "\n".join(out)


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    tmp.replace(path)
