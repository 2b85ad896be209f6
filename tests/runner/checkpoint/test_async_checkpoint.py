"""Checkpoints written in the background (checkpoint.async_save, the default).

In process: the reused snapshot buffers and the background writer. As real worker processes:
async and sync saves write the same bytes, a SIGTERM while a slow write is in flight still ends
with exit 75 and the stop step complete, a failed write crashes the worker and is never reported
complete, a NaN rollback waits for the write in flight, and under torchrun every rank waits for
the writer before exiting. Throughout, the heartbeat never names a step whose checkpoint is
incomplete."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers.runs import DEMO_CONFIG, tiny_run_overrides, worker_env
from helpers.training import train_losses, worker_cmd

from m3run.runner.checkpoint.io import BackgroundWriter, SnapshotBuffers, snapshot, write_checkpoint
from m3run.runner.checkpoint.layout import (
    CheckpointError,
    checkpoint_dir,
    latest_complete,
    list_checkpoints,
    verify_checkpoint,
)
from m3run.runner.files import read_json, read_jsonl

# --------------------------------------------------------------------------- in process


def _states(seed: int) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    model = {
        "w": torch.randn(32, 16, generator=g),
        "b": torch.randn(16, generator=g).to(torch.bfloat16),
        "t": torch.randn(16, 8, generator=g).t(),  # non-contiguous source
    }
    optim = {
        "optimizer": {
            "state": {
                0: {"step": torch.tensor(float(seed)), "exp_avg": torch.randn(32, 16, generator=g)}
            },
            "param_groups": [{"lr": 1e-3, "params": [0]}],
        },
        "rng": {"torch": torch.randint(0, 256, (64,), generator=g, dtype=torch.uint8)},
        "step": seed,
    }
    return model, optim


def test_buffered_snapshot_reuses_its_buffers_and_writes_the_same_bytes(tmp_path: Path) -> None:
    buffers = SnapshotBuffers()
    model, optim = _states(1)
    m1, o1 = snapshot(model, optim, buffers=buffers)
    assert buffers.allocated_bytes == buffers.nbytes > 0
    ptrs = {k: t.data_ptr() for k, t in m1.items()}
    exp_avg_ptr = o1["optimizer"]["state"][0]["exp_avg"].data_ptr()

    model, optim = _states(2)  # same shapes, new values
    m2, o2 = snapshot(model, optim, buffers=buffers)
    assert buffers.allocated_bytes == 0  # warm: a copy, no allocation
    assert {k: t.data_ptr() for k, t in m2.items()} == ptrs
    assert o2["optimizer"]["state"][0]["exp_avg"].data_ptr() == exp_avg_ptr
    model["w"].add_(1.0)  # the snapshot shares nothing with the live state
    assert not torch.equal(m2["w"], model["w"])

    fresh_m, fresh_o = snapshot(*_states(2))
    for name, (cm, co) in {"buffered": (m2, o2), "fresh": (fresh_m, fresh_o)}.items():
        (tmp_path / name).mkdir()
        write_checkpoint(tmp_path / name, 7, cm, co, {"x": 1})
    buffered, fresh = (
        checkpoint_dir(tmp_path / "buffered", 7),
        checkpoint_dir(tmp_path / "fresh", 7),
    )
    assert (buffered / "optim.pt").read_bytes() == (fresh / "optim.pt").read_bytes()
    assert (buffered / "model.safetensors").read_bytes() == (
        fresh / "model.safetensors"
    ).read_bytes()

    model["extra"] = torch.zeros(3)
    model["w"] = torch.zeros(4, 4)  # shape changed: reallocated
    snapshot(model, optim, buffers=buffers)
    assert buffers.allocated_bytes == (3 + 16) * 4


def test_background_writer_hands_over_results_once_and_reraises_failures(tmp_path) -> None:
    writer = BackgroundWriter()
    release = threading.Event()
    target = tmp_path / "ckpt"

    def slow_job() -> Path:
        release.wait(10)
        target.mkdir()
        (target / "f").write_bytes(b"x" * 10)
        return target

    writer.submit(3, slow_job)
    assert writer.pending_step == 3 and writer.running() and not writer.finished()
    with pytest.raises(RuntimeError, match="step 3 has not been collected"):
        writer.submit(4, slow_job)
    assert not writer.join(timeout=0.05)
    release.set()
    assert writer.join()
    result = writer.result()
    assert (result.step, result.path, result.bytes) == (3, target, 10) and result.write_s > 0
    assert writer.pending_step is None and not writer.finished()

    def failing_job() -> Path:
        raise CheckpointError("could not write checkpoint for step 4 under X: [Errno 28] full")

    writer.submit(4, failing_job)
    writer.join()
    with pytest.raises(CheckpointError, match=r"background checkpoint write failed: .*Errno 28"):
        writer.result()
    assert writer.pending_step is None

    def buggy_job() -> Path:
        raise TypeError("bad value")

    writer.submit(5, buggy_job)
    writer.join()
    with pytest.raises(CheckpointError, match="step 5 failed with TypeError: bad value") as e:
        writer.result()
    assert isinstance(e.value.__cause__, TypeError)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_snapshot_lands_in_reused_pinned_buffers(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = torch.nn.Linear(64, 32).cuda()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, fused=True)
    net(torch.randn(4, 64, device="cuda")).square().mean().backward()
    opt.step()
    buffers = SnapshotBuffers()
    snapshot(net.state_dict(), {"optimizer": opt.state_dict()}, buffers=buffers)
    opt.step()  # new values, same shapes
    m, o = snapshot(net.state_dict(), {"optimizer": opt.state_dict()}, buffers=buffers)
    assert buffers.allocated_bytes == 0
    exp_avg = o["optimizer"]["state"][0]["exp_avg"]
    assert all(t.is_pinned() and t.device.type == "cpu" for t in [*m.values(), exp_avg])
    # Complete when snapshot returns: equal to the live state, then independent of it.
    assert torch.equal(exp_avg, opt.state_dict()["state"][0]["exp_avg"].cpu())
    assert all(torch.equal(m[k], v.cpu()) for k, v in net.state_dict().items())
    fresh_m, fresh_o = snapshot(net.state_dict(), {"optimizer": opt.state_dict()})
    for name, (cm, co) in {"pinned": (m, o), "fresh": (fresh_m, fresh_o)}.items():
        (tmp_path / name).mkdir()
        write_checkpoint(tmp_path / name, 1, cm, co, {})
    pinned, fresh = checkpoint_dir(tmp_path / "pinned", 1), checkpoint_dir(tmp_path / "fresh", 1)
    assert (pinned / "optim.pt").read_bytes() == (fresh / "optim.pt").read_bytes()
    assert (pinned / "model.safetensors").read_bytes() == (fresh / "model.safetensors").read_bytes()


# --------------------------------------------------------------------------- real workers


def _overrides(corpus: Path, **extra) -> list[str]:
    return tiny_run_overrides(
        corpus,
        **{
            "checkpoint.keep_last": 100,  # a reported step is never deleted under the test
            "log.heartbeat_interval_s": 0.05,
            **extra,
        },
    )


def _env(fault: str | None = None) -> dict[str, str]:
    return worker_env(M3RUN_FAULT=fault) if fault else worker_env()


class HeartbeatWatch:
    """Samples heartbeat.json while a worker runs; checks, at the moment it is read, that the
    checkpoint named by `last_checkpoint_step` is complete on disk (full sha256 check)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.samples: list[dict] = []
        self.incomplete: list[tuple[int, str | None]] = []
        self._checked: set[int] = set()

    def sample(self) -> dict | None:
        hb = read_json(self.run_dir / "heartbeat.json")
        if hb is None:
            return None
        self.samples.append(hb)
        step = hb.get("last_checkpoint_step")
        if step is not None and step not in self._checked:
            self._checked.add(step)
            ok, reason = verify_checkpoint(checkpoint_dir(self.run_dir, step))
            if not ok:
                self.incomplete.append((step, reason))
        return hb

    def run(self, proc: subprocess.Popen, until=None, timeout: float = 180) -> dict | None:
        """Sample until `until(hb)` holds (returns that heartbeat) or the process exits."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            hb = self.sample()
            if hb is not None and until is not None and until(hb):
                return hb
            if proc.poll() is not None:
                self.sample()
                return None
            time.sleep(0.005)
        proc.kill()
        raise AssertionError(f"worker still running after {timeout}s")


def _no_leftovers(run_dir: Path) -> None:
    left = [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]
    assert not left, left


def _complete_steps(run_dir: Path) -> list[int]:
    return [i.step for i in list_checkpoints(run_dir) if i.complete]


@pytest.mark.slow
def test_async_and_sync_saves_write_bitwise_identical_checkpoints(corpus, tmp_path):
    procs = {}
    for mode in ("true", "false"):
        ov = _overrides(corpus, **{"train.total_steps": 10, "checkpoint.async_save": mode})
        procs[mode] = subprocess.Popen(
            worker_cmd(tmp_path / mode, ov), env=_env(), stdout=subprocess.PIPE, text=True
        )
    outs = {mode: p.communicate(timeout=240)[0] for mode, p in procs.items()}
    for mode, p in procs.items():
        assert p.returncode == 0, outs[mode]
    assert "written in the background" in outs["true"]
    assert "written in the background" not in outs["false"]

    async_dir, sync_dir = tmp_path / "true", tmp_path / "false"
    assert _complete_steps(async_dir) == _complete_steps(sync_dir) == [5, 10]
    for step in (5, 10):
        a, s = checkpoint_dir(async_dir, step), checkpoint_dir(sync_dir, step)
        assert (a / "optim.pt").read_bytes() == (s / "optim.pt").read_bytes(), step
        assert (a / "model.safetensors").read_bytes() == (s / "model.safetensors").read_bytes()
        meta_a, meta_s = (json.loads((d / "meta.json").read_text()) for d in (a, s))
        for m in (meta_a, meta_s):
            m.pop("saved_at")
            m.pop("config_hash")  # the configs differ in checkpoint.async_save
        assert meta_a == meta_s
    assert train_losses(async_dir) == train_losses(sync_dir)
    for d in (async_dir, sync_dir):
        hb = read_json(d / "heartbeat.json")
        assert hb["last_checkpoint_step"] == 10 and hb["checkpoint_in_flight_step"] is None
        assert hb["checkpoint_write_s"] > 0 and hb["checkpoint_time_s"] > 0


@pytest.mark.slow
def test_sigterm_during_a_slow_background_write_exits_75_with_the_stop_step_complete(
    corpus, tmp_path
):
    run_dir = tmp_path / "run"
    ov = _overrides(corpus, **{"train.total_steps": 40})
    proc = subprocess.Popen(
        worker_cmd(run_dir, ov),
        # The worker holds before step 7 until the SIGTERM: the stop comes before the step-10
        # save, which would wait for step 5's write (that wait is stall too).
        env=_env("slow_save=3.0,hold_at_step=7"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    watch = HeartbeatWatch(run_dir)
    try:
        # Training has gone past a checkpoint step whose write is still in flight.
        hb = watch.run(
            proc,
            until=lambda hb: (
                hb.get("checkpoint_in_flight_step") is not None
                and hb["phase"] == "training"
                and hb["step"] > hb["checkpoint_in_flight_step"]
            ),
        )
        assert hb is not None, "the worker exited before a write was seen in flight"
        in_flight = hb["checkpoint_in_flight_step"]
        assert not verify_checkpoint(checkpoint_dir(run_dir, in_flight))[0]
        proc.send_signal(signal.SIGTERM)
        watch.run(proc)
        out = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    assert proc.returncode == 75, out
    stopped_at = int(
        re.search(r"stopped at step (\d+); checkpoint step \1 is complete", out).group(1)
    )
    # After step 6 (the signal came before the hold) or 7 (it released the hold).
    assert in_flight == 5 and stopped_at in (6, 7), (in_flight, stopped_at)
    assert f"waiting for checkpoint step {in_flight} to finish writing" in out
    assert latest_complete(run_dir).step == stopped_at
    assert {in_flight, stopped_at} <= set(_complete_steps(run_dir))
    _no_leftovers(run_dir)
    final = read_json(run_dir / "heartbeat.json")
    assert final["phase"] == "stopped" and final["last_checkpoint_step"] == stopped_at
    assert final["checkpoint_in_flight_step"] is None
    # The stall is the snapshot; the 3 s write happened beside it.
    assert final["checkpoint_write_s"] >= 3.0 and final["checkpoint_time_s"] < 1.5
    assert not watch.incomplete, watch.incomplete
    # The heartbeat never named the in-flight step before its write was complete.
    reported = [s["last_checkpoint_step"] for s in watch.samples]
    assert in_flight in reported and stopped_at in reported


@pytest.mark.slow
@pytest.mark.parametrize("async_save", ["true", "false"])
def test_failed_write_exits_nonzero_and_is_never_reported_complete(corpus, tmp_path, async_save):
    run_dir = tmp_path / "run"
    ov = _overrides(corpus, **{"train.total_steps": 30, "checkpoint.async_save": async_save})
    proc = subprocess.Popen(
        worker_cmd(run_dir, ov),
        env=_env("save_error_at_step=10"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    watch = HeartbeatWatch(run_dir)
    try:
        watch.run(proc)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1, out + err
    assert "could not write checkpoint for step 10" in err and "injected write error" in err
    assert "exits with code 1" in err and "latest complete checkpoint (step 5)" in err
    assert "Traceback" not in err  # a disk error is a message, not a stack trace
    assert "saved checkpoint step 10" not in out
    assert not checkpoint_dir(run_dir, 10).exists()
    assert _complete_steps(run_dir) == [5]
    _no_leftovers(run_dir)
    assert {s["last_checkpoint_step"] for s in watch.samples} <= {None, 5}
    assert not watch.incomplete, watch.incomplete
    # Reported before the next checkpoint step: never trained on past it as if all was well.
    last_step = max(train_losses(run_dir))
    assert last_step == 10 if async_save == "false" else 10 <= last_step <= 15


@pytest.mark.slow
def test_nan_rollback_waits_for_the_write_in_flight(corpus, tmp_path):
    run_dir = tmp_path / "run"
    ov = _overrides(
        corpus,
        **{"train.total_steps": 12, "train.nan_max_consecutive": 3, "train.nan_lr_factor": 0.5},
    )
    # Step 5's write takes 3 s; step 6 and three NaN attempts at step 7 take far less.
    r = subprocess.run(
        worker_cmd(run_dir, ov),
        env=_env("slow_save=3.0,nan_at_step=7x3"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "waiting for checkpoint step 5 to finish writing" in r.stdout
    rollbacks = [x for x in read_jsonl(run_dir / "metrics.jsonl") if x["kind"] == "rollback"]
    assert [x["step"] for x in rollbacks] == [5]
    assert max(train_losses(run_dir)) == 12
    assert read_json(run_dir / "heartbeat.json")["last_checkpoint_step"] == 12


@pytest.mark.slow
def test_under_torchrun_every_rank_waits_for_the_background_write(corpus, tmp_path):
    run_dir = tmp_path / "run"
    ov = _overrides(corpus, **{"train.total_steps": 12, "train.grad_accum_steps": 2})
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "0",
        "-m",
        "m3run.runner.train",
        str(DEMO_CONFIG),
        "--run-dir",
        str(run_dir),
    ]
    for o in ov:
        cmd += ["--set", o]
    r = subprocess.run(cmd, env=_env("slow_save=1.0"), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _complete_steps(run_dir) == [5, 10, 12]
    _no_leftovers(run_dir)
    for name in ("heartbeat.json", "heartbeat.local1.json"):
        hb = read_json(run_dir / name)
        assert hb["phase"] == "finished" and hb["last_checkpoint_step"] == 12, (name, hb)
