"""The checkpoint mirror carries the run's history (config, tokenizer, metrics.jsonl,
events.jsonl, TensorBoard files) beside its checkpoints, and a restore brings it back, merged
with what the run dir holds, so `m3run plot` and `m3run status` read the whole run after its
disk was replaced. The real supervisor over the stand-in worker against moto's S3 server and a
file:// mirror, and a real `m3run launch` of the tiny demo run."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.launching import Run, overrides
from helpers.runs import REPO, worker_env
from helpers.s3_server import S3
from helpers.supervision import events_named, supervise

from m3run.runner.checkpoint.layout import latest_complete
from m3run.runner.files import read_jsonl
from m3run.runner.plot import curves
from m3run.runner.protocol import EXIT_OK
from m3run.runner.tracking import TENSORBOARD_DIR

TB_FILE = f"{TENSORBOARD_DIR}/events.out.tfevents.1700000000.node1.1234.0"


def metric(step: int, t: float, loss: float) -> str:
    return json.dumps({"kind": "train", "step": step, "time": t, "loss": loss}) + "\n"


def test_a_new_disk_gets_the_history_back_with_the_checkpoint(tmp_path, standin, monkeypatch):
    s3 = S3()
    try:
        for k, v in s3.env.items():
            monkeypatch.setenv(k, v)
        url = f"s3://{s3.bucket()}/runs/h"
        node1 = tmp_path / "node1"
        node1.mkdir()
        history = {
            "config.yaml": b"train:\n  total_steps: 2\n",
            "tokenizer.json": b'{"model": {"type": "BPE"}}\n',
            "metrics.jsonl": (metric(1, 1.0, 5.0) + metric(2, 2.0, 4.0)).encode(),
            TB_FILE: b"\x18\x00\x00\x00 a TensorBoard record",
        }
        for rel, data in history.items():
            (node1 / rel).parent.mkdir(parents=True, exist_ok=True)
            (node1 / rel).write_bytes(data)
        code, _, _ = supervise(node1, standin, [{"steps": 2, "ckpt_every": 2}], mirror_url=url)
        assert code == EXIT_OK
        node1_events = (node1 / "events.jsonl").read_text().splitlines()

        node2 = tmp_path / "node2"  # a replaced VM: an empty run dir, the same launch
        node2.mkdir()
        code, _, events = supervise(node2, standin, [{"steps": 0}], mirror_url=url)
    finally:
        s3.stop()
    assert code == EXIT_OK
    for rel, data in history.items():
        assert (node2 / rel).read_bytes() == data, rel
    # Every event of node1 is there, in its order, before node2's own.
    lines = (node2 / "events.jsonl").read_text().splitlines()
    assert lines[: len(node1_events)] == node1_events
    (restore,) = events_named(events, "mirror_restore")
    (brought,) = events_named(events, "mirror_history")
    assert restore["step"] == 2 and "metrics.jsonl" in brought["files"]
    assert curves(node2).series["loss"] == ([1, 2], [5.0, 4.0])


def test_a_restore_merges_the_mirrors_history_with_the_run_dirs(tmp_path, standin):
    """Node A's old disk (history to step 2, and a step 3 of its own) comes back after the run
    went on elsewhere to step 4: it resumes from the mirror's step 4 and its history holds
    every record once, in time order, so the curve follows the run the weights came from."""
    url = f"file://{tmp_path / 'mirror'}"
    a = tmp_path / "a"
    a.mkdir()
    plan = [{"steps": 2, "ckpt_every": 2}]
    (a / "metrics.jsonl").write_text(metric(1, 1.0, 5.0) + metric(2, 2.0, 4.0))
    assert supervise(a, standin, plan, mirror_url=url)[0] == EXIT_OK
    old = tmp_path / "old"
    shutil.copytree(a, old)
    with open(a / "metrics.jsonl", "a") as f:
        f.write(metric(3, 3.0, 3.0) + metric(4, 4.0, 2.0))
    assert supervise(a, standin, plan, mirror_url=url)[0] == EXIT_OK
    with open(old / "metrics.jsonl", "a") as f:
        f.write(metric(3, 2.5, 99.0))  # the old disk's own step 3, before it was lost

    code, _, _ = supervise(old, standin, [{"steps": 0}], mirror_url=url)
    assert code == EXIT_OK
    assert latest_complete(old).step == 4
    steps = [(r["step"], r["loss"]) for r in read_jsonl(old / "metrics.jsonl")]
    assert steps == [(1, 5.0), (2, 4.0), (3, 99.0), (3, 3.0), (4, 2.0)]
    assert curves(old).series["loss"] == ([1, 2, 3, 4], [5.0, 4.0, 3.0, 2.0])


def _status(run_dir: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "m3run.runner.cli", "status", str(run_dir), "--json", "--no-gpu"],
        env=worker_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


@pytest.mark.slow
def test_plot_and_status_read_the_whole_run_after_its_run_dir_was_lost(corpus, tmp_path):
    """`m3run launch` with a file:// mirror and TensorBoard, stopped mid-run; the run dir is
    deleted; the same launch into a new empty dir restores the checkpoint and the history, and
    trains to the end: plot, status and TensorBoard see every step."""
    url = f"file://{tmp_path / 'mirror'}"
    sets = overrides(
        corpus, **{"checkpoint.mirror_url": url, "log.tracker": "tensorboard"}
    )  # 24 steps, a checkpoint every 4
    node1 = tmp_path / "node1"
    run = Run(node1, sets)
    run.worker_at(9)
    run.proc.send_signal(signal.SIGTERM)  # a user's stop: the worker saves, the mirror flushes
    assert run.wait() == EXIT_OK, run.output()
    saved = latest_complete(node1).step
    assert 8 <= saved < 24, saved
    before = [r for r in read_jsonl(node1 / "metrics.jsonl") if r.get("kind") == "train"]
    tb_files = {p.name for p in (node1 / TENSORBOARD_DIR).rglob("*") if p.is_file()}
    assert tb_files
    shutil.rmtree(node1)

    node2 = tmp_path / "node2"
    again = Run(node2, sets)
    assert again.wait() == EXIT_OK, again.output()
    after = [r for r in read_jsonl(node2 / "metrics.jsonl") if r.get("kind") == "train"]
    assert after[: len(before)] == before  # node1's records, as node1 wrote them
    assert curves(node2).series["loss"][0] == list(range(1, 25))
    status = _status(node2)
    assert (status["step"], status["last_checkpoint_step"]) == (24, 24)
    assert tb_files <= {p.name for p in (node2 / TENSORBOARD_DIR).rglob("*") if p.is_file()}
    events = read_jsonl(node2 / "events.jsonl")
    assert events[0]["event"] == "launch"  # node1's launch, first
    assert any(e["event"] == "stopped" for e in events)  # and its stop
    (restore,) = events_named(events, "mirror_restore")
    assert restore["step"] == saved
