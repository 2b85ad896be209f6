"""Never a silent start from scratch, one writer per run dir, checkpoints that verify but do not
load: real workers and supervisors over real damaged files."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal

import psutil
import pytest
import torch
from helpers.launching import Run, overrides
from helpers.runs import tiny_run_overrides
from helpers.supervision import hold_lock
from helpers.training import run_worker

from m3run.runner.checkpoint.layout import UNUSABLE_FILE, checkpoint_dir, list_checkpoints
from m3run.runner.files import read_jsonl
from m3run.runner.protocol import (
    EVENTS_FILE,
    EXIT_CONFIG,
    EXIT_OK,
    LOCK_FILE,
    METRICS_FILE,
    STATE_FILE,
    WORKER_LOCK_FILE,
)

pytestmark = pytest.mark.slow


def _digests(run_dir) -> dict[str, str]:
    root = run_dir / "checkpoints"
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _flip(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def finished_run(corpus, tmp_path_factory):
    """A finished 10-step run with checkpoints at steps 5 and 10, trained once per module."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    sets = tiny_run_overrides(corpus, **{"train.total_steps": 10})
    done = run_worker(run_dir, sets)
    assert done.returncode == EXIT_OK, done.stderr
    assert [c.step for c in list_checkpoints(run_dir)] == [5, 10]
    return run_dir, sets


@pytest.fixture
def trained(finished_run, tmp_path):
    """A copy of the finished run for one test to damage."""
    source, sets = finished_run
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir, ignore=shutil.ignore_patterns("*.lock"))
    return run_dir, sets


def test_a_flipped_byte_in_the_only_checkpoint_is_exit_78_and_nothing_changes(trained):
    run_dir, sets = trained
    (checkpoint_dir(run_dir, 5) / "meta.json").unlink()  # one checkpoint left, then damage it
    _flip(checkpoint_dir(run_dir, 10) / "model.safetensors")
    before = _digests(run_dir)
    run = Run(run_dir, [*sets, "supervisor.smoke=false"], "--force")
    assert run.wait() == EXIT_CONFIG, run.output()
    out = run.output()
    assert "none is usable" in out and "step_00000010: sha256 mismatch" in out, out
    assert "--resume none --force" in out
    assert _digests(run_dir) == before, "a damaged checkpoint was touched"


def test_every_meta_json_broken_is_exit_78_naming_each_checkpoint(trained):
    run_dir, sets = trained
    for step in (5, 10):
        (checkpoint_dir(run_dir, step) / "meta.json").write_text("{not json")
    done = run_worker(run_dir, [*sets, "train.total_steps=20"], "--force")
    assert done.returncode == EXIT_CONFIG, done.stderr
    assert "step_00000005: meta.json unreadable" in done.stderr, done.stderr
    assert "step_00000010: meta.json unreadable" in done.stderr, done.stderr
    assert not [r for r in read_jsonl(run_dir / METRICS_FILE) if r.get("step", 0) > 10]


def test_starting_over_takes_resume_none_force_through_launch(trained):
    run_dir, sets = trained
    _flip(checkpoint_dir(run_dir, 10) / "optim.pt")
    _flip(checkpoint_dir(run_dir, 5) / "optim.pt")
    refused = Run(run_dir, [*sets, "supervisor.smoke=false"], "--resume", "none")
    assert refused.wait() == EXIT_CONFIG, refused.output()
    run = Run(run_dir, [*sets, "supervisor.smoke=false"], "--resume", "none", "--force")
    assert run.wait() == EXIT_OK, run.output()
    aside = list(run_dir.glob("checkpoints.old-*"))
    assert len(aside) == 1 and (aside[0] / "step_00000010").is_dir()
    kinds = [r["kind"] for r in read_jsonl(run_dir / METRICS_FILE) if r["kind"] != "train"]
    # The first run started, the refused relaunch did not get to train, the forced one started.
    assert kinds.count("start") == 2, kinds


def test_every_restart_is_recorded_so_a_replay_is_told_from_a_jump(corpus, tmp_path):
    run_dir = tmp_path / "run"
    sets = tiny_run_overrides(corpus, **{"train.total_steps": 10})
    assert run_worker(run_dir, [*sets, "train.total_steps=7"]).returncode == EXIT_OK
    newest = [c.step for c in list_checkpoints(run_dir)][-1]
    assert run_worker(run_dir, sets, "--force").returncode == EXIT_OK
    records = [r for r in read_jsonl(run_dir / METRICS_FILE) if r["kind"] in ("start", "resume")]
    assert [(r["kind"], r["step"]) for r in records] == [("start", 0), ("resume", newest)]


def test_a_second_writer_is_refused_with_the_holders_pid(trained):
    run_dir, sets = trained
    supervisor = hold_lock(run_dir / LOCK_FILE)
    try:
        done = run_worker(run_dir, [*sets, "train.total_steps=20"], "--force")
        assert done.returncode == EXIT_CONFIG, done.stderr
        assert f"belongs to supervisor pid {supervisor.pid}" in done.stderr
    finally:
        supervisor.kill()
    worker = hold_lock(run_dir / WORKER_LOCK_FILE)
    try:
        done = run_worker(run_dir, [*sets, "train.total_steps=20"], "--force")
        assert done.returncode == EXIT_CONFIG, done.stderr
        assert f"worker pid {worker.pid} holds" in done.stderr
    finally:
        worker.kill()


def test_relaunch_after_a_supervisor_sigkill_finds_the_orphan_by_its_lock(corpus, tmp_path):
    run_dir = tmp_path / "run"
    sets = overrides(corpus, **{"train.total_steps": 400, "log.heartbeat_interval_s": 0.05})
    first = Run(run_dir, sets)
    orphan = first.worker_at(2)
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait()
    assert psutil.pid_exists(orphan), "the worker should outlive its supervisor"
    (run_dir / STATE_FILE).write_text('{"phase": "runn')  # torn: only the lock can tell
    again = Run(run_dir, [*sets[:-1], "train.total_steps=12"], "--force")
    try:
        again.wait_for(
            lambda: any(e["event"] == "stale_worker" for e in read_jsonl(run_dir / EVENTS_FILE)),
            "the relaunch to find the orphan",
        )
        stale = [e for e in read_jsonl(run_dir / EVENTS_FILE) if e["event"] == "stale_worker"]
        assert stale[0]["pid"] == orphan
        assert again.wait() == EXIT_OK, again.output()
        assert not psutil.pid_exists(orphan) or psutil.Process(orphan).status() == "zombie"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(orphan, signal.SIGKILL)


def test_a_checkpoint_of_another_model_shape_is_exit_78_naming_the_tensors(trained):
    run_dir, sets = trained
    done = run_worker(run_dir, [*sets, "model.d_model=32", "train.total_steps=20"], "--force")
    assert done.returncode == EXIT_CONFIG, done.stderr
    assert "does not fit the model" in done.stderr
    assert "(512, 64) in the checkpoint, (512, 32) in the model" in done.stderr, done.stderr


def test_a_verified_but_unloadable_checkpoint_is_marked_and_the_previous_one_used(trained):
    run_dir, sets = trained
    newest = checkpoint_dir(run_dir, 10)
    # Digests that match, contents from elsewhere: a foreign optim.pt structure.
    torch.save({"something": "else"}, newest / "optim.pt")
    meta = json.loads((newest / "meta.json").read_text())
    data = (newest / "optim.pt").read_bytes()
    meta["files"]["optim.pt"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (newest / "meta.json").write_text(json.dumps(meta))
    # To step 8 only, so the marked step 10 is not saved over again.
    done = run_worker(run_dir, [*sets, "train.total_steps=8"], "--force")
    assert done.returncode == EXIT_OK, done.stderr
    assert (newest / UNUSABLE_FILE).exists(), done.stdout + done.stderr
    (step10,) = [c for c in list_checkpoints(run_dir) if c.step == 10]
    assert not step10.complete and "marked unusable" in step10.reason
    assert "resumed from" in done.stdout and "step_00000005" in done.stdout, done.stdout
    unusable = [r for r in read_jsonl(run_dir / METRICS_FILE) if r["kind"] == "checkpoint_unusable"]
    assert unusable and unusable[0]["step"] == 10
    assert [r["step"] for r in read_jsonl(run_dir / METRICS_FILE) if r["kind"] == "resume"] == [5]
