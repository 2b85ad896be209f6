"""A checkpoint mirror that cannot work is named at launch (exit 78, the URL, the real cause and
the fix), and one that breaks during the run backs off, the end-of-run flush too, each error
naming its real cause. Against moto's S3 server on 127.0.0.1 and file:// mirrors; the
unwritable file:// mirrors are made with a regular file in the path, which stops root too."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers.checkpoint_dirs import write_checkpoint
from helpers.launching import Run, overrides
from helpers.s3_server import S3
from helpers.supervision import supervise

from m3run.runner.protocol import EXIT_CONFIG
from m3run.runner.supervisor.mirror import Mirror
from m3run.runner.supervisor.mirror_upload import MirrorUploader


@pytest.fixture(scope="module")
def s3():
    server = S3()
    with pytest.MonkeyPatch.context() as mp:
        for k, v in server.env.items():
            mp.setenv(k, v)
        yield server
    server.stop()


# --------------------------------------------------------------------------- at launch


def test_a_missing_bucket_ends_the_launch_with_78_naming_url_and_cause(s3, tmp_path, standin):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    url = "s3://nobucket-m3run/run"
    code, state, _ = supervise(run_dir, standin, [{"steps": 2, "ckpt_every": 1}], mirror_url=url)
    assert code == EXIT_CONFIG
    reason = state["reason"]
    assert url in reason and "FileNotFoundError" in reason
    assert "bucket does not exist" in reason and "create the bucket s3://nobucket-m3run" in reason
    assert not (run_dir / "attempts.jsonl").exists()  # no worker ran without its mirror


@pytest.mark.parametrize(
    "where, error",
    [("blocker/run", "NotADirectoryError"), ("blocker", "FileExistsError")],
    ids=["file-on-the-way", "mirror-is-a-file"],
)
def test_an_unwritable_file_mirror_ends_the_launch_with_78(tmp_path, standin, where, error):
    (tmp_path / "blocker").write_text("a regular file where the mirror's directory must be\n")
    url = f"file://{tmp_path / where}"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    code, state, _ = supervise(run_dir, standin, [{"steps": 2}], mirror_url=url)
    assert code == EXIT_CONFIG
    reason = state["reason"]
    assert repr(url) in reason and error in reason and "not a directory: move it away" in reason
    assert not (run_dir / "attempts.jsonl").exists()


def test_m3run_launch_prints_the_mirror_problem_without_a_traceback(tmp_path, corpus):
    (tmp_path / "blocker").write_text("not a directory\n")
    url = f"file://{tmp_path / 'blocker' / 'run'}"
    run = Run(tmp_path / "run", overrides(corpus, **{"checkpoint.mirror_url": url}))
    assert run.wait() == EXIT_CONFIG
    out = run.output()
    assert url in out and "NotADirectoryError" in out and "fix:" in out
    assert "Traceback" not in out


# --------------------------------------------------------------------------- during the run


def _uploader(url: str, run: Path, events: list) -> MirrorUploader:
    return MirrorUploader(
        Mirror(url),
        run,
        keep_last=2,
        poll_s=0.05,
        backoff_initial_s=0.2,
        backoff_max_s=0.8,
        on_event=lambda e, f: events.append((e, f)),
    )


def _errors_during_a_failing_flush(up: MirrorUploader, events: list, run: Path) -> list[dict]:
    """A new checkpoint while the mirror is broken, then the end-of-run flush: bounded."""
    write_checkpoint(run, 10)
    up.notify()
    assert up.flush(3.0) is False
    up.close()
    assert not up.is_alive()
    return [f for e, f in events if e == "mirror_error"]


def test_a_file_mirror_replaced_by_a_file_backs_off_with_its_real_cause(tmp_path):
    mirror_dir = tmp_path / "mirror"
    run = tmp_path / "run"
    write_checkpoint(run, 5)
    events: list = []
    up = _uploader(f"file://{mirror_dir}", run, events)
    up.start()
    assert up.flush(20.0)
    shutil.rmtree(mirror_dir)
    mirror_dir.write_text("the mirror's directory is gone; a file is in its place\n")
    errors = _errors_during_a_failing_flush(up, events, run)
    # One attempt at the notice, one at the flush, then 0.2, 0.4, 0.8, 0.8, … s apart: a
    # handful in 3 s where a busy loop made hundreds.
    assert 1 <= len(errors) <= 8, [e["reason"] for e in errors]
    for e in errors:
        assert "NotADirectoryError" in e["reason"] or "FileExistsError" in e["reason"], e
        assert "vanished" not in e["reason"] and "next attempt in" in e["reason"]


def test_a_bucket_deleted_during_the_run_backs_off_with_its_real_cause(s3, tmp_path):
    bucket = s3.bucket()
    run = tmp_path / "run"
    write_checkpoint(run, 5)
    events: list = []
    up = _uploader(f"s3://{bucket}/run", run, events)
    up.start()
    assert up.flush(20.0)
    client = s3.client()
    for obj in client.list_objects_v2(Bucket=bucket).get("Contents", []):
        client.delete_object(Bucket=bucket, Key=obj["Key"])
    client.delete_bucket(Bucket=bucket)
    errors = _errors_during_a_failing_flush(up, events, run)
    assert 1 <= len(errors) <= 8, [e["reason"] for e in errors]
    for e in errors:
        assert "FileNotFoundError" in e["reason"] and "bucket does not exist" in e["reason"], e
        assert "vanished" not in e["reason"]
