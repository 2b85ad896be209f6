"""Taking a run dir and starting its supervisor: the lock (one supervisor per run dir), the
frozen config (config.yaml: the only copy; a changed config needs --force), a launch in this
process or detached in the background."""

from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from m3run.runner.checkpoint.layout import CheckpointInfo, list_checkpoints, verify_checkpoint
from m3run.runner.config import (
    ConfigError,
    check_config_file,
    config_hash,
    keep_legacy_values,
    load_config,
    load_frozen_config,
)
from m3run.runner.console import Console
from m3run.runner.files import (
    PidLock,
    append_jsonl,
    atomic_write_text,
    describe_os_error,
    lock_holder,
    read_json,
    refuse_symlinks,
)
from m3run.runner.procs import spawn_logged
from m3run.runner.protocol import (
    CONFIG_FILE,
    EVENTS_FILE,
    EXIT_CONFIG,
    EXIT_OK,
    EXIT_REFUSED,
    LOCK_FILE,
    RANK_HEARTBEAT_GLOB,
    RUN_DIR_FILES,
    STATE_FILE,
    SUPERVISOR_LOG,
    TOKENIZER_FILE,
    WORKER_EXIT_GLOB,
    WORKER_LOCK_FILE,
    LogFormat,
)
from m3run.runner.runstate import live_run_process
from m3run.runner.schedule import lr_at
from m3run.runner.supervisor.preflight import NvmlProbe, SmokeTest
from m3run.runner.supervisor.settings import SupervisorSettings
from m3run.runner.supervisor.supervisor import Supervisor
from m3run.runner.supervisor.worker import worker_argv
from m3run.runner.tracking import tracker_problem


class LaunchError(Exception):
    """A launch the supervisor refuses. ``exit_code`` is the supervisor's exit code."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class RunLock:
    """`supervisor.lock`: an exclusive flock held for the supervisor's lifetime. The file holds
    the holder's pid so a refused launch can name it. The kernel drops the lock when the holder
    dies, however it dies."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK_FILE
        self.pid_lock = PidLock(self.path)

    def acquire(self) -> None:
        holder = self.pid_lock.acquire()
        if holder is not None:
            run_dir = self.path.parent
            raise LaunchError(
                f"run dir {run_dir} is busy: supervisor pid {holder} holds {self.path}. "
                f"Watch it with `m3run status {run_dir}`, stop it with `m3run stop {run_dir}`, "
                "or launch into another --run-dir",
                EXIT_REFUSED,
            )

    def release(self) -> None:
        self.pid_lock.release()

    def discard(self) -> None:
        """Remove the lock file and, when nothing else is left, the run dir (a launch that
        was refused before it started must not leave a dir that looks like a run)."""
        self.path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.path.parent.rmdir()


def refuse_live_run(run_dir: Path) -> None:
    """LaunchError when state.json names a live supervisor or worker of this run: the lock
    files prove nothing once deleted (a "stale lock" cleanup), and a second supervisor would
    run a second writer beside them. Checked before the lock is taken: a refused launch must not
    hold, even for a moment, the lock file a live supervisor re-takes when it finds it gone."""
    if lock_holder(run_dir / LOCK_FILE) is not None:
        return  # RunLock.acquire refuses, naming the holder
    live = live_run_process(run_dir)
    if live is None:
        return
    what, pid = live
    if what == "supervisor":
        fix = f"stop it with `m3run stop {run_dir}`, or wait for it to end"
    else:
        fix = (
            f"its supervisor is gone: stop it with `kill {pid}` (it saves a checkpoint and "
            "exits), or wait for it to end"
        )
    raise LaunchError(
        f"run dir {run_dir} is busy: {what} pid {pid} of this run is still alive ({STATE_FILE} "
        f"names it), whatever {LOCK_FILE} and {WORKER_LOCK_FILE} say. Watch it with "
        f"`m3run status {run_dir}`; {fix}, then launch again. Never delete the lock files of "
        "a live run",
        EXIT_REFUSED,
    )


@dataclass
class LaunchOptions:
    """`m3run launch` arguments."""

    config: Path
    run_dir: Path
    overrides: list[str] = field(default_factory=list)
    resume: str = "latest"
    force: bool = False
    console: bool = True
    smoke: bool = False  # run the smoke test even where it passed for this config and device
    log_format: LogFormat = LogFormat.TEXT  # the console's

    def messages(self) -> Console:
        """Where the launch says what is not a supervisor event (refusals, warnings), in the
        console's format."""
        return Console(self.log_format, source="launch", prefix="m3run launch")


def check_resume(value: str) -> str:
    """--resume: latest, none or a step number."""
    value = str(value).strip()
    if value in ("latest", "none") or (value.isascii() and value.isdigit()):
        return value
    raise LaunchError(
        f"--resume must be latest, none or a step number, got {value!r} (fix: "
        "e.g. --resume latest, or --resume 4000 for checkpoints/step_00004000)",
        EXIT_CONFIG,
    )


def _complete(run_dir: Path) -> list[CheckpointInfo]:
    """The run dir's complete checkpoints, oldest first (meta.json and sizes; no hashing)."""
    return [c for c in list_checkpoints(run_dir, verify=False) if c.complete]


def check_resume_step(run_dir: Path, resume: str, mirrored: bool = False) -> None:
    """--resume STEP names a complete checkpoint of this run dir: found before anything
    starts, so a typo neither starts a worker nor marks the run failed. With a checkpoint
    mirror (`mirrored`) a step the run dir lacks may be the mirror's: the supervisor restores
    it, or refuses naming both places, at its start."""
    if not resume.isdigit() or mirrored:
        return
    steps = [c.step for c in _complete(run_dir)]
    if int(resume) in steps:
        return
    have = ", ".join(map(str, steps[-8:])) if steps else "none"
    raise LaunchError(
        f"--resume {resume}: {run_dir} has no complete checkpoint at step {int(resume)} "
        f"(complete: {have}); fix: --resume latest, or one of those steps",
        EXIT_CONFIG,
    )


def finished_message(cfg: Any, opts: LaunchOptions, resume: str) -> str | None:
    """What to say instead of starting a worker when the run to resume is already trained to
    train.total_steps: how to train it longer. None when there is something to train."""
    if resume != "latest":
        return None
    if lock_holder(opts.run_dir / WORKER_LOCK_FILE) is not None:
        return None  # an orphaned worker trains on: the supervisor stops it first
    complete = _complete(opts.run_dir)
    total = cfg.train.total_steps
    if not complete or complete[-1].step < total:
        return None
    last = complete[-1]
    # Its digests too: a final checkpoint that rotted is for the worker to pass over (it
    # resumes from the one before and trains the last steps again), not a finished run.
    if not verify_checkpoint(last.path, full=True)[0]:
        return None
    return (
        f"{opts.run_dir} is finished: its checkpoint at step {last.step} is the last of "
        f"train.total_steps={total}, so there is nothing to train. To train it longer: "
        f"`m3run launch {opts.config} --run-dir {opts.run_dir} --set "
        f"train.total_steps={max(2 * total, last.step + 1)} --force`; to use it: "
        f"`m3run export {opts.run_dir} OUT` or `m3run generate {opts.run_dir} --prompt TEXT`"
    )


def _schedule_jump(run_dir: Path, old: Any, new: Any) -> str | None:
    """What a replaced config does to the learning rate where the run resumes (extending a
    finished run with a larger train.total_steps restarts the decay from a higher LR)."""
    complete = _complete(run_dir)
    if not complete:
        return None
    step = complete[-1].step
    before, after = lr_at(old, step + 1), lr_at(new, step + 1)
    if math.isclose(before, after, rel_tol=1e-6):
        return None
    return (
        f"the learning-rate schedule changes under the run: at step {step + 1}, where it "
        f"resumes, the LR jumps from {before:.3g} (the frozen config) to {after:.3g}"
    )


def freeze_config(opts: LaunchOptions) -> tuple[Any, str]:
    """Load CONFIG with --set overrides and freeze it as RUN_DIR/config.yaml. A relaunch with a
    different resolved config is refused unless --force. Returns (config, hash)."""
    try:
        cfg = load_config(opts.config, opts.overrides)
    except ConfigError as e:
        raise LaunchError(str(e), EXIT_CONFIG) from None
    frozen = opts.run_dir / CONFIG_FILE
    old = None
    if frozen.exists():
        try:
            old = load_frozen_config(frozen)
            # A key the run was frozen without keeps the run's behaviour (config.LEGACY_VALUES).
            cfg = keep_legacy_values(cfg, old)
        except ConfigError as e:
            if not opts.force:
                raise LaunchError(
                    f"the frozen config {frozen} no longer loads ({e}); pass --force to replace "
                    f"it with {opts.config}, or launch into another --run-dir",
                    EXIT_CONFIG,
                ) from None
            old = None
    new_hash = config_hash(cfg)
    if old is not None:
        old_hash = config_hash(old)
        if old_hash != new_hash:
            a, b = old.flat(), cfg.flat()
            diff = [
                f"{k}: {a.get(k)!r} -> {b.get(k)!r}"
                for k in sorted(set(a) | set(b))
                if a.get(k) != b.get(k)
            ]
            shown = "; ".join(diff[:8]) + (f"; … {len(diff) - 8} more" if len(diff) > 8 else "")
            if not opts.force:
                raise LaunchError(
                    f"config changed for {opts.run_dir}: {opts.config} with the given --set "
                    f"resolves to a config different from the frozen {frozen} ({shown}). "
                    f"Relaunch with the frozen config (`m3run launch {frozen} --run-dir "
                    f"{opts.run_dir}`), launch into another --run-dir, or pass --force to "
                    "replace the frozen config",
                    EXIT_CONFIG,
                )
            jump = _schedule_jump(opts.run_dir, old, cfg)
            if jump:
                opts.messages().warning(jump, event="lr_jump")
            append_jsonl(
                opts.run_dir / EVENTS_FILE,
                {
                    "time": time.time(),
                    "event": "config_replaced",
                    "old_hash": old_hash,
                    "new_hash": new_hash,
                    "reason": f"--force: {shown}",
                },
            )
    atomic_write_text(frozen, cfg.to_yaml())
    return cfg, new_hash


def _keep_tokenizer(cfg: Any, run_dir: Path, console: Console) -> None:
    """Copy the data's tokenizer into the run dir (TOKENIZER_FILE) at the first launch, or at
    the relaunch of a run dir that lacks one: generate and export then need nothing outside
    the run dir. Data that cannot be read is left to the worker, whose error names it; a
    tokenizer that cannot be kept is a warning, never a refused launch."""
    dest = run_dir / TOKENIZER_FILE
    if dest.exists():
        return
    from m3run.runner.data.manifest import MANIFEST_NAME, DataError
    from m3run.runner.data.tokenizer_file import write_tokenizer_file

    split = Path(cfg.data.train_paths()[0])
    if not (split / MANIFEST_NAME).is_file():
        return
    try:
        write_tokenizer_file(split, dest)
    except DataError as e:
        console.warning(
            f"no {TOKENIZER_FILE} kept in {run_dir}: {e}. Training goes on; generate and "
            "export will look for the tokenizer in the data folder",
            event="tokenizer_not_kept",
        )


def _check_tracker(cfg: Any, run_dir: Path, console: Console) -> None:
    """A tracker that cannot start is an error at a run's first launch (the user asked for
    tracking) and a warning once it has checkpoints (a tracker must never stop a run)."""
    problem = tracker_problem(cfg.log.tracker)
    if problem is None:
        return
    if _complete(run_dir):
        console.warning(f"{problem}; training goes on untracked", event="tracker_unavailable")
        return
    raise LaunchError(f"experiment tracker: {problem}", EXIT_CONFIG)


def _check_path_text(run_dir: Path) -> None:
    """The run dir's path is recorded in state.json and events: it must be valid UTF-8."""
    try:
        str(run_dir.absolute()).encode("utf-8")
    except UnicodeEncodeError:
        raise LaunchError(
            f"run dir {str(run_dir)!r} is not a valid UTF-8 path (m3run records it in "
            f"{STATE_FILE}); fix: rename it, or launch into another --run-dir",
            EXIT_CONFIG,
        ) from None


def _check_config_file(config: Path) -> None:
    """A config file that is missing, too large or too deep is refused before the run dir is
    made: a refusal must not leave a dir that looks like a run."""
    try:
        check_config_file(config)
    except ConfigError as e:
        raise LaunchError(str(e), EXIT_CONFIG) from None


def _refused(err: LaunchError | OSError, console: Console) -> int:
    """Say why the launch is refused; its exit code (78 for a run dir that cannot be
    written)."""
    if isinstance(err, LaunchError):
        console.error(str(err), err.exit_code, event="refused")
        return err.exit_code
    console.error(describe_os_error(err), EXIT_CONFIG, event="refused")
    return EXIT_CONFIG


def launch(opts: LaunchOptions) -> int:
    """Take the run dir's lock, freeze the config and supervise the run in this process.
    Returns the supervisor's exit code; refusals print their reason to stderr. A launch refused
    before its supervisor ran leaves no trace in a run dir it created."""
    created = not opts.run_dir.exists()
    try:
        resume = check_resume(opts.resume)
        _check_path_text(opts.run_dir)
        _check_config_file(opts.config)
        opts.run_dir.mkdir(parents=True, exist_ok=True)
        refuse_symlinks(opts.run_dir, RUN_DIR_FILES, (RANK_HEARTBEAT_GLOB, WORKER_EXIT_GLOB))
        refuse_live_run(opts.run_dir)
        lock = RunLock(opts.run_dir)
        lock.acquire()
    except (LaunchError, OSError) as e:
        return _refused(e, opts.messages())
    sup = None
    try:
        cfg, chash = freeze_config(opts)
        check_resume_step(opts.run_dir, resume, mirrored=cfg.checkpoint.mirror_url is not None)
        done = finished_message(cfg, opts, resume)
        if done is not None:
            opts.messages().info(done, event="finished")
            return EXIT_OK
        for warning in cfg.warnings():
            opts.messages().warning(warning, event="config_warning")
        _check_tracker(cfg, opts.run_dir, opts.messages())
        _keep_tokenizer(cfg, opts.run_dir, opts.messages())
        settings = SupervisorSettings.from_config(cfg)
        # No --lr-scale on a relaunch: a NaN rollback's LR cut lives in the checkpoints the
        # worker wrote after it.
        sup = Supervisor(
            opts.run_dir,
            settings,
            worker_argv(opts.run_dir, cfg.distributed, start_over=opts.force),
            resume=resume,
            console=opts.console,
            log_format=opts.log_format,
            config_hash=chash,
            gpu=NvmlProbe(settings.health_timeout_s),
            smoke=SmokeTest(opts.run_dir / CONFIG_FILE, always=opts.smoke)
            if settings.smoke
            else None,
            run_lock=lock.pid_lock,
        )
    except (LaunchError, OSError) as e:
        return _refused(e, opts.messages())
    finally:
        if sup is None and created:
            lock.discard()
        if sup is None:
            lock.release()
    try:
        return sup.run()
    finally:
        lock.release()


def launch_detached(opts: LaunchOptions, wait_s: float = 60.0) -> int:
    """Start the supervisor as a daemon (its own session, output to supervisor.log) and return
    once it has written state.json with its pid. Returns 0, or the daemon's exit code if it
    refused to start."""
    messages = opts.messages()
    try:
        _check_config_file(opts.config)
    except LaunchError as e:
        return _refused(e, messages)
    opts.run_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable,
        "-m",
        "m3run.runner.supervisor",
        "run",
        str(Path(opts.config).absolute()),
        "--run-dir",
        str(opts.run_dir.absolute()),
        "--resume",
        opts.resume,
    ]
    for kv in opts.overrides:
        argv += ["--set", kv]
    if opts.force:
        argv.append("--force")
    if opts.smoke:
        argv.append("--smoke")
    argv += ["--log-format", LogFormat(opts.log_format).value]
    log_path = opts.run_dir / SUPERVISOR_LOG
    proc, offset = spawn_logged(argv, log_path)
    deadline = time.monotonic() + wait_s
    while True:
        state = read_json(opts.run_dir / STATE_FILE)
        if state and state.get("supervisor_pid") == proc.pid:
            messages.info(
                f"supervisor pid {proc.pid} is running {opts.run_dir} in the "
                f"background; follow it with `m3run status {opts.run_dir} --watch` or "
                f"`m3run logs {opts.run_dir} -f`, stop it with `m3run stop {opts.run_dir}`",
                event="detached",
                pid=proc.pid,
                run_dir=str(opts.run_dir),
            )
            return EXIT_OK
        code = proc.poll()
        if code is not None:
            with open(log_path, "rb") as f:
                f.seek(offset)
                tail = f.read().decode(errors="replace").strip()
            # 0 before any state: the run was finished, which the tail says.
            if tail:
                messages.relay(tail)
            else:
                messages.error(
                    f"the supervisor exited {code} before starting; see {log_path}",
                    code if code != EXIT_OK else EXIT_REFUSED,
                    event="refused",
                )
            return code if (tail or code != EXIT_OK) else EXIT_REFUSED
        if time.monotonic() > deadline:
            messages.error(
                f"supervisor pid {proc.pid} did not write {STATE_FILE} within "
                f"{wait_s:g}s; it may still be starting: check `m3run logs {opts.run_dir} "
                "--supervisor`",
                EXIT_REFUSED,
                event="refused",
            )
            return EXIT_REFUSED
        time.sleep(0.05)
