"""A run dir as other people's processes see it: files another uid can read, links that never
redirect a write, refused launches that leave nothing behind. Real launches, real files."""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
from pathlib import Path

import pytest
from helpers.launching import launch_argv
from helpers.runs import REPO, tiny_run_overrides, worker_env
from helpers.training import worker_cmd

from m3run.runner.files import append_jsonl, atomic_write_json, open_append
from m3run.runner.protocol import (
    CONFIG_FILE,
    EVENTS_FILE,
    EXIT_CONFIG,
    EXIT_OK,
    HEARTBEAT_FILE,
    LOCK_FILE,
    METRICS_FILE,
    SMOKE_FILE,
    STATE_FILE,
    SUPERVISOR_LOG,
    WORKER_LOG,
)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _launch(run_dir: Path, sets: list[str], umask: int = 0o022) -> subprocess.CompletedProcess:
    return subprocess.run(
        launch_argv(run_dir, sets),
        capture_output=True,
        text=True,
        env=worker_env(),
        cwd=REPO,
        timeout=240,
        preexec_fn=lambda: os.umask(umask),
    )


def test_shared_file_helpers_create_files_with_the_umask(tmp_path):
    old = os.umask(0o002)
    try:
        atomic_write_json(tmp_path / "a.json", {"x": 1})
        append_jsonl(tmp_path / "b.jsonl", {"x": 1})
        with open_append(tmp_path / "c.log") as f:
            f.write("line\n")
    finally:
        os.umask(old)
    for name in ("a.json", "b.jsonl", "c.log"):
        assert _mode(tmp_path / name) == 0o664, name


@pytest.mark.slow
def test_every_run_dir_file_follows_the_umask(tmp_path, corpus):
    # Another uid (a sidecar, a monitoring job, `docker exec` as another user) reads the run
    # dir: nothing may be written 0600 behind the umask's back.
    run_dir = tmp_path / "run"
    sets = tiny_run_overrides(corpus, **{"train.total_steps": 6, "checkpoint.interval_steps": 3})
    done = _launch(run_dir, sets, umask=0o002)
    assert done.returncode == EXIT_OK, done.stdout + done.stderr
    files = [
        run_dir / n
        for n in (CONFIG_FILE, STATE_FILE, HEARTBEAT_FILE, METRICS_FILE, EVENTS_FILE, SMOKE_FILE)
    ]
    files += [run_dir / SUPERVISOR_LOG, run_dir / WORKER_LOG]
    ckpts = sorted((run_dir / "checkpoints").glob("step_*"))
    assert ckpts
    files += [p for p in ckpts[-1].iterdir()]
    wrong = {str(p.relative_to(run_dir)): oct(_mode(p)) for p in files if _mode(p) != 0o664}
    assert not wrong, wrong
    # The prepared corpus (written under this process's umask, 022) as well.
    for manifest in corpus.glob("*/manifest.json"):
        assert _mode(manifest) == 0o666 & ~0o022, manifest


def test_symlinked_run_dir_files_are_refused_and_their_targets_untouched(tmp_path, corpus):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    for name in (LOCK_FILE, SUPERVISOR_LOG, WORKER_LOG, METRICS_FILE):
        run_dir = tmp_path / f"run-{name}"
        run_dir.mkdir()
        (run_dir / name).symlink_to(victim)
        done = _launch(run_dir, tiny_run_overrides(corpus))
        assert done.returncode == EXIT_CONFIG, (name, done.stdout + done.stderr)
        assert "symbolic link" in done.stderr and name in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
        assert victim.read_text() == "precious\n", name


def test_direct_writes_never_follow_a_planted_link(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(OSError, match="symbolic link"):
        append_jsonl(tmp_path / "metrics.jsonl", {"step": 1})
    assert victim.read_text() == "precious\n"


def test_a_refused_launch_leaves_no_run_dir_behind(tmp_path, corpus):
    run_dir = tmp_path / "never"
    done = _launch(run_dir, [*tiny_run_overrides(corpus), "train.warmup_steps=0"])
    assert done.returncode == EXIT_CONFIG, done.stderr
    assert "warmup_steps" in done.stderr
    assert not run_dir.exists(), sorted(p.name for p in run_dir.iterdir())


@contextlib.contextmanager
def _read_only_dir(path: Path):
    """A directory this process cannot write: a read-only bind mount for root (root writes
    through file modes), mode 0555 for anyone else."""
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield path
        return
    bind = subprocess.run(["mount", "--bind", str(path), str(path)]).returncode == 0
    remount = ["mount", "-o", "remount,ro,bind", str(path)]
    if not bind or subprocess.run(remount).returncode != 0:
        if bind:
            subprocess.run(["umount", str(path)])
        pytest.skip("root here cannot mount a read-only bind mount to make a run dir unwritable")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)])


def test_an_unwritable_run_dir_is_exit_78_naming_the_path_and_errno(tmp_path, corpus):
    with _read_only_dir(tmp_path / "ro") as run_dir:
        launched = _launch(run_dir, tiny_run_overrides(corpus))
        trained = subprocess.run(
            worker_cmd(run_dir, tiny_run_overrides(corpus)),
            capture_output=True,
            text=True,
            env=worker_env(),
            timeout=120,
        )
    for done in (launched, trained):
        assert done.returncode == EXIT_CONFIG, done.stdout + done.stderr
        assert str(run_dir) in done.stderr, done.stderr
        assert "EROFS" in done.stderr or "EACCES" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
