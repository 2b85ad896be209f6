"""The training batch stream: windows, order, resume, ranks, eval set, vocabulary checks."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.tokens import documents_on_disk
from helpers.tokens import stream as read_stream

from m3run.runner.data.loader import BatchLoader, TokenWindows, check_vocab, eval_batches
from m3run.runner.data.manifest import DataError, load_manifest
from m3run.runner.data.prepare import prepare_data
from m3run.runner.data.verify import verify_split

SHARD_TOKENS = 2000


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    inputs, _, _ = documents_on_disk(tmp_path_factory.mktemp("inputs"))
    out = tmp_path_factory.mktemp("prepared") / "data"
    prepare_data(
        [str(p) for p in inputs],
        out,
        tokenizer="bpe:300",
        val_fraction=0.3,
        shard_tokens=SHARD_TOKENS,
        workers=1,
        progress=False,
    )
    return out, None


# ---------------------------------------------------------------------------------------------
# TokenWindows and BatchLoader
# ---------------------------------------------------------------------------------------------

SEQ, MBS = 16, 4


@pytest.fixture(scope="module")
def train_dir(prepared):
    return prepared[0] / "train"


def _read(loader: BatchLoader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [loader.next_batch() for _ in range(n)]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b, strict=True)
    )


def test_windows_cover_the_stream_at_stride_seq_len(train_dir):
    stream = read_stream(train_dir)
    w = TokenWindows(train_dir, SEQ)
    assert len(w) == (len(stream) - 1) // SEQ
    for i in (0, 1, len(w) // 2, len(w) - 1):
        assert np.array_equal(w[i], stream[i * SEQ : i * SEQ + SEQ + 1])
    # A range across a shard boundary reads both shards.
    assert np.array_equal(w.tokens(SHARD_TOKENS - 3, SHARD_TOKENS + 3), stream[1997:2003])
    with pytest.raises(DataError) as e:
        TokenWindows(train_dir, len(stream))
    assert f"has {len(stream)} tokens; one window of seq_len {len(stream)} needs" in str(e.value)


def test_batches_follow_the_seeded_permutation(train_dir):
    loader = BatchLoader(train_dir, SEQ, MBS, seed=7, prefetch=0)
    stream = read_stream(train_dir)
    perm = np.random.Generator(np.random.PCG64([7, 0])).permutation(loader.num_windows)
    for step in range(3):
        x, y = loader.next_batch()
        assert x.dtype == y.dtype == torch.int64
        assert x.shape == y.shape == (MBS, SEQ)
        assert torch.equal(x[:, 1:], y[:, :-1])
        for row in range(MBS):
            i = int(perm[step * MBS + row])
            assert np.array_equal(x[row].numpy(), stream[i * SEQ : i * SEQ + SEQ])
            assert np.array_equal(y[row].numpy(), stream[i * SEQ + 1 : i * SEQ + SEQ + 1])
    assert loader.vocab_size == 300 and loader.eos_id == 0
    assert loader.num_tokens == len(stream)
    loader.close()


def test_same_seed_same_batches_other_seed_other_batches(train_dir):
    a, b, c = (BatchLoader(train_dir, SEQ, MBS, seed=s) for s in (1, 1, 2))
    batches_a, batches_b, batches_c = _read(a, 5), _read(b, 5), _read(c, 5)
    assert _same(batches_a, batches_b)
    assert not torch.equal(batches_a[0][0], batches_c[0][0])
    for loader in (a, b, c):
        loader.close()


def test_resume_from_state_dict_is_bitwise(train_dir, tmp_path):
    reference = BatchLoader(train_dir, SEQ, MBS, seed=3, prefetch=3)
    _read(reference, 4)
    state = reference.state_dict()
    # The prefetcher ran ahead; the state counts only batches handed out.
    assert state["windows_consumed"] == 4 * MBS
    expected = _read(reference, 6)
    reference.close()

    torch.save(state, tmp_path / "state.pt")
    restored_state = torch.load(tmp_path / "state.pt", weights_only=True)
    assert restored_state == state
    assert all(type(v) is int for v in restored_state.values())

    resumed = BatchLoader(train_dir, SEQ, MBS, seed=3, prefetch=3)
    _read(resumed, 2)  # a prefetcher already running must be reset by load_state_dict
    resumed.load_state_dict(restored_state)
    assert _same(_read(resumed, 6), expected)
    resumed.close()


def test_load_state_dict_rejects_another_runs_position(train_dir):
    loader = BatchLoader(train_dir, SEQ, MBS, seed=3)
    state = loader.state_dict()
    with pytest.raises(DataError, match="seed=4, this run has seed=3"):
        loader.load_state_dict({**state, "seed": 4})
    with pytest.raises(DataError, match="seq_len=32, this run has seq_len=16"):
        loader.load_state_dict({**state, "seq_len": 32})
    loader.close()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_skip_equals_reading_and_discarding(train_dir, prefetch):
    reading = BatchLoader(train_dir, SEQ, MBS, seed=5, prefetch=prefetch)
    _read(reading, 5)
    expected = _read(reading, 3)
    skipping = BatchLoader(train_dir, SEQ, MBS, seed=5, prefetch=prefetch)
    _read(skipping, 2)
    skipping.skip(3)
    assert skipping.state_dict()["windows_consumed"] == 5 * MBS
    assert _same(_read(skipping, 3), expected)
    for loader in (reading, skipping):
        loader.close()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_peeked_batch_is_the_next_one_and_moves_nothing(train_dir, prefetch):
    """peek_batch reads the batch next_batch hands out next without consuming it: the saved
    state stays at the step boundary; a skip or a loaded state drops what was peeked."""
    plain = BatchLoader(train_dir, SEQ, MBS, seed=7, prefetch=prefetch)
    expected = _read(plain, 6)
    loader = BatchLoader(train_dir, SEQ, MBS, seed=7, prefetch=prefetch)
    _read(loader, 1)
    state = loader.state_dict()
    peeked = loader.peek_batch()
    assert loader.peek_batch() is peeked and loader.state_dict() == state
    assert _same([peeked], expected[1:2]) and _same(_read(loader, 2), expected[1:3])
    loader.peek_batch()  # the batch at position 3 · MBS, then a jump past it
    loader.skip(1)
    assert _same([loader.peek_batch()], expected[4:5])
    loader.load_state_dict(state)  # back to position MBS: what was peeked is not handed out
    assert _same(_read(loader, 2), expected[1:3])
    for each in (plain, loader):
        each.close()


def test_prefetch_does_not_change_batches(train_dir):
    loaders = [BatchLoader(train_dir, SEQ, MBS, seed=9, prefetch=p) for p in (0, 1, 4)]
    runs = [_read(loader, 8) for loader in loaders]
    assert _same(runs[0], runs[1]) and _same(runs[0], runs[2])
    for loader in loaders:
        loader.close()


def test_ranks_take_disjoint_slices_of_the_global_batch(train_dir):
    whole = BatchLoader(train_dir, SEQ, 2 * MBS, seed=11)
    ranks = [
        BatchLoader(train_dir, SEQ, MBS, seed=11, rank=r, world_size=2, prefetch=r)
        for r in range(2)
    ]
    for _ in range(4):
        x, y = whole.next_batch()
        (x0, y0), (x1, y1) = (r.next_batch() for r in ranks)
        assert torch.equal(torch.cat([x0, x1]), x) and torch.equal(torch.cat([y0, y1]), y)
        rows0 = {tuple(row.tolist()) for row in x0}
        assert not rows0 & {tuple(row.tolist()) for row in x1}
    # The position is world-size independent: a 1-rank state resumes a 2-rank run.
    assert ranks[0].state_dict() == ranks[1].state_dict() == whole.state_dict()
    x, _ = whole.next_batch()
    restarted = BatchLoader(train_dir, SEQ, MBS, seed=11, rank=1, world_size=2)
    restarted.load_state_dict(ranks[0].state_dict())
    assert torch.equal(restarted.next_batch()[0], x[MBS:])
    for loader in (whole, *ranks, restarted):
        loader.close()


def test_epoch_rollover_reshuffles_and_continues(train_dir):
    seq = 512  # few windows, so a handful of batches spans several epochs
    loader = BatchLoader(train_dir, seq, 3, seed=2)
    n = loader.num_windows
    assert 3 < n < 40
    stream = read_stream(train_dir)
    window_of = {tuple(stream[i * seq : i * seq + seq].tolist()): i for i in range(n)}
    order = []
    while len(order) < 2 * n + 3:
        x, _ = loader.next_batch()
        order += [window_of[tuple(row.tolist())] for row in x]
    assert loader.epoch == len(order) // n
    first, second = order[:n], order[n : 2 * n]
    assert sorted(first) == sorted(second) == list(range(n)), "each epoch visits every window"
    assert first != second, "the next epoch must reshuffle"
    for epoch, visited in enumerate((first, second)):
        perm = np.random.Generator(np.random.PCG64([2, epoch])).permutation(n)
        assert visited == perm.tolist()
    loader.close()


def test_close_stops_the_prefetch_thread(train_dir):
    loader = BatchLoader(train_dir, SEQ, MBS, seed=0, prefetch=2)
    loader.next_batch()
    thread = loader._prefetcher._thread
    assert thread.is_alive()
    loader.close()
    assert not thread.is_alive()
    with pytest.raises(RuntimeError, match="after close"):
        loader.next_batch()


def test_eval_batches_are_fixed_and_spread(prepared):
    val = prepared[0] / "train"  # the bigger split, so several batches fit
    first = eval_batches(val, SEQ, MBS, n_batches=3)
    again = eval_batches(val, SEQ, MBS, n_batches=3)
    assert len(first) == 3 and _same(first, again)
    for x, y in first:
        assert x.shape == (MBS, SEQ) and torch.equal(x[:, 1:], y[:, :-1])
    n = len(TokenWindows(val, SEQ))
    stream = read_stream(val)
    last = (11 * n) // 12  # 12 picks spread over n windows
    assert np.array_equal(first[-1][0][-1].numpy(), stream[last * SEQ : last * SEQ + SEQ])
    with pytest.raises(DataError, match="one eval batch needs"):
        eval_batches(val, 512, 1000, n_batches=1)


def test_check_vocab(prepared, train_dir):
    manifest = load_manifest(train_dir)
    check_vocab(manifest, 300)
    check_vocab(manifest, 512)
    with pytest.raises(DataError) as e:
        check_vocab(manifest, 256)
    msg = str(e.value)
    assert "300" in msg and "256" in msg
    assert "set model.vocab_size ≥ 300" in msg and "prepare-data" in msg
    loader = BatchLoader(train_dir, SEQ, MBS, seed=0)
    with pytest.raises(DataError, match=r"model\.vocab_size ≥ 300"):
        check_vocab(loader, 100)
    loader.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only path; CUDA has its own test")
def test_pin_memory_without_cuda_warns_and_still_loads(train_dir):
    with pytest.warns(UserWarning, match="pin_memory=True ignored: CUDA is not available"):
        loader = BatchLoader(train_dir, SEQ, MBS, seed=0, pin_memory=True)
    x, _ = loader.next_batch()
    assert not x.is_pinned()
    loader.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU to pin memory")
def test_pin_memory_on_cuda(train_dir):
    pinned = BatchLoader(train_dir, SEQ, MBS, seed=0, prefetch=2, pin_memory=True)
    plain = BatchLoader(train_dir, SEQ, MBS, seed=0, prefetch=0)
    for _ in range(3):
        (x, y), (x_ref, y_ref) = pinned.next_batch(), plain.next_batch()
        assert x.is_pinned() and y.is_pinned()
        assert torch.equal(x, x_ref) and torch.equal(y, y_ref)
    pinned.close()
    plain.close()


# ---------------------------------------------------------------------------------------------
# shards verified before training
# ---------------------------------------------------------------------------------------------


def _copy_train(prepared, tmp_path: Path) -> Path:
    d = tmp_path / "data" / "train"
    shutil.copytree(prepared[0] / "train", d)
    return d


def test_a_zeroed_shard_of_the_right_size_is_refused_naming_it(prepared, tmp_path):
    d = _copy_train(prepared, tmp_path)
    shard = d / "shard_00001.bin"
    shard.write_bytes(bytes(shard.stat().st_size))
    load_manifest(d)  # the size matches: only the content check notices
    with pytest.raises(DataError) as e:
        BatchLoader(d, SEQ, MBS, seed=0, verify_cache=tmp_path / "cache")
    assert f"shard {shard} fails its sha256 check" in str(e.value)
    assert "prepare-data" in str(e.value)
    with pytest.raises(DataError, match="fails its sha256 check"):
        eval_batches(d, SEQ, MBS, n_batches=1)


def test_token_ids_outside_the_vocabulary_are_refused_naming_the_shard(prepared, tmp_path):
    d = _copy_train(prepared, tmp_path)
    shard = d / "shard_00000.bin"
    ids = np.fromfile(shard, dtype="<u2")
    ids[7] = 300  # vocab_size is 300: one past the last id
    shard.write_bytes(ids.tobytes())
    m = json.loads((d / "manifest.json").read_text())
    m["shards"][0]["sha256"] = hashlib.sha256(shard.read_bytes()).hexdigest()
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DataError) as e:
        BatchLoader(d, SEQ, MBS, seed=0, verify_cache=tmp_path / "cache")
    assert f"shard {shard} holds token id 300, outside the vocabulary" in str(e.value)
    assert "vocab_size 300" in str(e.value)


def test_verification_reads_each_shard_once_until_it_changes(prepared, tmp_path):
    d = _copy_train(prepared, tmp_path)
    cache = tmp_path / "cache"
    n_shards = len(load_manifest(d)["shards"])
    assert verify_split(d, load_manifest(d), cache_dir=cache) == n_shards
    assert verify_split(d, load_manifest(d), cache_dir=cache) == 0, "a relaunch reads nothing"
    # Two ranks split the shards between them.
    assert verify_split(d, load_manifest(d), 0, 2, tmp_path / "c2") == (n_shards + 1) // 2
    assert verify_split(d, load_manifest(d), 1, 2, tmp_path / "c2") == n_shards // 2
    # Same size, same mtime: the cached result stands (that is what keeps relaunches fast)...
    shard = d / "shard_00000.bin"
    st = shard.stat()
    shard.write_bytes(bytes(st.st_size))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert verify_split(d, load_manifest(d), cache_dir=cache) == 0
    # ...and any new write moves the mtime, so the shard is read again and refused.
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    with pytest.raises(DataError, match=r"shard_00000\.bin fails its sha256 check"):
        verify_split(d, load_manifest(d), cache_dir=cache)
