"""The supervisor's launch, across supervisors and around the worker, against stand-in workers
(tests/helpers/supervision.py): config freezing, the worker's command line (torchrun too),
checkpoints found at launch, the mirror, startup allowances carried between supervisors and the
console. Outcomes, hangs, stops and the GPU gate are in test_supervisor.py."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers.supervision import (
    FakeGpu,
    argv_for,
    events_named,
    make_run,
    settings,
    supervise,
    wait_for,
)

from m3run.runner.checkpoint.layout import list_checkpoints
from m3run.runner.cli.report import full_status
from m3run.runner.files import read_json, read_jsonl
from m3run.runner.protocol import (
    EVENTS_FILE,
    EXIT_CONFIG,
    EXIT_OK,
    EXIT_STOPPED,
    STATE_FILE,
)
from m3run.runner.supervisor.launch import LaunchError, LaunchOptions, freeze_config
from m3run.runner.supervisor.settings import SupervisorSettings
from m3run.runner.supervisor.supervisor import Supervisor
from m3run.runner.supervisor.worker import ranks_exit_code

REPO = Path(__file__).resolve().parents[3]


# --------------------------------------------------------------------------- config freezing


def _demo_opts(run_dir: Path, *overrides: str, force: bool = False) -> LaunchOptions:
    return LaunchOptions(
        config=REPO / "configs" / "demo_cpu.yaml",
        run_dir=run_dir,
        overrides=list(overrides),
        force=force,
    )


def test_config_is_frozen_and_a_changed_one_refused_unless_forced(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _, first_hash = freeze_config(_demo_opts(run_dir, "train.lr=0.001"))
    frozen = (run_dir / "config.yaml").read_text()
    assert "lr: 0.001" in frozen
    # Same config again: accepted, unchanged.
    assert freeze_config(_demo_opts(run_dir, "train.lr=0.001"))[1] == first_hash
    with pytest.raises(LaunchError) as err:
        freeze_config(_demo_opts(run_dir, "train.lr=0.002"))
    assert err.value.exit_code == EXIT_CONFIG
    assert "train.lr: 0.001 -> 0.002" in str(err.value) and "--force" in str(err.value)
    assert (run_dir / "config.yaml").read_text() == frozen
    _, forced_hash = freeze_config(_demo_opts(run_dir, "train.lr=0.002", force=True))
    assert forced_hash != first_hash and "lr: 0.002" in (run_dir / "config.yaml").read_text()
    assert events_named(read_jsonl(run_dir / EVENTS_FILE), "config_replaced")


def test_bad_config_is_refused_with_exit_78(tmp_path):
    with pytest.raises(LaunchError) as err:
        freeze_config(_demo_opts(tmp_path, "train.lr=-1"))
    assert err.value.exit_code == EXIT_CONFIG and "train.lr" in str(err.value)


def test_corrupt_newest_existing_checkpoint_is_reported_at_launch(tmp_path, standin):
    run_dir = make_run(tmp_path, [{"steps": 4, "ckpt_every": 2}])
    assert supervise(run_dir, standin)[0] == EXIT_OK
    model = run_dir / "checkpoints" / "step_00000004" / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[10] ^= 0xFF
    model.write_bytes(bytes(data))
    code, state, events = supervise(run_dir, standin, [{"steps": 0}])
    assert code == EXIT_OK
    (bad,) = [e for e in events_named(events, "checkpoint_incomplete") if e["step"] == 4]
    assert "newest existing checkpoint, step 4" in bad["reason"] and "sha256" in bad["reason"]
    assert state["last_checkpoint_step"] == 2


def test_a_stale_local_rank_heartbeat_is_a_hang(tmp_path, standin):
    # Rank 0 keeps beating; local rank 1 stopped (its file is fresh for this worker but old).
    run_dir = make_run(tmp_path, [{"steps": 10**6}, {"steps": 1}])
    sup = Supervisor(
        run_dir,
        settings(heartbeat_timeout_s=1.0, stop_grace_s=0.5),
        argv_for(standin, run_dir),
        handle_signals=False,
    )

    def rank1_beats_once():
        wait_for(lambda: (read_json(run_dir / STATE_FILE) or {}).get("worker_pid"))
        (run_dir / "heartbeat.local1.json").write_text(
            json.dumps({"pid": 1, "phase": "training", "step": 1, "ts": time.time()})
        )

    threading.Thread(target=rank1_beats_once).start()
    assert sup.run() == EXIT_OK
    (restart,) = read_json(run_dir / STATE_FILE)["restarts"]
    assert restart["kind"] == "hang" and "in heartbeat.local1.json" in restart["reason"]


def test_worker_command_line_single_process_and_torchrun(tmp_path):
    from m3run.runner.config import DistributedConfig
    from m3run.runner.supervisor.worker import worker_argv

    single = worker_argv(tmp_path)("latest", 1.0)
    assert single == [
        sys.executable,
        "-m",
        "m3run.runner.train",
        str(tmp_path / "config.yaml"),
        "--run-dir",
        str(tmp_path),
        "--resume",
        "latest",
    ]
    assert worker_argv(tmp_path)("4", 0.5)[-2:] == ["--lr-scale", "0.5"]
    two = worker_argv(tmp_path, DistributedConfig(nproc_per_node=2))("7", 1.0)
    assert two[:2] == [sys.executable, "-m"] and "torch.distributed.run" in two
    assert two[two.index("--nproc-per-node") + 1] == "2" and "--standalone" in two
    assert two[two.index("--max-restarts") + 1] == "0"
    assert two[-7:] == [
        "-m",
        "m3run.runner.worker.rank",
        str(tmp_path / "config.yaml"),
        "--run-dir",
        str(tmp_path),
        "--resume",
        "7",
    ]
    multi = worker_argv(
        tmp_path,
        DistributedConfig(nproc_per_node=8, nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29500"),
    )("latest", 1)
    assert "--standalone" not in multi
    assert multi[multi.index("--rdzv-endpoint") + 1] == "10.0.0.1:29500"
    assert multi[multi.index("--rdzv-id") + 1] == tmp_path.name
    assert multi[multi.index("--node-rank") + 1] == "1"


def test_torchrun_exit_1_is_mapped_to_the_ranks_protocol_code(tmp_path):
    started = time.time()

    def protocol_code(code: int) -> int:
        return ranks_exit_code(tmp_path, code, spawn_wall=started, local_ranks=2)

    for rank, code in ((0, 75), (1, 75)):
        (tmp_path / f"worker_exit.local{rank}.json").write_text(
            json.dumps({"code": code, "time": time.time()})
        )
    assert protocol_code(1) == EXIT_STOPPED
    (tmp_path / "worker_exit.local1.json").write_text(json.dumps({"code": 78, "time": time.time()}))
    assert protocol_code(1) == EXIT_CONFIG
    # A rank that died without a record (or records from an older attempt): a crash.
    (tmp_path / "worker_exit.local1.json").write_text(json.dumps({"code": 75, "time": 0}))
    assert protocol_code(1) == 1


def test_checkpoints_are_mirrored_and_restored_onto_a_new_disk(tmp_path, standin):
    mirror = tmp_path / "mirror"
    url = f"file://{mirror}"
    first = tmp_path / "first"
    first.mkdir()
    (first / "plan.json").write_text(json.dumps([{"steps": 4, "ckpt_every": 2}]))
    code, state, events = supervise(first, standin, mirror_url=url, mirror_keep_last=2)
    assert code == EXIT_OK
    assert "mirror_flush" in [e["event"] for e in events]
    # The newest checkpoint reached the mirror before the supervisor exited (meta.json last).
    assert (mirror / "checkpoints" / "step_00000004" / "meta.json").is_file()
    assert full_status(first)["mirror"]["remote_step"] == 4  # `m3run status` shows it
    # A new, empty run dir (another node after preemption) resumes from the mirror.
    second = tmp_path / "second"
    second.mkdir()
    (second / "plan.json").write_text(json.dumps([{"steps": 0}]))
    code, state, events = supervise(second, standin, mirror_url=url)
    assert code == EXIT_OK
    (restore,) = events_named(events, "mirror_restore")
    assert restore["step"] == 4 and state["last_checkpoint_step"] == 4
    assert [c.step for c in list_checkpoints(second) if c.complete] == [4]
    # `--resume none` into an empty run dir starts over: nothing is restored from the mirror.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "plan.json").write_text(json.dumps([{"steps": 0}]))
    code, _, events = supervise(fresh, standin, resume="none", mirror_url=url)
    assert code == EXIT_OK
    # events.jsonl holds the run's history from the mirror too: look at this launch's own.
    launched = max(i for i, e in enumerate(events) if e["event"] == "launch")
    assert not events_named(events[launched:], "mirror_restore")
    assert not list_checkpoints(fresh)


def test_an_unreadable_mirror_ends_the_launch_with_78(tmp_path, standin):
    run_dir = make_run(tmp_path, [{"steps": 1}])
    code, state, _ = supervise(run_dir, standin, mirror_url="s3x://nowhere/prefix")
    assert code == EXIT_CONFIG
    assert state["reason"].startswith("checkpoint mirror:") and "fix:" in state["reason"]
    assert not (run_dir / "attempts.jsonl").exists()


def test_supervisor_settings_defaults_match_the_config_schema():
    """The supervisor's own defaults (used when it is driven without a config file) are the
    config schema's, field by field, so the two cannot drift apart."""

    from m3run.runner.config import CheckpointConfig, LogConfig, SupervisorConfig

    fields = {f.name: f.default for f in dataclasses.fields(SupervisorSettings)}
    schema = {name: f.default for name, f in SupervisorConfig.model_fields.items()}
    shared = fields.keys() & schema.keys()
    assert len(shared) >= 15, sorted(shared)
    assert {n: fields[n] for n in shared} == {n: schema[n] for n in shared}
    assert fields["heartbeat_interval_s"] == LogConfig.model_fields["heartbeat_interval_s"].default
    ck = CheckpointConfig.model_fields
    assert fields["mirror_keep_last"] == ck["keep_last"].default
    assert fields["mirror_flush_s"] == ck["mirror_flush_s"].default
    assert fields["mirror_url"] == ck["mirror_url"].default


def test_startup_hang_is_caught_by_the_calibrated_startup_allowance(tmp_path, standin):
    # The first worker starts in well under a second, then crashes; the second never gets past
    # startup (a stopped process). It is taken for hung after a few times the observed
    # startup, not after the full startup_timeout_s.
    run_dir = make_run(tmp_path, [{"steps": 3, "exit": 1}, {"no_heartbeat": True}, {"steps": 2}])
    t0 = time.monotonic()
    code, state, events = supervise(
        run_dir,
        standin,
        startup_timeout_s=60.0,
        min_startup_timeout_s=0.5,
        heartbeat_safety_factor=3.0,
    )
    assert code == EXIT_OK
    assert time.monotonic() - t0 < 30, "the startup hang waited out startup_timeout_s"
    (hang,) = events_named(events, "hang")
    assert hang["allowance_s"] < 10 and "no heartbeat yet" in hang["reason"]
    assert [r["kind"] for r in state["restarts"]] == ["crash", "hang"]
    assert 0 < state["longest_startup_s"] < hang["allowance_s"]


def test_longest_startup_carries_over_to_the_next_supervisor(tmp_path, standin):
    # The relaunch's worker hangs before its first heartbeat: calibrated from the first run.
    run_dir = make_run(tmp_path, [{"steps": 2}, {"no_heartbeat": True}, {"steps": 1}])
    _, first, _ = supervise(run_dir, standin)
    assert isinstance(first["longest_startup_s"], float)
    code, _, events = supervise(
        run_dir, standin, startup_timeout_s=60.0, min_startup_timeout_s=0.5, resume="none"
    )
    assert code == EXIT_OK
    assert events_named(events, "hang")[0]["allowance_s"] < 10


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_console_is_one_format_with_utc_timestamps_worker_lines_included(
    tmp_path, standin, capsys, log_format
):
    run_dir = make_run(tmp_path, [{"steps": 3, "ckpt_every": 2}])
    sup = Supervisor(
        run_dir,
        settings(),
        argv_for(standin, run_dir),
        console=True,
        log_format=log_format,
        handle_signals=False,
        gpu=FakeGpu(["healthy"]),
    )
    assert sup.run() == EXIT_OK
    lines = [line for line in capsys.readouterr().out.splitlines() if line]
    stamp = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"
    sources = set()
    for line in lines:
        if log_format == "json":
            rec = json.loads(line)
            assert re.fullmatch(stamp, rec["time"]), line
            sources.add(rec["source"])
        else:
            assert re.match(stamp + r" (supervisor|worker) ", line), line
            sources.add(line.split()[1])
            assert "devices" not in line, "the health report belongs in events.jsonl"
    assert sources == {"supervisor", "worker"}


def test_extending_a_finished_run_warns_how_the_learning_rate_jumps(tmp_path, capsys):
    from m3run.runner.checkpoint.io import save_checkpoint
    from m3run.runner.config import load_config
    from m3run.runner.schedule import lr_at

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    freeze_config(_demo_opts(run_dir, "train.total_steps=300"))
    save_checkpoint(run_dir, 300, {"w": torch_zeros()}, {"state": {}, "param_groups": []}, {})
    capsys.readouterr()
    cfg, _ = freeze_config(_demo_opts(run_dir, "train.total_steps=600", force=True))
    err = capsys.readouterr().err
    before = lr_at(load_config(REPO / "configs" / "demo_cpu.yaml", ["train.total_steps=300"]), 301)
    after = lr_at(cfg, 301)
    assert f"the LR jumps from {before:.3g} (the frozen config) to {after:.3g}" in err, err
    assert after > before


def torch_zeros():
    import torch

    return torch.zeros(2)


@pytest.mark.parametrize(
    ("extra", "code", "says"),
    [
        ((), EXIT_OK, "is finished: its checkpoint at step 300 is the last of"),
        (("--resume", "77"), EXIT_CONFIG, "--resume 77: "),
    ],
    ids=["finished", "resume-missing-step"],
)
def test_a_relaunch_with_nothing_to_do_says_so_at_once_and_leaves_the_run_as_it_was(
    tmp_path, extra, code, says
):
    """A relaunch of a finished run says how to train it longer, and `--resume` of a step that
    has no checkpoint is refused, both before a worker or a smoke test starts: the run's
    recorded phase, state and events are untouched."""
    import subprocess

    from helpers.run_dirs import write_run

    from m3run.runner.checkpoint.io import save_checkpoint

    run_dir = tmp_path / "run"
    write_run(run_dir, "finished", alive=False, last_checkpoint_step=300)
    freeze_config(_demo_opts(run_dir, "train.total_steps=300"))
    save_checkpoint(run_dir, 300, {"w": torch_zeros()}, {"state": {}, "param_groups": []}, {})
    (run_dir / EVENTS_FILE).write_text('{"event": "finished", "time": 1.0}\n')
    before = {f: (run_dir / f).read_bytes() for f in (STATE_FILE, EVENTS_FILE)}
    argv = [sys.executable, "-m", "m3run.runner.cli", "launch", str(REPO / "configs/demo_cpu.yaml")]
    argv += ["--run-dir", str(run_dir), "--set", "train.total_steps=300", *extra]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == code, result.stdout + result.stderr
    out = result.stdout + result.stderr
    assert says in out and "Traceback" not in out, out
    if code == EXIT_OK:
        assert "--set train.total_steps=600 --force" in out
    else:
        assert "(complete: 300); fix: --resume latest, or one of those steps" in out
    assert {f: (run_dir / f).read_bytes() for f in before} == before
    assert not (run_dir / "worker.log").exists()
