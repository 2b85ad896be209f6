"""The checkpoint mirror against a real S3-compatible server (moto's server mode) on 127.0.0.1:
upload protocol, remote retention, verified restore, the background uploader's retries, the
mirror_url config check, and a preempt → empty run dir → restore → exact resume cycle through
`m3run launch` (the real supervisor and worker)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.runs import DEMO_CONFIG, tiny_run_overrides, worker_env
from helpers.s3_server import CREDENTIALS, FAST_FAIL, S3, boto_credentials, free_port
from safetensors.torch import load_file

from m3run.runner.checkpoint.io import save_checkpoint
from m3run.runner.checkpoint.layout import (
    checkpoint_dir,
    latest_complete,
    list_checkpoints,
    verify_checkpoint,
)
from m3run.runner.config import ConfigError, load_config
from m3run.runner.files import read_json, read_jsonl
from m3run.runner.protocol import EXIT_STOPPED
from m3run.runner.supervisor.mirror import MIRROR_FILE, Mirror, MirrorError, read_lag
from m3run.runner.supervisor.mirror_probe import probe
from m3run.runner.supervisor.mirror_reconcile import reconcile
from m3run.runner.supervisor.mirror_upload import MirrorUploader

moto_server = pytest.importorskip("moto.server", reason="the S3 tests need moto[server]")
pytest.importorskip("s3fs", reason="the S3 tests need s3fs")


@pytest.fixture(scope="module")
def s3():
    with pytest.MonkeyPatch.context() as mp:
        server = S3()
        for k, v in server.env.items():
            mp.setenv(k, v)
        yield server
        server.stop()


@pytest.fixture
def mirror(s3) -> Mirror:
    return Mirror(f"s3://{s3.bucket()}/runs/test")


def restore(m: Mirror, run_dir: Path) -> int | None:
    """What a supervisor starting on `run_dir` with --resume latest restores: the step, or None."""
    return reconcile(m, run_dir, "latest", probe(m), lambda *a, **k: None).restored


def fake_save(run_dir: Path, step: int, value: float = 0.0) -> Path:
    """A real (small) checkpoint written by runner.checkpoint.save_checkpoint."""
    run_dir.mkdir(parents=True, exist_ok=True)
    model = {"w": torch.full((64, 64), float(step) + value), "b": torch.arange(8.0)}
    optim = {"step": step, "exp_avg": torch.full((64,), value)}
    return save_checkpoint(run_dir, step, model, optim, {"tokens_seen": step * 100})


def remote_files(m: Mirror, step: int) -> set[str]:
    m.fs.invalidate_cache()
    try:
        return {p.rsplit("/", 1)[1] for p in m.fs.find(m.remote_path(step))}
    except FileNotFoundError:
        return set()


# --------------------------------------------------------------------------- upload & restore


@pytest.mark.parametrize("scheme", ["s3", "file"])
def test_upload_then_restore_into_an_empty_run_dir(scheme, s3, tmp_path):
    url = (
        f"s3://{s3.bucket()}/runs/a"
        if scheme == "s3"
        else f"file://{tmp_path / 'shared' / 'runs' / 'a'}"
    )
    m = Mirror(url)
    src = tmp_path / "src"
    fake_save(src, 5)
    newest = fake_save(src, 10)
    assert m.upload_checkpoint(newest) is True
    assert m.upload_checkpoint(newest) is False  # byte-identical: nothing is sent again
    assert [(c.step, c.complete) for c in m.list_remote()] == [(10, True)]

    dst = tmp_path / "dst"
    assert restore(m, dst) == 10
    restored = checkpoint_dir(dst, 10)
    assert verify_checkpoint(restored, full=True) == (True, None)
    for name in ("model.safetensors", "optim.pt", "meta.json"):
        assert (restored / name).read_bytes() == (newest / name).read_bytes()
    assert [p.name for p in (dst / "checkpoints").iterdir()] == ["step_00000010"]  # no tmp left
    # A run dir that already has a complete checkpoint is never touched.
    assert restore(m, src) is None


def test_a_resaved_step_makes_the_remote_copy_incomplete_first_then_replaces_it(mirror, tmp_path):
    run = tmp_path / "run"
    first = fake_save(run, 10, value=1.0)
    mirror.upload_checkpoint(first)
    old_meta = (first / "meta.json").read_bytes()
    second = fake_save(run, 10, value=2.0)  # the same step saved again (e.g. after a rollback)
    assert (second / "meta.json").read_bytes() != old_meta
    assert mirror.upload_checkpoint(second) is True
    (remote,) = mirror.list_remote()
    assert remote.complete and remote.meta_bytes == (second / "meta.json").read_bytes()
    assert restore(mirror, tmp_path / "fresh") == 10
    got = load_file(str(checkpoint_dir(tmp_path / "fresh", 10) / "model.safetensors"))
    assert torch.equal(got["w"], torch.full((64, 64), 12.0))


def test_an_interrupted_upload_is_never_complete_remotely(mirror, tmp_path):
    run = tmp_path / "run"
    mirror.upload_checkpoint(fake_save(run, 5))
    bad = fake_save(run, 10)
    # optim.pt rots after meta.json recorded its hash (same size): the upload streams both data
    # files, finds the digest mismatch and must stop before meta.json.
    data = bytearray((bad / "optim.pt").read_bytes())
    data[-1] ^= 0xFF
    (bad / "optim.pt").write_bytes(bytes(data))
    with pytest.raises(MirrorError, match=r"optim\.pt does not match meta\.json"):
        mirror.upload_checkpoint(bad)
    assert "meta.json" not in remote_files(mirror, 10)
    infos = {c.step: c for c in mirror.list_remote()}
    assert infos[5].complete
    assert 10 not in infos or not infos[10].complete
    assert restore(mirror, tmp_path / "fresh") == 5


def test_restore_skips_a_corrupt_remote_checkpoint_for_the_next_older(mirror, tmp_path):
    run = tmp_path / "run"
    mirror.upload_checkpoint(fake_save(run, 5))
    mirror.upload_checkpoint(fake_save(run, 10))
    target = f"{mirror.remote_path(10)}/model.safetensors"
    rotten = bytearray(mirror.fs.cat_file(target))
    rotten[-3] ^= 0x55  # same size, so only the hash can tell
    mirror.fs.pipe_file(target, bytes(rotten))
    fresh = tmp_path / "fresh"
    assert restore(mirror, fresh) == 5
    assert [i.step for i in list_checkpoints(fresh)] == [5]
    assert not any(p.name.startswith(".tmp-") for p in (fresh / "checkpoints").iterdir())


def test_remote_retention_keeps_the_newest_keep_last(mirror, tmp_path):
    run = tmp_path / "run"
    for step in (5, 10, 15, 20):
        mirror.upload_checkpoint(fake_save(run, step))
    # leftovers of an upload cut short below the newest complete one
    mirror.fs.pipe_file(f"{mirror.remote_path(12)}/model.safetensors", b"partial")
    assert mirror.apply_retention(2) == [5, 10, 12]
    assert [(c.step, c.complete) for c in mirror.list_remote()] == [(15, True), (20, True)]
    with pytest.raises(ValueError, match="keep_last"):
        mirror.apply_retention(0)


def test_empty_mirror_restores_nothing(mirror, tmp_path):
    assert restore(mirror, tmp_path / "fresh") is None
    assert mirror.lag(tmp_path / "fresh")["remote_step"] is None


def test_unreachable_mirror_at_start_is_an_error_naming_the_url(tmp_path):
    port = free_port()  # nothing listens there
    with pytest.MonkeyPatch.context() as mp:
        for k, v in CREDENTIALS.items():
            mp.setenv(k, v)
        mp.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
        m = Mirror("s3://nobody/run", storage_options=FAST_FAIL)
        with pytest.raises(MirrorError) as e:
            probe(m, attempts=2, backoff_s=0.1)
    assert "s3://nobody/run" in str(e.value) and "AWS_ENDPOINT_URL" in str(e.value)


def test_missing_backend_package_is_named():
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("gcsfs is installed here: the missing-package path cannot be reached")
    with pytest.raises(MirrorError, match=r"gcsfs.*pip install gcsfs"):
        Mirror("gs://bucket/run")


# --------------------------------------------------------------------------- background uploader


def _wait_for(predicate, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"condition not met within {timeout}s")


def test_uploader_retries_with_backoff_until_the_mirror_comes_back(tmp_path):
    port = free_port()
    run = tmp_path / "run"
    fake_save(run, 5)
    with pytest.MonkeyPatch.context() as mp:
        for k, v in CREDENTIALS.items():
            mp.setenv(k, v)
        mp.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
        m = Mirror("s3://late/run", storage_options=FAST_FAIL)
        events: list[tuple[str, dict]] = []
        up = MirrorUploader(
            m,
            run,
            keep_last=1,
            poll_s=0.2,
            backoff_initial_s=0.2,
            backoff_max_s=0.4,
            on_event=lambda e, f: events.append((e, f)),
        )
        up.start()
        try:
            # No server: failures are recorded, training (this thread) is never blocked.
            state = _wait_for(
                lambda: (s := read_json(run / MIRROR_FILE) or {}).get("failures", 0) >= 2 and s
            )
            assert state["last_error"] and state["remote_step"] is None
            lag = read_lag(run)
            assert lag["steps_behind"] == 5 and lag["last_error"] == state["last_error"]
            assert up.flush(0.3) is False and up.is_alive()

            fake_save(run, 10)  # meanwhile training went on
            server = S3(port=port)  # the mirror comes back on the same endpoint
            try:
                import boto3

                boto3.client(
                    "s3", endpoint_url=server.endpoint, **boto_credentials()
                ).create_bucket(Bucket="late")
                up.notify()
                assert up.flush(30.0) is True
                lag = read_lag(run)
                assert (lag["remote_step"], lag["steps_behind"], lag["last_error"]) == (10, 0, None)
                assert m.lag(run)["remote_step"] == 10
                assert [c.step for c in m.list_remote() if c.complete] == [10]
            finally:
                up.close()
                server.stop()
        finally:
            up.close()
    kinds = [e for e, _ in events]
    assert "mirror_error" in kinds and kinds[-1] == "mirror_upload"
    assert not up.is_alive()


def test_uploader_follows_new_checkpoints_and_applies_remote_retention(mirror, tmp_path):
    run = tmp_path / "run"
    up = MirrorUploader(mirror, run, keep_last=2, poll_s=0.1)
    up.start()
    try:
        for step in (5, 10, 15):
            fake_save(run, step)
            up.notify()
            assert up.flush(20.0)
        assert [c.step for c in mirror.list_remote()] == [10, 15]
    finally:
        up.close()
    assert not up.is_alive()


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "url, needle",
    [
        ("http://example.com/x", "must be an s3://"),
        ("my-bucket/run", "must be an s3://"),
        ("s3://", "names no bucket"),
        ("file://relative/dir", "absolute directory"),
    ],
)
def test_bad_mirror_url_is_a_config_error_naming_value_and_fix(url, needle):
    with pytest.raises(ConfigError) as e:
        load_config(DEMO_CONFIG, [f"checkpoint.mirror_url={url}"])
    msg = str(e.value)
    assert needle in msg and repr(url) in msg and "fix:" in msg


def test_mirror_url_round_trips_through_the_resolved_config():
    cfg = load_config(DEMO_CONFIG, ["checkpoint.mirror_url=s3://bucket/runs/x"])
    assert cfg.checkpoint.mirror_url == "s3://bucket/runs/x"
    assert load_config(DEMO_CONFIG).checkpoint.mirror_url is None


# --------------------------------------------------------------------------- end to end


def _worker(run_dir: Path, overrides: list[str], env: dict) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "m3run.runner.train", str(DEMO_CONFIG), "--run-dir", str(run_dir)]
    for o in overrides:
        cmd += ["--set", o]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _losses(run_dir: Path) -> dict[int, float]:
    return {
        r["step"]: r["loss"]
        for r in read_jsonl(run_dir / "metrics.jsonl")
        if r.get("kind") == "train"
    }


@pytest.mark.slow
def test_preempted_launch_resumes_exactly_on_a_new_disk_from_the_mirror(s3, corpus, tmp_path):
    """`m3run launch` with a mirror: a cloud preemption notice stops node 1 after a save (exit
    75) with its checkpoints mirrored; the same launch on node 2, with an empty run dir, restores
    the newest one from the mirror and finishes with the uninterrupted run's losses and weights,
    bit for bit."""
    from helpers.metadata_server import FakeMetadataServer

    url = f"s3://{s3.bucket()}/runs/e2e"
    # Long enough that the notice lands mid-run on a fast machine too: it is announced after
    # step 6, and the supervisor takes up to ~0.5 s (two polls) to see it and stop the worker,
    # while the tiny model runs ~35 steps/s.
    train = {"train.total_steps": 80, "checkpoint.interval_steps": 5, "checkpoint.keep_last": 2}
    env = worker_env(**s3.env)
    ref = _worker(tmp_path / "ref", tiny_run_overrides(corpus, **train), env)

    with FakeMetadataServer("aws") as meta:
        ov = tiny_run_overrides(
            corpus,
            **train,
            **{
                "checkpoint.mirror_url": url,
                "checkpoint.mirror_flush_s": 60,
                "supervisor.smoke": "false",
                "supervisor.preemption_provider": "aws",
                "supervisor.metadata_url": meta.base_url,
                "supervisor.preemption_poll_s": 0.2,
            },
        )

        def launch(run_dir: Path) -> subprocess.Popen:
            cmd = [sys.executable, "-m", "m3run.runner.cli", "launch", str(DEMO_CONFIG)]
            cmd += ["--run-dir", str(run_dir)]
            for o in ov:
                cmd += ["--set", o]
            return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

        node1 = tmp_path / "node1"
        sup = launch(node1)
        _wait_for(lambda: max(_losses(node1) or [0]) >= 6, timeout=120)
        meta.announce(action="terminate")
        out = sup.communicate(timeout=120)[0].decode()
        assert sup.returncode == EXIT_STOPPED, out
        saved = latest_complete(node1).step
        assert 5 <= saved < 80, f"the stop should land mid-run, got checkpoint step {saved}"
        events = [e["event"] for e in read_jsonl(node1 / "events.jsonl")]
        assert "mirror_upload" in events and "mirror_flush" in events
        status = json.loads(
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "m3run.runner.cli",
                    "status",
                    str(node1),
                    "--json",
                    "--no-gpu",
                ],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
        assert status["mirror"]["remote_step"] == saved
        assert status["mirror"]["steps_behind"] == 0 and status["mirror"]["last_error"] is None
        assert [c.step for c in Mirror(url).list_remote() if c.complete][-1] == saved

        # Node 2: a new, empty disk; the same command.
        meta.clear()
        node2 = tmp_path / "node2"
        sup2 = launch(node2)
        out2 = sup2.communicate(timeout=180)[0].decode()
        assert sup2.returncode == 0, out2
    restore = [e for e in read_jsonl(node2 / "events.jsonl") if e["event"] == "mirror_restore"]
    assert [e["step"] for e in restore] == [saved]

    out_ref = ref.communicate(timeout=180)[0].decode()
    assert ref.returncode == 0, out_ref
    # node2's metrics.jsonl holds node1's steps too (the history came back with the
    # checkpoint); the steps after the restore are node2's own, its records written last.
    ref_losses, history = _losses(tmp_path / "ref"), _losses(node2)
    after = {s: v for s, v in history.items() if s > saved}
    assert sorted(history) == list(range(1, 81))
    assert sorted(after) == list(range(saved + 1, 81))
    assert after == {s: ref_losses[s] for s in after}  # bitwise: float equality
    a = load_file(str(latest_complete(node2).path / "model.safetensors"))
    b = load_file(str(latest_complete(tmp_path / "ref").path / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # The finished run's last checkpoint reached the mirror too.
    assert [c.step for c in Mirror(url).list_remote() if c.complete][-1] == 80


def test_resume_of_a_step_neither_the_run_dir_nor_the_mirror_holds_is_refused(tmp_path):
    """With a mirror, launch leaves `--resume STEP` to the supervisor's start, which restores a
    step only the mirror holds and refuses one that nobody holds, naming both places."""
    m = Mirror(f"file://{tmp_path / 'mirror'}")
    run = tmp_path / "run"
    m.upload_checkpoint(fake_save(run, 5))
    fresh = tmp_path / "fresh"
    events: list[str] = []
    found = reconcile(m, fresh, "5", probe(m), lambda event, **k: events.append(event))
    assert (found.restored, events) == (5, ["mirror_restore"])
    with pytest.raises(MirrorError, match=r"--resume 7: neither .* nor the mirror file://"):
        reconcile(m, fresh, "7", probe(m), lambda *a, **k: None)
