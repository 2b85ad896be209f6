"""The training worker as a real process: exact resume, exit codes, the NaN guard, and every
seed pitfall DESIGN.md lists."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers.runs import DEMO_CONFIG, tiny_run_overrides, worker_env
from helpers.training import run_worker, sigterm_worker_at, train_losses
from safetensors.torch import load_file

from m3run.runner.checkpoint.layout import latest_complete, list_checkpoints
from m3run.runner.config import load_config
from m3run.runner.files import read_jsonl
from m3run.runner.schedule import lr_at

pytestmark = pytest.mark.slow


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(latest_complete(run_dir).path / "model.safetensors"))


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def finished(corpus, tmp_path_factory) -> tuple[Path, list[str]]:
    """The tiny recipe's 30 steps, uninterrupted (checkpoints 20, 25 and 30 kept), trained once
    per module: the reference of an exact resume, and the run dir that the tests of a relaunch
    into a trained one start from, each on a copy of its own (copy_of). A worker process costs
    seconds of CPU, its start most of it."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    ov = tiny_run_overrides(corpus)
    done = run_worker(run_dir, ov)
    assert done.returncode == 0, done.stderr
    # The worker leaves with os._exit after run(): its last line is flushed before.
    assert done.stdout.splitlines()[-1].startswith("finished: 30 steps, "), done.stdout
    assert [c.step for c in list_checkpoints(run_dir)] == [20, 25, 30]
    return run_dir, ov


def copy_of(finished: tuple[Path, list[str]], tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(finished[0], run_dir, ignore=shutil.ignore_patterns("*.lock"))
    return run_dir


def test_sigterm_then_relaunch_resumes_exactly(finished, tmp_path):
    ref, ov = finished
    run_dir = tmp_path / "stopped"
    stopped_at = sigterm_worker_at(run_dir, ov)

    again = run_worker(run_dir, ov)  # the same command
    assert again.returncode == 0, again.stderr
    assert "resumed from" in again.stdout and f"(step {stopped_at})" in again.stdout
    ref_losses, losses = train_losses(ref), train_losses(run_dir)
    assert sorted(losses) == list(range(1, 31))
    assert losses == ref_losses  # bitwise: float equality of every logged step
    assert_bitwise_equal(final_weights(run_dir), final_weights(ref))
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert any(r["kind"] == "resume" and r["step"] == stopped_at for r in records)


def test_deterministic_mode_is_on_in_the_worker_and_resumes_exactly(corpus, tmp_path):
    """train.deterministic: the worker says so, no op it runs lacks a deterministic kernel (no
    warning), and a stopped and relaunched run logs the uninterrupted one's losses bitwise. (On
    a GPU, bench/acceptance/deterministic_resume.py checks the same with the Triton scan and a
    SIGKILL.)"""
    ov = tiny_run_overrides(corpus, **{"train.deterministic": "true"})
    ref = run_worker(tmp_path / "ref", ov)
    assert ref.returncode == 0, ref.stderr
    assert "train.deterministic: on (deterministic algorithms" in ref.stdout
    assert "deterministic" not in ref.stderr, ref.stderr  # a warn_only warning names the op
    run_dir = tmp_path / "stopped"
    sigterm_worker_at(run_dir, ov)
    again = run_worker(run_dir, ov)
    assert again.returncode == 0, again.stderr
    assert train_losses(run_dir) == train_losses(tmp_path / "ref")
    assert_bitwise_equal(final_weights(run_dir), final_weights(tmp_path / "ref"))


def test_missing_data_exits_78_naming_the_path(tmp_path):
    missing = tmp_path / "nowhere" / "train"
    ov = tiny_run_overrides(tmp_path, **{"data.train_path": str(missing)})
    r = run_worker(tmp_path / "run", ov)
    assert r.returncode == 78
    assert str(missing) in r.stderr and "prepare-data" in r.stderr
    assert not list_checkpoints(tmp_path / "run")


def test_warmup_zero_is_rejected_with_exit_78(corpus, tmp_path):
    r = run_worker(tmp_path / "run", tiny_run_overrides(corpus, **{"train.warmup_steps": 0}))
    assert r.returncode == 78
    assert "train.warmup_steps" in r.stderr and "got 0" in r.stderr


def test_triton_backend_on_cpu_exits_78_never_falls_back(corpus, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA machine: triton can run here")
    r = run_worker(tmp_path / "run", tiny_run_overrides(corpus, **{"model.scan_backend": "triton"}))
    assert r.returncode == 78
    assert "model.scan_backend=triton" in r.stderr and "pytorch" in r.stderr


def test_vocab_larger_than_model_is_a_data_error(corpus, tmp_path):
    r = run_worker(tmp_path / "run", tiny_run_overrides(corpus, **{"model.vocab_size": 300}))
    assert r.returncode == 78
    assert "512" in r.stderr and "300" in r.stderr


def test_explicit_resume_step_is_never_overridden_by_auto_resume(finished, tmp_path):
    _, ov = finished
    run_dir = copy_of(finished, tmp_path)  # finished: auto-resume would take step 30
    r = run_worker(run_dir, ov, "--resume", "20")
    assert r.returncode == 0, r.stderr
    assert "(step 20)" in r.stdout
    r = run_worker(run_dir, ov, "--resume", "7")
    assert r.returncode == 78
    assert "7" in r.stderr and "20" in r.stderr  # names the missing step and the complete ones


def test_resume_none_refuses_a_run_dir_with_checkpoints(finished, tmp_path):
    _, ov = finished
    run_dir = copy_of(finished, tmp_path)
    r = run_worker(run_dir, ov, "--resume", "none")
    assert r.returncode == 78 and "--force" in r.stderr
    r = run_worker(run_dir, ov, "--resume", "none", "--force")
    assert r.returncode == 0, r.stderr
    aside = [p for p in run_dir.iterdir() if p.name.startswith("checkpoints.old-")]
    assert len(aside) == 1 and (aside[0] / "step_00000030" / "meta.json").exists()


def test_changed_config_needs_force(finished, tmp_path):
    _, ov = finished
    r = run_worker(copy_of(finished, tmp_path), [*ov, "train.lr=1e-3"])
    assert r.returncode == 78 and "--force" in r.stderr


def test_single_nan_step_is_skipped_without_touching_weights(corpus, tmp_path):
    run_dir = tmp_path / "run"
    ov = tiny_run_overrides(corpus, **{"train.total_steps": 12})
    r = run_worker(run_dir, ov, env=worker_env(M3RUN_FAULT="nan_at_step=7"))
    assert r.returncode == 0, r.stderr
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [x["step"] for x in records if x["kind"] == "nonfinite"] == [7]
    losses = train_losses(run_dir)
    assert sorted(losses) == list(range(1, 13))
    assert all(v == v and abs(v) < 100 for v in losses.values())


def test_nan_excursion_is_healed_by_rollback(corpus, tmp_path):
    run_dir = tmp_path / "run"
    ov = tiny_run_overrides(
        corpus,
        **{"train.total_steps": 14, "train.nan_max_consecutive": 3, "train.nan_lr_factor": 0.5},
    )
    r = run_worker(run_dir, ov, env=worker_env(M3RUN_FAULT="nan_at_step=7x3"))
    assert r.returncode == 0, r.stdout + r.stderr
    records = read_jsonl(run_dir / "metrics.jsonl")
    rb = [x for x in records if x["kind"] == "rollback"]
    assert len(rb) == 1 and rb[0]["step"] == 5 and rb[0]["lr_scale"] == 0.5
    assert len(rb[0]["skipped_positions"]) == 3
    for pos in rb[0]["skipped_positions"]:  # every poisoned window is skipped on the replay
        assert f"skipping the data window at position {pos} " in r.stdout
    # after the rollback every step ran with half the scheduled LR
    cfg = load_config(DEMO_CONFIG, ov)
    late = [x for x in records if x["kind"] == "train" and x["time"] > rb[0]["time"]]
    assert late and all(x["lr"] == pytest.approx(0.5 * lr_at(cfg, x["step"])) for x in late)
    assert max(train_losses(run_dir)) == 14


def test_nan_that_rollback_cannot_heal_exits_76(corpus, tmp_path):
    run_dir = tmp_path / "run"
    ov = tiny_run_overrides(corpus, **{"train.total_steps": 20, "train.nan_max_rollbacks": 2})
    r = run_worker(run_dir, ov, env=worker_env(M3RUN_FAULT="nan_from_step=7"))
    assert r.returncode == 76, r.stdout + r.stderr
    assert "NaN excursion not healed" in r.stderr
    assert latest_complete(run_dir).step == 5  # no poisoned checkpoint was ever written


def _fake_tracker(tmp_path: Path, body: str) -> dict[str, str]:
    """A stand-in `wandb` module (the external service is not what is under test)."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "wandb.py").write_text(body)
    pythonpath = os.pathsep.join([str(site), str(Path(__file__).parents[3])])
    return worker_env(WANDB_PROJECT="m3", PYTHONPATH=pythonpath)


def test_tracker_failure_is_an_error_at_first_launch_and_a_warning_on_resume(corpus, tmp_path):
    env = _fake_tracker(
        tmp_path, "def init(**kw):\n    raise PermissionError('API key rejected')\n"
    )
    run_dir = tmp_path / "run"
    ov = tiny_run_overrides(corpus, **{"train.total_steps": 6})
    r = run_worker(run_dir, ov, env=env)
    assert r.returncode == 78
    assert "WANDB_PROJECT" in r.stderr and "API key rejected" in r.stderr
    assert not list_checkpoints(run_dir)
    # a first launch without the tracker, stopped at step 5; the resume keeps training
    assert (
        run_worker(
            run_dir,
            tiny_run_overrides(corpus, **{"train.total_steps": 6}),
            env=worker_env(M3RUN_FAULT="crash_at_step=6"),
        ).returncode
        == 1
    )
    r = run_worker(run_dir, ov, env=env)
    assert r.returncode == 0, r.stderr
    assert "tracker unavailable on resume" in r.stdout


def test_tracker_outage_mid_run_never_kills_the_job(corpus, tmp_path):
    body = (
        "class Run:\n"
        "    def log(self, *a, **k):\n        raise ConnectionError('tracker down')\n"
        "    def finish(self):\n        pass\n"
        "def init(**kw):\n    return Run()\n"
    )
    env = _fake_tracker(tmp_path, body)
    r = run_worker(
        tmp_path / "run", tiny_run_overrides(corpus, **{"train.total_steps": 4}), env=env
    )
    assert r.returncode == 0, r.stderr
    assert "tracker failed (tracker down)" in r.stdout
    assert max(train_losses(tmp_path / "run")) == 4


def test_lr_schedule_warmup_never_zero_and_ends_at_floor(corpus):
    cfg = load_config(
        DEMO_CONFIG,
        tiny_run_overrides(corpus, **{"train.total_steps": 100, "train.warmup_steps": 10}),
    )
    assert lr_at(cfg, 1) == pytest.approx(cfg.train.lr / 10)
    assert lr_at(cfg, 10) == pytest.approx(cfg.train.lr)
    assert lr_at(cfg, 100) == pytest.approx(cfg.train.lr * cfg.train.min_lr_ratio)
    wsd = load_config(
        DEMO_CONFIG,
        tiny_run_overrides(
            corpus,
            **{
                "train.total_steps": 100,
                "train.warmup_steps": 10,
                "train.schedule": "wsd",
                "train.decay_fraction": 0.2,
            },
        ),
    )
    assert lr_at(wsd, 50) == lr_at(wsd, 80) == wsd.train.lr
    assert lr_at(wsd, 90) < wsd.train.lr
    assert lr_at(wsd, 100) == pytest.approx(wsd.train.lr * wsd.train.min_lr_ratio)


def test_heartbeat_and_metrics_records(finished):
    run_dir, _ = finished
    hb = json.loads((run_dir / "heartbeat.json").read_text())
    assert hb["phase"] == "finished" and hb["step"] == 30 and hb["last_checkpoint_step"] == 30
    rec = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"][-1]
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "time"):
        assert key in rec


def test_each_worker_process_records_its_way_to_the_first_step(finished, tmp_path):
    """One `startup_times` record per process, at its first completed step, with the marks in
    the order they happen: what bench/runner/restart_breakdown.py splits a restart into."""
    _, ov = finished
    run_dir = copy_of(finished, tmp_path)  # the first process's record is in its metrics
    again = run_worker(run_dir, [*ov, "train.total_steps=33"], "--force")
    assert again.returncode == 0, again.stderr
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "startup_times"]
    assert [(r["step"], r["resumed_from"]) for r in records] == [(1, None), (31, 30)]
    order = (
        "process_start",
        "imported",
        "setup_start",
        "device_ready",
        "model_init",
        "model_built",
        "resume_start",
        "resume_end",
        "compile_wrapped",
        "setup_end",
        "first_step_end",
    )
    for r in records:
        marks = [r[k] for k in order]
        assert marks == sorted(marks), r
        assert r["setup_start"] - r["process_start"] < 120  # a start time, not a stale one
    assert records[0]["pid"] != records[1]["pid"]


def test_a_run_ends_with_an_eval_when_its_last_step_is_off_the_eval_interval(corpus, tmp_path):
    """Evals every 5 steps of a 7-step run: at step 5 and at the last step, as a trainer
    user expects of the final model."""
    run_dir = tmp_path / "run"
    ov = tiny_run_overrides(
        corpus, **{"train.total_steps": 7, "eval.interval_steps": 5, "eval.steps": 2}
    )
    done = run_worker(run_dir, ov)
    assert done.returncode == 0, done.stderr
    evals = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "eval"]
    assert evals == [5, 7]
