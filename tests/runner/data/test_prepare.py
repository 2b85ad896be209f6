"""Data preparation: shards, manifest, split, reruns, and the manifest's validation."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from helpers.tokens import (
    decoded_documents,
    documents_on_disk,
    stream,
    tiny_inputs,
    val_fraction_of,
)

import m3run.runner.data.prepare
from m3run.runner.data.loader import BatchLoader
from m3run.runner.data.manifest import DataError, load_manifest
from m3run.runner.data.prepare import prepare_data

VAL_FRACTION = 0.3
SHARD_TOKENS = 2000


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return documents_on_disk(tmp_path_factory.mktemp("inputs"))


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
        assert "corpus (folder): 12 documents from 12 files" in m["source"]["description"]
        records = {Path(r["input"]).name: r for r in m["source"]["inputs"]}
        assert (records["corpus"]["documents"], records["records.jsonl"]["documents"]) == (12, 20)
        assert (
            sum(r["tokens"] for r in records.values())
            == summary["train"]["tokens"] + summary["val"]["tokens"]
        )
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
        docs = decoded_documents(out / split)
        assert len(docs) == load_manifest(out / split)["num_documents"]
        decoded += docs
    # Every document comes back exactly, the literal "<|endoftext|>" one included.
    assert Counter(decoded) == Counter(texts)


def test_split_is_by_content_hash_and_order_independent(prepared, corpus, tmp_path):
    out, _ = prepared
    inputs, _, _ = corpus
    val_docs = decoded_documents(out / "val")
    train_docs = decoded_documents(out / "train")
    assert val_docs and train_docs
    assert all(val_fraction_of(t) < VAL_FRACTION for t in val_docs)
    assert all(val_fraction_of(t) >= VAL_FRACTION for t in train_docs)

    reordered = tmp_path / "reordered"
    prepare_data(
        [str(p) for p in reversed(inputs)],
        reordered,
        tokenizer=str(out / "tokenizer.json"),
        val_fraction=VAL_FRACTION,
        workers=1,
        progress=False,
    )
    assert Counter(decoded_documents(reordered / "val")) == Counter(val_docs)
    assert Counter(decoded_documents(reordered / "train")) == Counter(train_docs)


def test_output_bytes_do_not_depend_on_workers(prepared, corpus, tmp_path, monkeypatch):
    out, _ = prepared
    inputs, _, _ = corpus
    # Small work units, so the 32 documents really are spread over both processes.
    monkeypatch.setattr(m3run.runner.data.prepare, "_CHUNK_DOCS", 3)
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
        assert np.array_equal(stream(tmp_path / "hf" / split), stream(out / split))


def test_stdlib_input_with_max_bytes(tmp_path):
    summary = prepare_data(
        ["stdlib"], tmp_path / "std", tokenizer="bpe:300", max_bytes=300_000, progress=False
    )
    assert 250_000 < summary["input_bytes"] <= 300_000
    assert summary["documents"] > 3
    assert summary["source"].startswith("stdlib (Python stdlib .py files under ")
    assert summary["train"]["tokens"] > 50_000
    assert summary["val"]["documents"] >= 1
    docs = decoded_documents(tmp_path / "std" / "train") + decoded_documents(
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


def test_val_gets_a_document_when_the_hash_gives_it_none(prepared, tmp_path):
    tok = str(prepared[0] / "tokenizer.json")
    folder = tiny_inputs(tmp_path, 5)
    summary = prepare_data(
        [str(folder)], tmp_path / "o", tokenizer=tok, val_fraction=1e-9, workers=1, progress=False
    )
    assert summary["train"]["documents"] == 4
    assert summary["val"]["documents"] == 1
    assert any("moved one train document" in n for n in summary["notes"])
    # The moved document is the one whose hash is nearest the threshold.
    texts = [p.read_text() for p in sorted(folder.iterdir())]
    assert decoded_documents(tmp_path / "o" / "val") == [min(texts, key=val_fraction_of)]
    assert Counter(decoded_documents(tmp_path / "o" / "train")) == Counter(
        sorted(texts, key=val_fraction_of)[1:]
    )

    one = prepare_data(
        [str(tiny_inputs(tmp_path, 1))], tmp_path / "one", tokenizer=tok, progress=False
    )
    # One document cannot be split by hash: val is its last tokens, train the rest of it.
    assert (one["train"]["documents"], one["val"]["documents"]) == (1, 1)
    assert any("token-level split: there is one document" in n for n in one["notes"])
    (doc,) = [p.read_text() for p in (tmp_path / "tiny1").iterdir()]
    halves = decoded_documents(tmp_path / "one" / "train") + decoded_documents(
        tmp_path / "one" / "val"
    )
    assert "".join(halves) == doc


def test_rerun_replaces_old_shards(prepared, corpus, tmp_path):
    tok = str(prepared[0] / "tokenizer.json")
    inputs, _, _ = corpus
    out = tmp_path / "o"
    prepare_data([str(p) for p in inputs], out, tokenizer=tok, shard_tokens=500, progress=False)
    assert len(list((out / "train").glob("shard_*.bin"))) > 2
    prepare_data(
        [str(tiny_inputs(tmp_path, 3))], out, tokenizer=tok, shard_tokens=500, progress=False
    )
    m = load_manifest(out / "train", verify=True)
    assert sorted(p.name for p in (out / "train").glob("shard_*.bin")) == [
        s["file"] for s in m["shards"]
    ]


def test_out_dir_inside_an_input_folder_is_not_read(prepared, tmp_path):
    tok = str(prepared[0] / "tokenizer.json")
    folder = tiny_inputs(tmp_path, 4)
    first = prepare_data([str(folder)], folder / "tokens", tokenizer=tok, progress=False)
    again = prepare_data([str(folder)], folder / "tokens", tokenizer=tok, progress=False)
    assert first["documents"] == again["documents"] == 4
    assert "4 documents from 4 files" in again["source"]


def test_failed_preparation_leaves_no_manifest(prepared, tmp_path):
    tok = str(prepared[0] / "tokenizer.json")
    out = tmp_path / "o"
    prepare_data([str(tiny_inputs(tmp_path, 3))], out, tokenizer=tok, progress=False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    with pytest.raises(DataError) as e:
        prepare_data([str(bad)], out, tokenizer=tok, progress=False)
    assert f"{bad}: line 2 has no field 'text'" in str(e.value)
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
    with pytest.raises(
        DataError, match=r"weights\.bin is not recognised: binary content.*--skip-bad"
    ):
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
