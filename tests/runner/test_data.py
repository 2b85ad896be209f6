"""Data preparation (shards, manifest, split) and the training batch stream (order, resume)."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import runner.data.prepare
from runner.data.loader import BatchLoader, TokenWindows, check_vocab, eval_batches
from runner.data.manifest import DataError, load_manifest
from runner.data.prepare import prepare_data
from runner.data.tokenizer import EOS_TEXT, load_tokenizer

# Multi-byte characters and code-like symbols, so byte-level BPE has something to merge.
WORDS = ["the", "a", "cat", "sat", "on", "mat", "über", "naïve", "数据", "alpha", "beta"]
WORDS += ["gamma", "delta", "=", "(", ")", ":", "def", "return"]
VAL_FRACTION = 0.3
SHARD_TOKENS = 2000


def _text(rng: random.Random, n_words: int) -> str:
    lines = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(n_words // 12)]
    return "\n".join(lines) + "\n"


def _documents_on_disk(root: Path) -> tuple[list[Path], Path, list[str]]:
    """12 text files in nested folders (+ a hidden and a binary file to skip) and a jsonl."""
    rng = random.Random(1234)
    folder = root / "corpus"
    texts = []
    for i in range(12):
        path = folder / f"part{i % 3}" / f"doc{i:02d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        text = _text(rng, 120)
        if i == 5:
            text += f"a document that mentions {EOS_TEXT} literally\n"
        path.write_text(text, encoding="utf-8")
        texts.append(text)
    (folder / ".hidden.txt").write_text("never read\n")
    (folder / "part0" / "blob.bin").write_bytes(b"\x00\x01\x02binary" * 10)
    jsonl = root / "records.jsonl"
    with open(jsonl, "w", encoding="utf-8") as f:
        for i in range(20):
            text = _text(rng, 60)
            f.write(json.dumps({"id": i, "text": text}) + "\n")
            texts.append(text)
            if i == 10:
                f.write("\n")  # blank lines are allowed
    return [folder, jsonl], jsonl, texts


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return _documents_on_disk(tmp_path_factory.mktemp("inputs"))


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
    inputs, _, _ = corpus
    out = tmp_path_factory.mktemp("prepared") / "data"
    summary = prepare_data(
        [str(p) for p in inputs],
        out,
        tokenizer="bpe:300",
        val_fraction=VAL_FRACTION,
        shard_tokens=SHARD_TOKENS,
        workers=1,
        progress=False,
    )
    return out, summary


def _stream(split_dir: Path) -> np.ndarray:
    """The split's token stream, read straight from the shard files the manifest lists."""
    m = json.loads((split_dir / "manifest.json").read_text())
    dtype = {"uint16": "<u2", "uint32": "<u4"}[m["dtype"]]
    parts = [np.fromfile(split_dir / s["file"], dtype=dtype) for s in m["shards"]]
    return np.concatenate(parts).astype(np.int64)


def _decoded_documents(split_dir: Path) -> list[str]:
    tokens = _stream(split_dir)
    m = load_manifest(split_dir)
    assert tokens[-1] == m["eos_id"], "the stream must end with EOS"
    ends = np.flatnonzero(tokens == m["eos_id"])
    tok = load_tokenizer(split_dir)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tok.decode(tokens[a:b]) for a, b in zip(starts, ends, strict=True)]


def _val_fraction_of(text: str) -> float:
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:8], "big") / 2**64


def _split_bytes(out: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name != "manifest.json"
    }


# ---------------------------------------------------------------------------------------------
# prepare_data
# ---------------------------------------------------------------------------------------------


def test_manifest_records_the_shards(prepared, corpus):
    out, summary = prepared
    _, _, texts = corpus
    assert (out / "tokenizer.json").is_file()
    total_docs = 0
    for split in ("train", "val"):
        m = load_manifest(out / split, verify=True)
        assert m["format_version"] == 1
        assert m["split"] == split
        assert m["tokenizer"]["spec"] == "bpe:300"
        assert m["vocab_size"] == 300
        assert m["eos_id"] == 0
        assert m["dtype"] == "uint16"
        assert m["total_tokens"] == sum(s["tokens"] for s in m["shards"]) > 0
        assert "records.jsonl (jsonl): 20 documents" in m["source"]["description"]
        assert "12 of 13 files, 1 non-text skipped" in m["source"]["description"]
        for i, s in enumerate(m["shards"]):
            data = (out / split / s["file"]).read_bytes()
            assert s["file"] == f"shard_{i:05d}.bin"
            assert len(data) == 2 * s["tokens"]
            assert hashlib.sha256(data).hexdigest() == s["sha256"]
        # Fixed-size shards, the last one partial.
        assert all(s["tokens"] == SHARD_TOKENS for s in m["shards"][:-1])
        assert 0 < m["shards"][-1]["tokens"] <= SHARD_TOKENS
        assert summary[split]["tokens"] == m["total_tokens"]
        assert summary[split]["documents"] == m["num_documents"]
        total_docs += m["num_documents"]
    assert len(load_manifest(out / "train")["shards"]) > 1, "corpus too small to test sharding"
    assert total_docs == summary["documents"] == len(texts)
    assert not list(out.rglob("*.tmp")), "temporary files left behind"


def test_documents_are_separated_by_eos_and_round_trip(prepared, corpus):
    out, _ = prepared
    _, _, texts = corpus
    decoded = []
    for split in ("train", "val"):
        docs = _decoded_documents(out / split)
        assert len(docs) == load_manifest(out / split)["num_documents"]
        decoded += docs
    # Every document comes back exactly, the literal "<|endoftext|>" one included.
    assert Counter(decoded) == Counter(texts)


def test_split_is_by_content_hash_and_order_independent(prepared, corpus, tmp_path):
    out, _ = prepared
    inputs, _, _ = corpus
    val_docs = _decoded_documents(out / "val")
    train_docs = _decoded_documents(out / "train")
    assert val_docs and train_docs
    assert all(_val_fraction_of(t) < VAL_FRACTION for t in val_docs)
    assert all(_val_fraction_of(t) >= VAL_FRACTION for t in train_docs)

    reordered = tmp_path / "reordered"
    prepare_data(
        [str(p) for p in reversed(inputs)],
        reordered,
        tokenizer=str(out / "tokenizer.json"),
        val_fraction=VAL_FRACTION,
        workers=1,
        progress=False,
    )
    assert Counter(_decoded_documents(reordered / "val")) == Counter(val_docs)
    assert Counter(_decoded_documents(reordered / "train")) == Counter(train_docs)


def test_output_bytes_do_not_depend_on_workers(prepared, corpus, tmp_path, monkeypatch):
    out, _ = prepared
    inputs, _, _ = corpus
    # Small work units, so the 32 documents really are spread over both processes.
    monkeypatch.setattr(runner.data.prepare, "_CHUNK_DOCS", 3)
    out2 = tmp_path / "two_workers"
    prepare_data(
        [str(p) for p in inputs],
        out2,
        tokenizer="bpe:300",
        val_fraction=VAL_FRACTION,
        shard_tokens=SHARD_TOKENS,
        workers=2,
        progress=False,
    )
    assert _split_bytes(out2) == _split_bytes(out)
    for split in ("train", "val"):
        assert load_manifest(out2 / split) == load_manifest(out / split)


def test_hf_tokenizer_json_path_reproduces_the_bpe_run(prepared, corpus, tmp_path):
    out, _ = prepared
    inputs, _, _ = corpus
    tok_path = out / "tokenizer.json"
    summary = prepare_data(
        [str(p) for p in inputs],
        tmp_path / "hf",
        tokenizer=str(tok_path),
        val_fraction=VAL_FRACTION,
        shard_tokens=SHARD_TOKENS,
        workers=1,
        progress=False,
    )
    assert summary["tokenizer"]["kind"] == "hf"
    assert summary["tokenizer"]["path"] == str(tok_path.resolve())
    assert (summary["vocab_size"], summary["eos_id"]) == (300, 0)
    for split in ("train", "val"):
        assert np.array_equal(_stream(tmp_path / "hf" / split), _stream(out / split))


def test_stdlib_input_with_max_bytes(tmp_path):
    summary = prepare_data(
        ["stdlib"], tmp_path / "std", tokenizer="bpe:300", max_bytes=300_000, progress=False
    )
    assert 250_000 < summary["input_bytes"] <= 300_000
    assert summary["documents"] > 3
    assert summary["source"].startswith("stdlib (Python stdlib .py files under ")
    assert summary["train"]["tokens"] > 50_000
    assert summary["val"]["documents"] >= 1
    docs = _decoded_documents(tmp_path / "std" / "train") + _decoded_documents(
        tmp_path / "std" / "val"
    )
    assert sum(len(d.encode()) for d in docs) == summary["input_bytes"]
    assert any("def " in d for d in docs)


def _gpt2_loadable() -> bool:
    import tiktoken

    try:
        tiktoken.get_encoding("gpt2")
    except Exception:
        return False
    return True


def test_gpt2_tokenizer_or_offline_message(corpus, tmp_path):
    inputs, _, _ = corpus
    if _gpt2_loadable():
        summary = prepare_data(
            [str(inputs[0])], tmp_path / "g", tokenizer="gpt2", workers=1, progress=False
        )
        assert (summary["vocab_size"], summary["eos_id"], summary["dtype"]) == (
            50257,
            50256,
            "uint16",
        )
        assert summary["tokenizer"] == {"spec": "gpt2", "kind": "tiktoken", "name": "gpt2"}
    else:
        with pytest.raises(DataError) as e:
            prepare_data([str(inputs[0])], tmp_path / "g", tokenizer="gpt2", progress=False)
        msg = str(e.value)
        assert "gpt2" in msg and "TIKTOKEN_CACHE_DIR" in msg
        assert "vocab.bpe" in msg and "encoder.json" in msg
        assert "bpe:<vocab_size>" in msg
        assert not (tmp_path / "g").exists(), "a failed tokenizer load must not touch out_dir"


def _tiny_inputs(tmp_path: Path, n_docs: int) -> Path:
    folder = tmp_path / f"tiny{n_docs}"
    rng = random.Random(n_docs)
    for i in range(n_docs):
        (folder / f"{i}.txt").parent.mkdir(parents=True, exist_ok=True)
        (folder / f"{i}.txt").write_text(_text(rng, 24))
    return folder


def test_val_gets_a_document_when_the_hash_gives_it_none(prepared, tmp_path):
    tok = str(prepared[0] / "tokenizer.json")
    folder = _tiny_inputs(tmp_path, 5)
    summary = prepare_data(
        [str(folder)], tmp_path / "o", tokenizer=tok, val_fraction=1e-9, workers=1, progress=False
    )
    assert summary["train"]["documents"] == 4
    assert summary["val"]["documents"] == 1
    assert any("moved one train document" in n for n in summary["notes"])
    # The moved document is the one whose hash is nearest the threshold.
    texts = [p.read_text() for p in sorted(folder.iterdir())]
    assert _decoded_documents(tmp_path / "o" / "val") == [min(texts, key=_val_fraction_of)]
    assert Counter(_decoded_documents(tmp_path / "o" / "train")) == Counter(
        sorted(texts, key=_val_fraction_of)[1:]
    )

    one = prepare_data(
        [str(_tiny_inputs(tmp_path, 1))], tmp_path / "one", tokenizer=tok, progress=False
    )
    assert (one["train"]["documents"], one["val"]["documents"]) == (1, 0)
    assert any("val is empty" in n for n in one["notes"])
    with pytest.raises(DataError, match="has no tokens"):
        load_manifest(tmp_path / "one" / "val")


def test_rerun_replaces_old_shards(prepared, corpus, tmp_path):
    tok = str(prepared[0] / "tokenizer.json")
    inputs, _, _ = corpus
    out = tmp_path / "o"
    prepare_data([str(p) for p in inputs], out, tokenizer=tok, shard_tokens=500, progress=False)
    assert len(list((out / "train").glob("shard_*.bin"))) > 2
    prepare_data(
        [str(_tiny_inputs(tmp_path, 3))], out, tokenizer=tok, shard_tokens=500, progress=False
    )
    m = load_manifest(out / "train", verify=True)
    assert sorted(p.name for p in (out / "train").glob("shard_*.bin")) == [
        s["file"] for s in m["shards"]
    ]


def test_out_dir_inside_an_input_folder_is_not_read(prepared, tmp_path):
    tok = str(prepared[0] / "tokenizer.json")
    folder = _tiny_inputs(tmp_path, 4)
    first = prepare_data([str(folder)], folder / "tokens", tokenizer=tok, progress=False)
    again = prepare_data([str(folder)], folder / "tokens", tokenizer=tok, progress=False)
    assert first["documents"] == again["documents"] == 4
    assert "4 of 4 files" in again["source"]


def test_failed_preparation_leaves_no_manifest(prepared, tmp_path):
    tok = str(prepared[0] / "tokenizer.json")
    out = tmp_path / "o"
    prepare_data([str(_tiny_inputs(tmp_path, 3))], out, tokenizer=tok, progress=False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    with pytest.raises(DataError) as e:
        prepare_data([str(bad)], out, tokenizer=tok, progress=False)
    assert f"{bad}:2" in str(e.value) and "'text'" in str(e.value)
    assert "--text-field" in str(e.value) and "body" in str(e.value)
    with pytest.raises(DataError, match="prepare-data"):
        load_manifest(out / "train")
    assert not list(out.rglob("*.tmp"))


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"inputs": ["no/such/input"]}, "input not found: no/such/input"),
        ({"tokenizer": "bpe:10"}, "bpe:<vocab_size> needs an integer vocab_size ≥ 257"),
        ({"tokenizer": "sentencepiece"}, "unknown tokenizer 'sentencepiece'"),
        ({"tokenizer": "missing/tokenizer.json"}, "tokenizer file not found"),
        ({"val_fraction": 1.0}, "val_fraction=1.0 is out of range"),
    ],
    ids=["missing-input", "tiny-bpe", "unknown-tokenizer", "missing-tokenizer", "val-fraction"],
)
def test_prepare_rejects_bad_arguments(corpus, tmp_path, kwargs, needle):
    args = {"inputs": [str(corpus[0][0])], "out_dir": tmp_path / "o", "tokenizer": "bpe:300"}
    args.update(kwargs)
    with pytest.raises(DataError) as e:
        prepare_data(progress=False, **args)
    assert needle in str(e.value)


def test_binary_file_input_is_an_error(tmp_path):
    blob = tmp_path / "weights.bin"
    blob.write_bytes(b"\x00" * 100)
    with pytest.raises(DataError, match=r"weights\.bin is not a UTF-8 text file"):
        prepare_data([str(blob)], tmp_path / "o", tokenizer="bpe:300", progress=False)


# ---------------------------------------------------------------------------------------------
# load_manifest
# ---------------------------------------------------------------------------------------------


def _corrupt_empty(d: Path) -> None:
    (d / "manifest.json").write_text("")


def _corrupt_garbage(d: Path) -> None:
    (d / "manifest.json").write_text('{"format_version": 1, "shards": [')


def _corrupt_missing_key(d: Path) -> None:
    m = json.loads((d / "manifest.json").read_text())
    del m["eos_id"]
    (d / "manifest.json").write_text(json.dumps(m))


def _corrupt_no_manifest(d: Path) -> None:
    (d / "manifest.json").unlink()


def _corrupt_missing_shard(d: Path) -> None:
    (d / "shard_00001.bin").unlink()


def _corrupt_truncated_shard(d: Path) -> None:
    p = d / "shard_00000.bin"
    p.write_bytes(p.read_bytes()[:-2])


@pytest.mark.parametrize(
    ("corrupt", "needle"),
    [
        (_corrupt_empty, "is empty"),
        (_corrupt_garbage, "is corrupt (not valid JSON"),
        (_corrupt_missing_key, "is corrupt (missing eos_id)"),
        (_corrupt_no_manifest, "no manifest.json in"),
        (_corrupt_missing_shard, "shard_00001.bin listed in"),
        (_corrupt_truncated_shard, "shard_00000.bin has"),
    ],
    ids=["empty", "garbage", "missing-key", "no-manifest", "missing-shard", "truncated-shard"],
)
def test_load_manifest_names_the_problem_path_and_fix(prepared, tmp_path, corrupt, needle):
    d = tmp_path / "data" / "train"
    shutil.copytree(prepared[0] / "train", d)
    corrupt(d)
    with pytest.raises(DataError) as e:
        load_manifest(d)
    msg = str(e.value)
    assert needle in msg
    assert str(d) in msg
    assert f"m3run prepare-data <inputs> --out {d.parent}" in msg
    # The loader refuses too: it never falls back to random tokens.
    with pytest.raises(DataError):
        BatchLoader(d, 8, 2, seed=0)


def test_load_manifest_missing_directory(tmp_path):
    with pytest.raises(DataError) as e:
        load_manifest(tmp_path / "nothing" / "train")
    assert str(e.value) == (
        f"training data not found at {tmp_path / 'nothing' / 'train'}: run "
        f"`m3run prepare-data <inputs> --out {tmp_path / 'nothing'}` first"
    )


def test_verify_catches_a_changed_shard(prepared, tmp_path):
    d = tmp_path / "train"
    shutil.copytree(prepared[0] / "train", d)
    data = bytearray((d / "shard_00000.bin").read_bytes())
    data[0] ^= 1
    (d / "shard_00000.bin").write_bytes(bytes(data))
    load_manifest(d)  # sizes still match: only hashing notices
    with pytest.raises(DataError, match=r"fails its sha256 check.*prepare-data"):
        load_manifest(d, verify=True)


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
    stream = _stream(train_dir)
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
    stream = _stream(train_dir)
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
    stream = _stream(train_dir)
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
    stream = _stream(val)
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
