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

from m3run.runner.checkpoint.background import BackgroundWriter
from m3run.runner.checkpoint.layout import (
    CheckpointError,
    checkpoint_dir,
    list_checkpoints,
    verify_checkpoint,
)
from m3run.runner.checkpoint.snapshot import SnapshotBuffers, snapshot
from m3run.runner.checkpoint.write import WriteCancelled, write_checkpoint
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
    m3, o3 = snapshot(model, optim, buffers=buffers)
    assert buffers.allocated_bytes == buffers.nbytes > 0
    assert torch.equal(m3["w"], model["w"]) and torch.equal(m3["extra"], model["extra"])
    # Every tensor is a storage of its own (torch.save writes each one alone), the whole state
    # one allocation no larger than the tensors with their 64-byte alignment.
    leaves = [*m3.values(), o3["optimizer"]["state"][0]["exp_avg"], o3["rng"]["torch"]]
    assert len({t.untyped_storage().data_ptr() for t in leaves}) == len(leaves)
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in leaves)
    exact = sum(-(-(t.numel() * t.element_size()) // 64) * 64 for t in leaves) + 64
    assert buffers.nbytes <= exact


def test_background_writer_runs_writes_in_order_and_reraises_failures(tmp_path) -> None:
    writer = BackgroundWriter()
    release = threading.Event()
    order: list[int] = []

    def job_for(step: int):
        def job(cancel: threading.Event) -> Path:
            release.wait(10)
            order.append(step)
            target = tmp_path / f"ckpt{step}"
            target.mkdir()
            (target / "f").write_bytes(b"x" * step)
            return target

        return job

    writer.submit(3, job_for(3))
    writer.submit(4, job_for(4))  # queued behind step 3, never beside it
    assert writer.pending_steps == [3, 4] and writer.running() and not writer.finished()
    assert not writer.join(timeout=0.05)
    release.set()
    assert writer.join()
    result = writer.result()
    assert (result.step, result.path, result.bytes) == (3, tmp_path / "ckpt3", 3)
    assert result.write_s > 0
    writer.join()
    assert writer.result().step == 4 and order == [3, 4]
    assert writer.pending_step is None and not writer.finished()

    def failing_job(cancel: threading.Event) -> Path:
        raise CheckpointError("could not write checkpoint for step 4 under X: [Errno 28] full")

    writer.submit(4, failing_job)
    writer.join()
    with pytest.raises(CheckpointError, match=r"background checkpoint write failed: .*Errno 28"):
        writer.result()
    assert writer.pending_step is None

    def buggy_job(cancel: threading.Event) -> Path:
        raise TypeError("bad value")

    writer.submit(5, buggy_job)
    writer.join()
    with pytest.raises(CheckpointError, match="step 5 failed with TypeError: bad value") as e:
        writer.result()
    assert isinstance(e.value.__cause__, TypeError)


def test_a_cancelled_write_stops_and_one_not_yet_started_never_starts(tmp_path) -> None:
    writer = BackgroundWriter()
    started, ran = threading.Event(), []

    def running_job(cancel: threading.Event) -> Path:
        started.set()
        assert cancel.wait(10)  # a long write that checks its flag between blocks
        raise WriteCancelled(6)

    def queued_job(cancel: threading.Event) -> Path:
        ran.append(7)
        return tmp_path

    writer.submit(6, running_job)
    writer.submit(7, queued_job)
    assert started.wait(10)
    assert writer.cancel(6) and writer.cancel(7) and not writer.cancel(8)
    writer.join_all()
    for step in (6, 7):
        with pytest.raises(WriteCancelled, match=f"step {step} was cancelled"):
            writer.result()
    assert ran == [] and writer.pending_step is None


def test_write_checkpoint_cancelled_midway_leaves_nothing_and_keeps_the_old_one(tmp_path) -> None:
    model, optim = snapshot(*_states(1))
    first = write_checkpoint(tmp_path, 5, model, optim, {})
    before = {p.name: p.read_bytes() for p in first.iterdir()}
    cancel = threading.Event()

    def cancel_now() -> None:  # the data files are written: the flag stops it before meta.json
        cancel.set()

    with pytest.raises(WriteCancelled, match="step 5 was cancelled"):
        write_checkpoint(tmp_path, 5, model, optim, {}, before_meta=cancel_now, cancel=cancel)
    assert {p.name: p.read_bytes() for p in first.iterdir()} == before
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [first.name]
    cancel = threading.Event()
    cancel.set()  # set before it starts: stops at the first block
    with pytest.raises(WriteCancelled):
        write_checkpoint(tmp_path, 6, model, optim, {}, cancel=cancel)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [first.name]


def test_model_file_is_safetensors_as_the_library_reads_it(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(0)
    state = {
        "w": torch.randn(70, 3, generator=g),
        "h": torch.randn(5, generator=g).to(torch.bfloat16),
        "half": torch.randn(3, 2, generator=g).to(torch.float16),
        "d": torch.randn(2, generator=g, dtype=torch.float64),
        "ids": torch.arange(7),
        "i32": torch.arange(3, dtype=torch.int32),
        "mask": torch.tensor([True, False, True]),
        "u8": torch.arange(5, dtype=torch.uint8),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }
    cpu_model, cpu_optim = snapshot(state, {})
    path = write_checkpoint(tmp_path, 1, cpu_model, cpu_optim, {}) / "model.safetensors"
    loaded = load_file(path)
    assert loaded.keys() == state.keys()
    for k, t in state.items():
        assert loaded[k].dtype == t.dtype and torch.equal(loaded[k], t), k
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt"}
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    assert header_len % 8 == 0  # padded, so the data starts aligned as the library aligns it


def test_a_dtype_safetensors_cannot_name_is_refused_before_writing(tmp_path: Path) -> None:
    cpu_model, cpu_optim = snapshot({"z": torch.zeros(2, dtype=torch.complex64)}, {})
    with pytest.raises(ValueError, match=r"model_state\['z'\] is torch.complex64"):
        write_checkpoint(tmp_path, 1, cpu_model, cpu_optim, {})
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


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


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_snapshot_on_a_side_stream_holds_its_steps_state_while_training_goes_on(tmp_path):
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512)
    ).cuda()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, fused=True)
    x = torch.randn(256, 512, device="cuda")

    def train_step(wait=None) -> None:
        net(x).square().mean().backward()
        if wait is not None:  # the worker's rule: the update waits for the copy, on the GPU
            torch.cuda.current_stream().wait_event(wait)
        opt.step()
        opt.zero_grad(set_to_none=True)

    train_step()
    train_step()
    want_m, want_o = snapshot(net.state_dict(), {"optimizer": opt.state_dict()})
    buffers, stream = SnapshotBuffers(), torch.cuda.Stream()
    snap = buffers.fill(net.state_dict(), {"optimizer": opt.state_dict()}, stream=stream)
    assert snap.ready is not None and buffers.pinned, buffers.pin_error
    train_step(wait=snap.ready)  # queued at once: the host does not wait for the copy
    train_step()
    snap.wait()
    for k, t in want_m.items():
        assert torch.equal(snap.model[k], t), k
        assert not torch.equal(net.state_dict()[k].cpu(), t), k  # training went on
    for i, moments in want_o["optimizer"]["state"].items():
        for name, t in moments.items():
            assert torch.equal(snap.optim["optimizer"]["state"][i][name], t), (i, name)
    for name, (cm, co) in {"stream": (snap.model, snap.optim), "sync": (want_m, want_o)}.items():
        (tmp_path / name).mkdir()
        write_checkpoint(tmp_path / name, 2, cm, co, {})
    ours, sync = checkpoint_dir(tmp_path / "stream", 2), checkpoint_dir(tmp_path / "sync", 2)
    assert (ours / "optim.pt").read_bytes() == (sync / "optim.pt").read_bytes()
    assert (ours / "model.safetensors").read_bytes() == (sync / "model.safetensors").read_bytes()


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


def _watched_worker(
    run_dir: Path, ov: list[str], fault: str, apart: bool = False
) -> tuple[subprocess.Popen, HeartbeatWatch]:
    """A worker under M3RUN_FAULT=`fault`, its output in one pipe (`apart`: stderr on its own),
    and the watch on its heartbeat."""
    proc = subprocess.Popen(
        worker_cmd(run_dir, ov),
        env=_env(fault),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE if apart else subprocess.STDOUT,
        text=True,
    )
    return proc, HeartbeatWatch(run_dir)


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


def _stopped_during_held_write(corpus, tmp_path, **extra):
    """A worker SIGTERMed while step 5's write is in flight: every write holds before meta.json
    until TMP/release exists (or the write is cancelled), and the worker holds before step 7
    until the signal. Returns (proc, watch, release)."""
    run_dir, release = tmp_path / "run", tmp_path / "release"
    ov = _overrides(corpus, **{"train.total_steps": 40, **extra})
    proc, watch = _watched_worker(run_dir, ov, f"hold_save={release},hold_at_step=7")
    try:
        hb = watch.run(
            proc,
            until=lambda hb: (
                hb.get("checkpoint_in_flight_step") == 5
                and hb["phase"] == "training"
                and hb["step"] > 5
            ),
        )
        assert hb is not None, "the worker exited before step 5's write was seen in flight"
        assert not verify_checkpoint(checkpoint_dir(run_dir, 5))[0]
        proc.send_signal(signal.SIGTERM)
    except BaseException:
        proc.kill()
        raise
    return proc, watch, release


@pytest.mark.slow
def test_sigterm_during_a_background_write_cancels_it_and_exits_75_with_the_stop_step(
    corpus, tmp_path
):
    run_dir = tmp_path / "run"
    proc, watch, release = _stopped_during_held_write(corpus, tmp_path)
    try:
        # Step 5's write is cancelled, not waited for: the stop's own write is the one in
        # flight next, and only it is released.
        hb = watch.run(proc, until=lambda hb: hb.get("checkpoint_in_flight_step") not in (None, 5))
        assert hb is not None, "the stop's save never came in flight"
        release.touch()
        watch.run(proc)
        out = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    assert proc.returncode == 75, out
    stopped_at = int(
        re.search(r"stopped at step (\d+); checkpoint step \1 is complete", out).group(1)
    )
    assert stopped_at in (6, 7), stopped_at  # the signal came before the hold, or released it
    assert (
        f"stop: cancelling the write of checkpoint step 5, superseded by step {stopped_at}" in out
    )
    assert "checkpoint step 5 was not written: its write was cancelled" in out
    assert "waiting for checkpoint step 5" not in out
    assert _complete_steps(run_dir) == [stopped_at]
    _no_leftovers(run_dir)
    final = read_json(run_dir / "heartbeat.json")
    assert final["phase"] == "stopped" and final["last_checkpoint_step"] == stopped_at
    assert final["checkpoint_in_flight_step"] is None
    assert not watch.incomplete, watch.incomplete
    assert {s["last_checkpoint_step"] for s in watch.samples} <= {None, stopped_at}


@pytest.mark.slow
def test_with_save_on_exit_off_a_stop_finishes_the_write_in_flight_and_saves_nothing_new(
    corpus, tmp_path
):
    run_dir = tmp_path / "run"
    proc, watch, release = _stopped_during_held_write(
        corpus, tmp_path, **{"checkpoint.save_on_exit": "false"}
    )
    try:
        # The stop waits for step 5's write (it is not cancelled: nothing supersedes it).
        assert watch.run(proc, until=lambda hb: hb["phase"] == "stopping") is not None
        release.touch()
        watch.run(proc)
        out = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    assert proc.returncode == 75, out
    assert re.search(r"stopped at step [67]; checkpoint step 5 is complete", out), out
    assert "cancel" not in out
    assert _complete_steps(run_dir) == [5]
    _no_leftovers(run_dir)
    assert not watch.incomplete, watch.incomplete


@pytest.mark.slow
@pytest.mark.parametrize("buffers", [2, 1])
def test_a_checkpoint_step_during_a_write_copies_into_the_other_buffer(corpus, tmp_path, buffers):
    run_dir, release = tmp_path / "run", tmp_path / "release"
    ov = _overrides(corpus, **{"train.total_steps": 14, "checkpoint.snapshot_buffers": buffers})
    proc, watch = _watched_worker(run_dir, ov, f"hold_save={release}")
    try:
        if buffers == 2:
            # Step 10's save queues behind step 5's held write: training goes on past it (with
            # one buffer it could not, and this would time out).
            def until(hb):
                return hb["step"] >= 11 and hb["checkpoint_in_flight_step"] == 5
        else:  # step 10's save waits for step 5's write, training held

            def until(hb):
                return hb["step"] == 10 and hb["phase"] == "checkpointing"

        hb = watch.run(proc, until=until)
        assert hb is not None, "the worker exited before the second checkpoint step"
        release.touch()
        watch.run(proc)
        out = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert _complete_steps(run_dir) == [5, 10, 14]
    if buffers == 1:
        assert "waiting for checkpoint step 5 to finish writing" in out
    # The host memory they cost is said once, when they are allocated after the first step.
    said = re.findall(r"checkpoint buffers: (\d) × [\d,]+ MiB of host memory", out)
    assert said == [str(buffers)], out
    saved = re.findall(r"saved checkpoint step (\d+)", out)
    assert saved == ["5", "10", "14"]  # reported in order, each once complete
    assert not watch.incomplete, watch.incomplete
    _no_leftovers(run_dir)


@pytest.mark.slow
@pytest.mark.parametrize("async_save", ["true", "false"])
def test_failed_write_exits_nonzero_and_is_never_reported_complete(corpus, tmp_path, async_save):
    run_dir = tmp_path / "run"
    ov = _overrides(corpus, **{"train.total_steps": 30, "checkpoint.async_save": async_save})
    proc, watch = _watched_worker(run_dir, ov, "save_error_at_step=10", apart=True)
    try:
        watch.run(proc)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1, out + err
    assert "could not write checkpoint for step 10" in err and "injected write error" in err
    assert "Traceback" not in err  # a disk error is a message, not a stack trace
    assert "saved checkpoint step 10" not in out
    assert not checkpoint_dir(run_dir, 10).exists()
    complete = _complete_steps(run_dir)
    # With two buffers, step 15's save may have been queued behind step 10's write before its
    # failure was seen: that write holds good state, and the worker finishes it before it
    # exits. The message names whichever is the latest complete one.
    allowed = ([5], [5, 15]) if async_save == "true" else ([5],)
    assert complete in allowed, complete
    assert "exits with code 1" in err and f"latest complete checkpoint (step {complete[-1]})" in err
    _no_leftovers(run_dir)
    assert {s["last_checkpoint_step"] for s in watch.samples} <= {None, *complete}
    assert not watch.incomplete, watch.incomplete
    # Reported before a checkpoint step finds no free buffer: never trained on as if all was
    # well past the step that would have to wait for it (step 20 with two buffers).
    last_step = max(train_losses(run_dir))
    assert last_step == 10 if async_save == "false" else 10 <= last_step <= 20


@pytest.mark.slow
def test_a_save_queued_behind_a_failed_write_is_finished_and_named_as_the_restart_point(
    corpus, tmp_path
):
    run_dir, release = tmp_path / "run", tmp_path / "release"
    ov = _overrides(corpus, **{"train.total_steps": 30})
    # Every write holds until `release` exists, and step 10's then fails. With both buffers
    # held (steps 5 and 10), step 15's save waits; released there, step 5's write completes,
    # step 15's is queued behind step 10's, which fails.
    proc, watch = _watched_worker(
        run_dir, ov, f"hold_save={release},save_error_at_step=10", apart=True
    )
    try:
        hb = watch.run(proc, until=lambda hb: hb["step"] == 15 and hb["phase"] == "checkpointing")
        assert hb is not None, "the worker exited before step 15's save"
        release.touch()
        watch.run(proc)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 1, out + err
    assert "could not write checkpoint for step 10" in err
    assert _complete_steps(run_dir) == [5, 15]
    assert "saved checkpoint step 15" in out
    assert "latest complete checkpoint (step 15)" in err, err
    assert 15 <= max(train_losses(run_dir)) <= 20
    assert not watch.incomplete, watch.incomplete
    _no_leftovers(run_dir)


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
