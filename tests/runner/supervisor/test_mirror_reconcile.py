"""At (re)start with a checkpoint mirror, the newest complete checkpoint wins wherever it lives;
one that cannot be restored ends the launch with 78; the mirror's checkpoints are never
overwritten by a replayed step nor pruned above where the run resumed. The real supervisor over
the stand-in worker (tests/helpers/standin_worker.py), a file:// mirror, and moto's S3 server on
127.0.0.1 for an archived object that cannot be read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers.s3_server import S3
from helpers.supervision import attempts, events_named, supervise

from m3run.runner.checkpoint.layout import list_checkpoints
from m3run.runner.protocol import EXIT_CONFIG, EXIT_OK

PLAN = [{"steps": 2, "ckpt_every": 2}]


def remote_meta(mirror: Path, step: int) -> bytes:
    return (mirror / "checkpoints" / f"step_{step:08d}" / "meta.json").read_bytes()


def remote_steps(mirror: Path) -> list[int]:
    return sorted(int(p.parent.name[5:]) for p in (mirror / "checkpoints").glob("step_*/meta.json"))


def node_a_and_its_old_disk(tmp_path: Path, standin: Path, url: str) -> tuple[Path, Path]:
    """Node A trains to step 2 (mirrored); its disk is kept aside as it was then ("old"); the
    run goes on to step 4 (mirrored), as on another node that restored step 2."""
    a = tmp_path / "a"
    a.mkdir()
    code, _, _ = supervise(a, standin, PLAN, mirror_url=url, mirror_keep_last=3)
    assert code == EXIT_OK
    old = tmp_path / "old"
    shutil.copytree(a, old)
    code, _, _ = supervise(a, standin, PLAN, mirror_url=url, mirror_keep_last=3)
    assert code == EXIT_OK
    return a, old


def test_a_newer_mirrored_checkpoint_is_restored_and_never_overwritten(tmp_path, standin):
    mirror = tmp_path / "mirror"
    url = f"file://{mirror}"
    _, old = node_a_and_its_old_disk(tmp_path, standin, url)
    assert remote_steps(mirror) == [2, 4]
    mirrored_4 = remote_meta(mirror, 4)

    # Node A's disk is back with step 2: the relaunch must resume from the mirror's step 4.
    code, state, events = supervise(old, standin, PLAN, mirror_url=url, mirror_keep_last=3)
    assert code == EXIT_OK
    # The mirror's step 4 is the one it had; the new step 6 joined it.
    assert remote_meta(mirror, 4) == mirrored_4
    assert remote_steps(mirror) == [2, 4, 6]
    # The worker started from step 4 (it trained 5 and 6), not from 2.
    assert attempts(old)[-1]["resume"] == "latest"
    assert [c.step for c in list_checkpoints(old) if c.complete] == [2, 4, 6]
    assert state["last_checkpoint_step"] == 6
    launched = max(i for i, e in enumerate(events) if e["event"] == "launch")
    (restore,) = events_named(events[launched:], "mirror_restore")
    assert (restore["step"], restore["local_step"]) == (4, 2)
    assert "step 4" in restore["reason"] and "step 2" in restore["reason"]


def test_a_newer_mirrored_checkpoint_that_cannot_be_read_ends_the_launch_with_78(
    tmp_path, standin, monkeypatch
):
    s3 = S3()
    try:
        for k, v in s3.env.items():
            monkeypatch.setenv(k, v)
        bucket = s3.bucket()
        url = f"s3://{bucket}/runs/x"
        _, old = node_a_and_its_old_disk(tmp_path, standin, url)
        # A lifecycle rule archived the newest mirrored checkpoint: listed, but not readable.
        key = "runs/x/checkpoints/step_00000004/model.safetensors"
        s3.client().copy_object(
            Bucket=bucket,
            Key=key,
            CopySource={"Bucket": bucket, "Key": key},
            StorageClass="GLACIER",
        )
        tries = len(attempts(old))
        code, state, _ = supervise(old, standin, PLAN, mirror_url=url)
    finally:
        s3.stop()
    assert code == EXIT_CONFIG
    reason = state["reason"]
    assert reason.startswith("checkpoint mirror:")
    assert "mirror's step 4" in reason and "(step 2)" in reason and url in reason
    assert "PermissionError" in reason and "--resume 2" in reason and "fix:" in reason
    assert len(attempts(old)) == tries  # no worker started
    assert [c.step for c in list_checkpoints(old)] == [2]  # nothing half-restored
    assert not [p for p in (old / "checkpoints").iterdir() if p.name.startswith(".")]


def test_a_different_checkpoint_of_the_same_step_in_the_mirror_is_kept(tmp_path, standin):
    mirror = tmp_path / "mirror"
    url = f"file://{mirror}"
    _, old = node_a_and_its_old_disk(tmp_path, standin, url)
    mirrored_4 = remote_meta(mirror, 4)
    # The old disk goes on without the mirror and saves a step 4 of its own.
    code, _, _ = supervise(old, standin, PLAN)
    assert code == EXIT_OK
    local_4 = json.loads((old / "checkpoints" / "step_00000004" / "meta.json").read_text())
    assert local_4["files"] != json.loads(mirrored_4)["files"]

    code, _, events = supervise(old, standin, [{"steps": 0}], mirror_url=url)
    assert code == EXIT_OK
    assert remote_meta(mirror, 4) == mirrored_4
    events = events[max(i for i, e in enumerate(events) if e["event"] == "launch") :]
    (conflict,) = events_named(events, "mirror_conflict")
    assert conflict["step"] == 4 and "kept" in conflict["reason"]
    assert conflict["local_sha256"] != conflict["mirror_sha256"]
    (flush,) = events_named(events, "mirror_flush")
    assert "step 4" in flush["reason"]


@pytest.mark.parametrize("resume", ["2", "none"])
def test_a_run_that_starts_behind_the_mirror_never_overwrites_nor_prunes_its_newer_steps(
    tmp_path, standin, resume
):
    mirror = tmp_path / "mirror"
    url = f"file://{mirror}"
    run = tmp_path / "run"
    run.mkdir()
    for steps in (4, 2):  # each launch mirrors its last checkpoint: 4, then 6
        plan = [{"steps": steps, "ckpt_every": 2}]
        code, _, _ = supervise(run, standin, plan, mirror_url=url, mirror_keep_last=2)
        assert code == EXIT_OK
    assert remote_steps(mirror) == [4, 6]
    kept = {s: remote_meta(mirror, s) for s in (4, 6)}

    # Back to step 2 (or to scratch): the replay saves steps 3, 4 and 5 again, each different.
    code, _, events = supervise(
        run,
        standin,
        [{"steps": 3, "ckpt_every": 1}],
        resume=resume,
        mirror_url=url,
        mirror_keep_last=1,
    )
    assert code == EXIT_OK
    assert {s: remote_meta(mirror, s) for s in (4, 6)} == kept
    newest = 5 if resume == "2" else 3
    assert newest in remote_steps(mirror)
    launched = max(i for i, e in enumerate(events) if e["event"] == "launch")
    (diverged,) = events_named(events[launched:], "mirror_diverged")
    assert diverged["steps"] == [4, 6] and "--resume latest" in diverged["reason"]
