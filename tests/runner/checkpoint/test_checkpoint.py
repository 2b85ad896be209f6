"""Checkpoints: atomic writes, hash verification, discovery, retention, torch-free discovery.

Everything here touches real files with real fsync; the crash test SIGKILLs a real writer."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from m3run.runner.checkpoint.io import load_checkpoint, save_checkpoint
from m3run.runner.checkpoint.layout import (
    VERIFIED_FILE,
    CheckpointError,
    apply_retention,
    checkpoint_dir,
    find_step,
    format_checkpoint_table,
    latest_complete,
    list_checkpoints,
    verify_checkpoint,
)
from m3run.runner.checkpoint.snapshot import snapshot
from m3run.runner.checkpoint.write import write_checkpoint
from m3run.runner.files import sha256_file


def _model_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 16, generator=g),
        "layers.0.norm.weight": torch.randn(16, generator=g).to(torch.bfloat16),
        "layers.0.mixer.D": torch.randn(4, generator=g, dtype=torch.float64),
        # Non-contiguous input: must be saved contiguous and read back equal.
        "layers.0.mixer.out_proj.weight": torch.randn(16, 32, generator=g).t(),
        "counts": torch.arange(10, dtype=torch.int64),
    }


def _optim_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "optimizer": {"state": {0: {"exp_avg": torch.randn(8, generator=g)}}, "param_groups": []},
        "step": seed,
    }


def _save(run_dir: Path, step: int, seed: int | None = None, **meta) -> Path:
    seed = step if seed is None else seed
    return save_checkpoint(run_dir, step, _model_state(seed), _optim_state(seed), meta)


def _flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _assert_state_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert a[k].shape == b[k].shape, k
        assert torch.equal(a[k].contiguous().view(torch.uint8), b[k].view(torch.uint8)), k


# --------------------------------------------------------------------------- round trip


def test_round_trip_is_bitwise_and_meta_is_filled(tmp_path: Path) -> None:
    model, optim = _model_state(1), _optim_state(1)
    before = time.time()
    path = save_checkpoint(
        tmp_path, 4000, model, optim, {"tokens_seen": 123456, "config_hash": "abc"}
    )

    assert path == tmp_path / "checkpoints" / "step_00004000" == checkpoint_dir(tmp_path, 4000)
    assert sorted(p.name for p in path.iterdir()) == ["meta.json", "model.safetensors", "optim.pt"]

    infos = list_checkpoints(tmp_path)
    assert [(i.step, i.path, i.complete, i.reason) for i in infos] == [(4000, path, True, None)]

    loaded_model, loaded_optim, meta = load_checkpoint(path)
    _assert_state_equal(model, loaded_model)
    assert all(t.is_contiguous() and t.device.type == "cpu" for t in loaded_model.values())
    assert torch.equal(
        loaded_optim["optimizer"]["state"][0]["exp_avg"], optim["optimizer"]["state"][0]["exp_avg"]
    )
    assert loaded_optim["step"] == 1

    assert meta == infos[0].meta == json.loads((path / "meta.json").read_text())
    assert meta["step"] == 4000
    assert meta["format_version"] == 1
    assert meta["tokens_seen"] == 123456 and meta["config_hash"] == "abc"
    assert before <= meta["saved_at"] <= time.time()
    for name in ("model.safetensors", "optim.pt"):
        assert meta["files"][name] == {
            "sha256": sha256_file(path / name),
            "bytes": (path / name).stat().st_size,
        }


def test_snapshot_copies_and_write_checkpoint_matches_save(tmp_path: Path) -> None:
    model, optim = _model_state(2), _optim_state(2)
    cpu_model, cpu_optim = snapshot(model, optim)
    # The snapshot must not alias live training state: mutate the originals afterwards.
    model["embed.weight"].add_(1.0)
    optim["optimizer"]["state"][0]["exp_avg"].zero_()
    path = write_checkpoint(tmp_path, 7, cpu_model, cpu_optim, {})
    loaded_model, loaded_optim, _ = load_checkpoint(path)
    _assert_state_equal(_model_state(2), loaded_model)
    assert torch.equal(
        loaded_optim["optimizer"]["state"][0]["exp_avg"],
        _optim_state(2)["optimizer"]["state"][0]["exp_avg"],
    )


def test_write_checkpoint_refuses_non_snapshot_tensors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"not a contiguous CPU tensor.*snapshot\(\)"):
        write_checkpoint(tmp_path, 1, {"w": torch.zeros(4, 4).t()}, {}, {})
    assert not (tmp_path / "checkpoints" / "step_00000001").exists()


def test_real_adamw_scheduler_and_rng_state_round_trip_weights_only(tmp_path: Path) -> None:
    import numpy as np

    def build() -> tuple[
        torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler
    ]:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
        return net, opt, sched

    def train_step(net, opt, sched) -> float:
        x = torch.randn(5, 8)  # draws from the global RNG, so RNG state matters for resume
        loss = net(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        return loss.item()

    net, opt, sched = build()
    for _ in range(3):
        train_step(net, opt, sched)
    np_state = np.random.RandomState(5).get_state()
    optim_state = {
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": {
            "torch": torch.get_rng_state(),
            "python": random.Random(3).getstate(),
            "numpy": {"keys": torch.from_numpy(np_state[1].copy()), "pos": int(np_state[2])},
        },
        "data": {"epoch": 0, "position": 4096, "shard": "train-000.bin"},
        "step": 3,
    }
    path = save_checkpoint(tmp_path, 3, net.state_dict(), optim_state, {"tokens_seen": 3 * 5})
    expected = [train_step(net, opt, sched) for _ in range(3)]

    # The property the design promises: optim.pt loads with weights_only=True, on its own.
    raw = torch.load(path / "optim.pt", weights_only=True)
    assert raw["data"] == {"epoch": 0, "position": 4096, "shard": "train-000.bin"}
    assert raw["rng"]["python"] == random.Random(3).getstate()

    model_state, optim_loaded, _ = load_checkpoint(path)
    net2, opt2, sched2 = build()
    net2.load_state_dict(model_state)
    opt2.load_state_dict(optim_loaded["optimizer"])
    sched2.load_state_dict(optim_loaded["scheduler"])
    torch.set_rng_state(optim_loaded["rng"]["torch"])
    resumed = [train_step(net2, opt2, sched2) for _ in range(3)]
    assert resumed == expected  # bitwise: exact resume on CPU
    assert np.array_equal(optim_loaded["rng"]["numpy"]["keys"].numpy(), np_state[1])


def test_state_torch_load_weights_only_cannot_read_is_refused_before_writing(
    tmp_path: Path,
) -> None:
    import numpy as np

    bad = {"rng": {"numpy": np.random.RandomState(0).get_state()}}
    with pytest.raises(ValueError, match=r"optim_state\['rng'\]\['numpy'\]\[1\].*ndarray"):
        save_checkpoint(tmp_path, 1, _model_state(), bad, {})
    assert not (tmp_path / "checkpoints").exists()


def test_shared_storage_in_model_state_is_an_error_not_a_dropped_tensor(tmp_path: Path) -> None:
    w = torch.randn(8, 4)
    with pytest.raises(ValueError, match=r"'head.weight'.*shares storage.*'embed.weight'"):
        save_checkpoint(tmp_path, 1, {"embed.weight": w, "head.weight": w}, {}, {})
    with pytest.raises(ValueError, match="shares storage"):
        save_checkpoint(tmp_path, 1, {"a": w, "b": w[:2]}, {}, {})
    assert not (tmp_path / "checkpoints").exists()


def test_bad_meta_is_refused_before_writing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"reserved key.*files"):
        _save(tmp_path, 1, files={})
    with pytest.raises(ValueError, match="meta\\['step'\\] is 2 but the checkpoint step is 1"):
        save_checkpoint(tmp_path, 1, _model_state(), _optim_state(), {"step": 2})
    with pytest.raises(ValueError, match="not JSON-serialisable"):
        _save(tmp_path, 1, loss=torch.tensor(1.0))
    with pytest.raises(ValueError, match="non-negative int"):
        _save(tmp_path, -1)
    assert not (tmp_path / "checkpoints").exists()


def test_saving_into_a_missing_run_dir_names_it(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"run directory .*nope does not exist"):
        _save(tmp_path / "nope", 1)


def test_saving_the_same_step_again_replaces_it_atomically(tmp_path: Path) -> None:
    _save(tmp_path, 5, seed=1)
    path = _save(tmp_path, 5, seed=2, attempt=2)
    model, _, meta = load_checkpoint(path)
    _assert_state_equal(_model_state(2), model)
    assert meta["attempt"] == 2
    assert os.listdir(tmp_path / "checkpoints") == ["step_00000005"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_state_is_snapshotted_to_cpu_and_loads_back_onto_the_gpu(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = torch.nn.Linear(32, 16).cuda()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    net(torch.randn(4, 32, device="cuda")).square().mean().backward()
    opt.step()
    live = {"optimizer": opt.state_dict(), "cuda_rng": torch.cuda.get_rng_state()}

    cpu_model, cpu_optim = snapshot(net.state_dict(), live)
    assert all(t.device.type == "cpu" for t in cpu_model.values())
    assert cpu_optim["optimizer"]["state"][0]["exp_avg"].device.type == "cpu"
    path = write_checkpoint(tmp_path, 1, cpu_model, cpu_optim, {})

    for where in ("cuda", torch.device("cuda", 0)):
        model, optim, _ = load_checkpoint(path, map_location=where)
        for k, v in net.state_dict().items():
            assert model[k].device.type == "cuda" and torch.equal(model[k], v), k
        exp_avg = optim["optimizer"]["state"][0]["exp_avg"]
        assert exp_avg.device.type == "cuda"
        assert torch.equal(exp_avg, live["optimizer"]["state"][0]["exp_avg"])


# --------------------------------------------------------------------------- corruption


@pytest.mark.parametrize("name", ["model.safetensors", "optim.pt"])
def test_flipped_byte_is_a_sha256_mismatch(tmp_path: Path, name: str) -> None:
    path = _save(tmp_path, 10)
    _flip_byte(path / name)

    ok, reason = verify_checkpoint(path)
    assert not ok and reason.startswith(f"sha256 mismatch in {name}")
    # The cheap check sees presence and sizes only, and the size did not change.
    assert verify_checkpoint(path, full=False) == (True, None)

    (info,) = list_checkpoints(tmp_path)
    assert not info.complete and info.reason == reason and info.meta["step"] == 10
    with pytest.raises(CheckpointError, match=rf"{path}.*sha256 mismatch.*m3run checkpoints"):
        load_checkpoint(path)


def _flip_byte_keeping_identity(path: Path) -> None:
    """Corrupt a byte in place, keeping size, inode and mtime: what only a hash can see."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(st.st_size // 2)
        byte = f.read(1)
        f.seek(st.st_size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_ino == st.st_ino and path.stat().st_mtime_ns == st.st_mtime_ns


def test_a_resuming_worker_trusts_the_recorded_check_only_while_the_files_are_unchanged(
    tmp_path: Path,
) -> None:
    path = _save(tmp_path, 10)
    # Only a check that asks to record writes the record (the supervisor's), and only when it
    # passed; a plain check, `m3run checkpoints`' or the mirror's, writes nothing.
    assert verify_checkpoint(path) == (True, None) and not (path / VERIFIED_FILE).exists()
    assert verify_checkpoint(path, record_verified=True) == (True, None)
    record = json.loads((path / VERIFIED_FILE).read_text())
    meta = json.loads((path / "meta.json").read_text())
    for name in ("model.safetensors", "optim.pt"):
        assert record["files"][name]["sha256"] == meta["files"][name]["sha256"]

    # A change no stat can see: the trusting check takes the record's word, every other check
    # hashes and finds it.
    _flip_byte_keeping_identity(path / "optim.pt")
    assert verify_checkpoint(path, trust_verified=True) == (True, None)
    assert latest_complete(tmp_path, trust_verified=True).step == 10
    ok, reason = verify_checkpoint(path)
    assert not ok and reason.startswith("sha256 mismatch in optim.pt")
    assert latest_complete(tmp_path) is None

    # Any change of size, mtime or inode ends the trust: the file is hashed again.
    os.utime(path / "optim.pt", ns=(0, 10**9))
    ok, reason = verify_checkpoint(path, trust_verified=True)
    assert not ok and reason.startswith("sha256 mismatch in optim.pt")
    with pytest.raises(CheckpointError, match=r"sha256 mismatch in optim\.pt"):
        find_step(tmp_path, 10, trust_verified=True)


def test_a_record_for_other_bytes_is_not_trusted_and_a_failed_record_is_no_error(
    tmp_path: Path,
) -> None:
    path = _save(tmp_path, 10)
    assert verify_checkpoint(path, record_verified=True) == (True, None)
    old_record = (path / VERIFIED_FILE).read_text()
    # The step saved again (other weights): the new directory's meta.json records other
    # digests, so the old record (copied in) vouches for nothing, whatever the identities.
    _save(tmp_path, 10, seed=99)
    (path / VERIFIED_FILE).write_text(old_record)
    _flip_byte_keeping_identity(path / "model.safetensors")
    ok, reason = verify_checkpoint(path, trust_verified=True)
    assert not ok and reason.startswith("sha256 mismatch in model.safetensors")

    # A record that cannot be written (here a directory in its place) only means no record.
    other = _save(tmp_path, 20)
    (other / VERIFIED_FILE).mkdir()
    assert verify_checkpoint(other, record_verified=True) == (True, None)
    assert verify_checkpoint(other, trust_verified=True) == (True, None)
    assert (other / VERIFIED_FILE).is_dir()


def test_missing_meta_truncated_file_and_garbage_meta_are_incomplete(tmp_path: Path) -> None:
    a, b, c = _save(tmp_path, 1), _save(tmp_path, 2), _save(tmp_path, 3)
    (a / "meta.json").unlink()
    recorded = json.loads((b / "meta.json").read_text())["files"]["optim.pt"]["bytes"]
    with open(b / "optim.pt", "r+b") as f:
        f.truncate(100)
    (c / "meta.json").write_text("{not json")

    reasons = {i.step: i.reason for i in list_checkpoints(tmp_path, verify=False)}
    assert reasons[1].startswith("meta.json missing")
    assert reasons[2] == f"optim.pt is 100 bytes, meta.json records {recorded}"
    assert reasons[3].startswith("meta.json unreadable")
    assert all(not i.complete for i in list_checkpoints(tmp_path))
    for p in (a, b, c):
        with pytest.raises(CheckpointError, match="not complete"):
            load_checkpoint(p)


def test_meta_step_must_match_directory_name(tmp_path: Path) -> None:
    path = _save(tmp_path, 1)
    moved = checkpoint_dir(tmp_path, 2)
    path.rename(moved)
    ok, reason = verify_checkpoint(moved)
    assert not ok and reason == "meta.json says step 1 but the directory is step_00000002"


def test_load_of_a_missing_directory_names_it(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="step_00000009 is not complete: does not exist"):
        load_checkpoint(checkpoint_dir(tmp_path, 9))


# --------------------------------------------------------------------------- discovery


def test_latest_complete_skips_torn_and_honours_before_step(tmp_path: Path) -> None:
    assert latest_complete(tmp_path) is None  # no checkpoints/ yet
    for step in (10, 20, 30):
        _save(tmp_path, step)
    _flip_byte(checkpoint_dir(tmp_path, 30) / "model.safetensors")

    assert latest_complete(tmp_path).step == 20
    assert latest_complete(tmp_path, before_step=20).step == 10
    assert latest_complete(tmp_path, before_step=25).step == 20
    assert latest_complete(tmp_path, before_step=10) is None


def test_find_step_errors_list_the_complete_steps(tmp_path: Path) -> None:
    for step in (100, 200, 300):
        _save(tmp_path, step)
    (checkpoint_dir(tmp_path, 300) / "meta.json").unlink()

    assert find_step(tmp_path, 200).path == checkpoint_dir(tmp_path, 200)
    with pytest.raises(CheckpointError, match=r"no checkpoint for step 150 .*: 100, 200\. Resume"):
        find_step(tmp_path, 150)
    with pytest.raises(
        CheckpointError, match=r"step_00000300 is incomplete: meta.json missing.*100, 200"
    ):
        find_step(tmp_path, 300)
    with pytest.raises(CheckpointError, match=r"run directory .*absent does not exist"):
        find_step(tmp_path / "absent", 100)


def test_removing_leftovers_is_logged(tmp_path: Path, caplog) -> None:
    _save(tmp_path, 1)
    leftover = tmp_path / "checkpoints" / ".tmp-my-notes.txt"
    leftover.write_text("a user file that happens to match .tmp-*")
    with caplog.at_level(logging.WARNING, logger="m3run.runner.checkpoint.layout"):
        _save(tmp_path, 2)
    assert not leftover.exists()
    assert any(str(leftover) in r.getMessage() for r in caplog.records), caplog.text


def test_stale_tmp_and_del_dirs_are_ignored_and_cleaned_by_next_save(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    root = tmp_path / "checkpoints"
    # What a writer SIGKILLed mid-save leaves: a complete-looking tmp dir and a half-deleted one.
    stale_tmp = root / ".tmp-step_00000002-999-deadbeef"
    (checkpoint_dir(tmp_path, 1)).rename(stale_tmp)
    _save(tmp_path, 1)
    stale_del = root / ".del-step_00000000-999-cafef00d"
    stale_del.mkdir()
    (stale_del / "optim.pt").write_bytes(b"half")
    (root / "step_5").mkdir()  # not a canonical name: ignored

    assert [i.step for i in list_checkpoints(tmp_path)] == [1]
    _save(tmp_path, 3)
    assert sorted(os.listdir(root)) == ["step_00000001", "step_00000003", "step_5"]


def test_format_checkpoint_table(tmp_path: Path) -> None:
    _save(tmp_path, 10)
    _save(tmp_path, 20)
    _flip_byte(checkpoint_dir(tmp_path, 20) / "optim.pt")
    (checkpoint_dir(tmp_path, 30)).mkdir()
    table = format_checkpoint_table(list_checkpoints(tmp_path))
    lines = table.splitlines()
    assert lines[0].split() == ["STEP", "STATUS", "SIZE", "SAVED_AT", "(UTC)"]
    assert lines[1].split()[:2] == ["10", "complete"]
    assert "KiB" in lines[1]
    saved_at = list_checkpoints(tmp_path)[0].meta["saved_at"]
    assert lines[1].endswith(time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(saved_at)))
    assert "torn: sha256 mismatch in optim.pt" in lines[2]
    assert lines[3].split()[:4] == ["30", "torn:", "meta.json", "missing"]
    assert lines[3].endswith("0 B  -")
    assert format_checkpoint_table([]) == "no checkpoints"


# --------------------------------------------------------------------------- retention


def test_retention_keeps_last_and_protected_and_drops_old_torn(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4, 5):
        _save(tmp_path, step)
    (checkpoint_dir(tmp_path, 2) / "meta.json").unlink()  # torn, older than newest complete
    (checkpoint_dir(tmp_path, 7)).mkdir()  # torn, newer: left for inspection

    assert apply_retention(tmp_path, keep_last=2, protect={1}) == [2, 3]
    infos = list_checkpoints(tmp_path)
    assert [(i.step, i.complete) for i in infos] == [(1, True), (4, True), (5, True), (7, False)]
    assert not [n for n in os.listdir(tmp_path / "checkpoints") if n.startswith(".")]

    assert apply_retention(tmp_path, keep_last=1) == [1, 4]
    assert [i.step for i in list_checkpoints(tmp_path)] == [5, 7]
    with pytest.raises(ValueError, match="keep_last must be an int >= 1, got 0"):
        apply_retention(tmp_path, keep_last=0)


# --------------------------------------------------------------------------- torch-free half


def test_discovery_half_never_imports_torch(tmp_path: Path) -> None:
    _save(tmp_path, 10)
    _save(tmp_path, 20)
    _flip_byte(checkpoint_dir(tmp_path, 20) / "model.safetensors")
    code = textwrap.dedent(
        f"""
        import sys
        import m3run.runner.checkpoint.layout as c
        run = {str(tmp_path)!r}
        infos = c.list_checkpoints(run)
        assert [(i.step, i.complete) for i in infos] == [(10, True), (20, False)], infos
        assert c.verify_checkpoint(infos[0].path) == (True, None)
        assert c.latest_complete(run).step == 10
        assert c.find_step(run, 10).complete
        c.format_checkpoint_table(infos)
        assert c.apply_retention(run, keep_last=5) == []
        leaked = sorted(m for m in sys.modules if m.split(".")[0] == "torch"
                        or m == "safetensors.torch")
        assert not leaked, leaked
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


# --------------------------------------------------------------------------- crash safety

_WRITER = textwrap.dedent(
    """
    import sys
    import torch
    from m3run.runner.checkpoint.layout import apply_retention
    from m3run.runner.checkpoint.snapshot import snapshot
    from m3run.runner.checkpoint.write import write_checkpoint

    run_dir, counter = sys.argv[1], int(sys.argv[2])
    n = 1 << 19  # model 8 MiB + optimizer 16 MiB: big enough that a kill lands mid-write
    while True:
        model = {f"w{j}": torch.full((n,), float(counter + j)) for j in range(4)}
        optim = {"state": {0: {"exp_avg": torch.full((4 * n,), float(counter)),
                               "step": torch.tensor(float(counter))}},
                 "param_groups": [{"lr": 1e-3, "params": [0]}]}
        step = 10 * (counter % 4)  # revisits steps, so replacement is exercised too
        # save_checkpoint is snapshot + write_checkpoint; the snapshot is memory only, so the
        # timed window (and the kill) covers the disk part.
        cpu_model, cpu_optim = snapshot(model, optim)
        print("begin", counter, flush=True)
        write_checkpoint(run_dir, step, cpu_model, cpu_optim, {"counter": counter})
        apply_retention(run_dir, keep_last=3)
        print("end", counter, flush=True)
        counter += 1
    """
)


def _check_every_complete_checkpoint_is_whole(run_dir: Path) -> int:
    complete = 0
    for info in list_checkpoints(run_dir):
        if not info.complete:
            continue
        complete += 1
        model, optim, meta = load_checkpoint(info.path)
        counter = meta["counter"]
        assert info.step == 10 * (counter % 4)
        for j in range(4):
            assert torch.all(model[f"w{j}"] == counter + j), (info.path, j)
        assert torch.all(optim["state"][0]["exp_avg"] == counter), info.path
        assert optim["state"][0]["step"].item() == counter
    return complete


def test_sigkilled_writer_never_leaves_a_complete_but_bad_checkpoint(tmp_path: Path) -> None:
    rng = random.Random()
    rounds = rounds_mid_write = 0
    # At least two kills; keep going (up to six) until one has landed mid-write, so the test
    # cannot pass without exercising the torn-write path.
    while (rounds < 2 or rounds_mid_write == 0) and rounds < 6:
        rounds += 1
        counter = rounds * 1000 + rng.randrange(4)  # vary which step the kill hits
        proc = subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(tmp_path), str(counter)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            # Time one full save (not the first, which warms up), then kill the next one at a
            # random point inside the first 80% of that duration: mostly mid-write.
            events: list[tuple[str, float]] = []
            while len([e for e in events if e[0] == "end"]) < 2:
                line = proc.stdout.readline()
                assert line, "writer exited early"
                events.append((line.split()[0], time.monotonic()))
            duration = events[-1][1] - events[-2][1]
            assert proc.stdout.readline().startswith("begin")
            delay = rng.uniform(0, 0.8 * duration)
            time.sleep(delay)
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait(timeout=30)
            proc.stdout.close()
        assert proc.returncode == -signal.SIGKILL

        root = tmp_path / "checkpoints"
        rounds_mid_write += any(n.startswith((".tmp-", ".del-")) for n in os.listdir(root))
        assert _check_every_complete_checkpoint_is_whole(tmp_path) >= 1, f"delay {delay:.3f}s"

    assert rounds_mid_write >= 1, f"no kill in {rounds} rounds landed mid-write"
    _save(tmp_path, 1000)
    assert not [n for n in os.listdir(tmp_path / "checkpoints") if n.startswith(".")]
