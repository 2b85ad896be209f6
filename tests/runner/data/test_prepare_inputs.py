"""What pretraining users bring to `prepare-data`: parquet, Arrow, JSON Lines (plain, gzip, zstd),
JSON arrays, HF datasets on disk, one big text file, folders and globs of them — and the loud
failures: an unreadable file is exit 78 naming it, or a counted, printed skip with --skip-bad."""

from __future__ import annotations

import gzip
import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from helpers.tokens import decoded_documents, text

from m3run.runner.data.manifest import DataError, load_manifest
from m3run.runner.data.prepare import prepare_data

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def docs() -> list[str]:
    rng = random.Random(16)
    return [text(rng, 24 + 12 * (i % 4)) for i in range(300)]


@pytest.fixture(scope="module")
def tokenizer(docs, tmp_path_factory) -> str:
    """A BPE trained once on the documents, so each test only tokenises."""
    root = tmp_path_factory.mktemp("tok")
    (root / "all.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepare_data([str(root / "all.jsonl")], root / "out", tokenizer="bpe:300", progress=False)
    return str(root / "out" / "tokenizer.json")


def _prepare(inputs, out: Path, tokenizer: str, **kwargs) -> dict:
    kwargs.setdefault("workers", 1)
    kwargs.setdefault("progress", False)
    return prepare_data([str(i) for i in inputs], out, tokenizer=tokenizer, **kwargs)


def _all_documents(out: Path) -> list[str]:
    return decoded_documents(out / "train") + decoded_documents(out / "val")


def _write_jsonl(path: Path, records: list[dict]) -> None:
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(data))
    elif path.suffix == ".zst":
        path.write_bytes(zstandard.ZstdCompressor().compress(data))
    else:
        path.write_bytes(data)


# ---------------------------------------------------------------------------------------------
# formats, each into the right documents
# ---------------------------------------------------------------------------------------------


def test_parquet_file_and_folder_of_shards(docs, tokenizer, tmp_path):
    folder = tmp_path / "fineweb"
    folder.mkdir()
    for i, part in enumerate((docs[:200], docs[200:])):
        table = pa.table({"id": list(range(len(part))), "text": part, "url": ["u"] * len(part)})
        pq.write_table(table, folder / f"part-{i:05d}.parquet", row_group_size=64)
    one = _prepare([folder / "part-00000.parquet"], tmp_path / "one", tokenizer)
    assert one["documents"] == 200
    both = _prepare([folder], tmp_path / "both", tokenizer)
    assert both["documents"] == 300
    assert Counter(_all_documents(tmp_path / "both")) == Counter(docs)
    (record,) = load_manifest(tmp_path / "both" / "train")["source"]["inputs"]
    assert record["files"] == 2 and record["documents"] == 300
    assert record["tokens"] == both["train"]["tokens"] + both["val"]["tokens"]


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst"])
def test_jsonl_plain_and_compressed(docs, tokenizer, tmp_path, suffix):
    path = tmp_path / f"records{suffix}"
    _write_jsonl(path, [{"id": i, "text": d} for i, d in enumerate(docs[:50])])
    summary = _prepare([path], tmp_path / "o", tokenizer)
    assert summary["documents"] == 50
    assert Counter(_all_documents(tmp_path / "o")) == Counter(docs[:50])


def test_json_array_of_records_and_json_lines_under_a_json_name(docs, tokenizer, tmp_path):
    array = tmp_path / "array.json"
    array.write_text(json.dumps([{"text": d, "n": i} for i, d in enumerate(docs[:40])], indent=2))
    summary = _prepare([array], tmp_path / "a", tokenizer)
    assert summary["documents"] == 40
    assert Counter(_all_documents(tmp_path / "a")) == Counter(docs[:40])
    # What `Dataset.to_json` writes: JSON Lines named .json.
    lines = tmp_path / "lines.json"
    _write_jsonl(lines, [{"text": d} for d in docs[:30]])
    assert _prepare([lines], tmp_path / "l", tokenizer)["documents"] == 30
    single = tmp_path / "config.json"
    single.write_text(json.dumps({"text": "x", "nested": {"a": 1}}, indent=2))
    with pytest.raises(DataError, match=r"config\.json is one JSON object, not records"):
        _prepare([single], tmp_path / "s", tokenizer)


def test_hf_save_to_disk_folder_reads_the_data_not_the_metadata(docs, tokenizer, tmp_path):
    datasets = pytest.importorskip("datasets", reason="needs the hf extra: pip install m3run[hf]")
    ds = datasets.Dataset.from_dict({"text": docs[:120], "meta": [{"n": i} for i in range(120)]})
    ds.save_to_disk(str(tmp_path / "saved"), num_shards=3)
    summary = _prepare([tmp_path / "saved"], tmp_path / "o", tokenizer)
    assert summary["documents"] == 120
    assert Counter(_all_documents(tmp_path / "o")) == Counter(docs[:120])
    assert "(HF save_to_disk): 120 documents from 3 files" in summary["source"]
    # A DatasetDict: every split, inside a folder of other inputs too.
    dd = datasets.DatasetDict(
        train=datasets.Dataset.from_dict({"body": docs[:50]}),
        test=datasets.Dataset.from_dict({"body": docs[50:60]}),
    )
    dd.save_to_disk(str(tmp_path / "tree" / "dict"))
    summary = _prepare([f"{tmp_path / 'tree'}:body"], tmp_path / "d", tokenizer)
    assert summary["documents"] == 60


def test_hf_prefix_loads_a_dataset_folder_through_datasets(docs, tokenizer, tmp_path):
    pytest.importorskip("datasets", reason="needs the hf extra: pip install m3run[hf]")
    folder = tmp_path / "csv_dataset"
    folder.mkdir()
    # csv is a format only `datasets` reads here, so the hf: path is what reads it.
    import csv

    with open(folder / "train.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "content"])
        w.writerows([i, d] for i, d in enumerate(docs[:25]))
    summary = _prepare([f"hf:{folder}:content"], tmp_path / "o", tokenizer)
    assert summary["documents"] == 25
    assert Counter(_all_documents(tmp_path / "o")) == Counter(docs[:25])


def test_arrow_ipc_files_and_feather(docs, tokenizer, tmp_path):
    table = pa.table({"text": docs[:30], "n": list(range(30))})
    with pa.ipc.new_file(tmp_path / "a.arrow", table.schema) as w:
        w.write_table(table)
    import pyarrow.feather as feather

    feather.write_feather(pa.table({"text": docs[30:50]}), tmp_path / "b.feather")
    summary = _prepare([tmp_path / "a.arrow", tmp_path / "b.feather"], tmp_path / "o", tokenizer)
    assert summary["documents"] == 50
    assert Counter(_all_documents(tmp_path / "o")) == Counter(docs[:50])


def test_hf_prefix_without_the_extra_names_it(tmp_path):
    """A Python where `datasets` cannot be imported (as without the hf extra)."""
    (tmp_path / "ds").mkdir()
    code = (
        "import sys; sys.modules['datasets'] = None\n"
        "from m3run.runner.cli import app\n"
        f"app(['prepare-data', 'hf:{tmp_path / 'ds'}', '--out', '{tmp_path / 'o'}', "
        "'--tokenizer', 'bpe:300'])"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert result.returncode == 78, result.stderr
    assert "needs the optional `datasets` library" in result.stderr
    assert "pip install 'm3run[hf]'" in result.stderr


def test_one_big_text_file_becomes_documents_with_a_val_split(docs, tokenizer, tmp_path):
    big = tmp_path / "book.txt"
    paragraphs = [d.strip("\n") for d in docs[:200]]
    big.write_text("\n\n\n".join(paragraphs) + "\n")
    summary = _prepare([big], tmp_path / "o", tokenizer, val_fraction=0.05)
    assert summary["documents"] == 200
    assert summary["val"]["documents"] > 0 and summary["val"]["tokens"] > 0
    assert Counter(d.strip("\n") for d in _all_documents(tmp_path / "o")) == Counter(paragraphs)
    # A separator of the user's choosing, and a file kept whole with a token-level val split.
    marked = tmp_path / "marked.txt"
    marked.write_text("<doc>".join(paragraphs[:30]))
    assert _prepare([marked], tmp_path / "m", tokenizer, separator="<doc>")["documents"] == 30
    whole = _prepare([marked], tmp_path / "w", tokenizer, separator=None, val_fraction=0.1)
    assert (whole["train"]["documents"], whole["val"]["documents"]) == (1, 1)
    assert whole["val"]["tokens"] == round(
        0.1 * (whole["train"]["tokens"] + whole["val"]["tokens"] - 1)
    )


def test_val_split_tail_takes_the_last_tokens(docs, tokenizer, tmp_path):
    path = tmp_path / "r.jsonl"
    _write_jsonl(path, [{"text": d} for d in docs[:60]])
    by_hash = _prepare([path], tmp_path / "h", tokenizer, val_fraction=0.1)
    tail = _prepare([path], tmp_path / "t", tokenizer, val_fraction=0.1, val_split="tail")
    total = by_hash["train"]["tokens"] + by_hash["val"]["tokens"]
    assert tail["val"]["tokens"] == round(0.1 * total)
    assert decoded_documents(tmp_path / "t" / "val")[-1] == docs[59]


def test_fields_per_input_nested_and_from_an_inputs_file(docs, tokenizer, tmp_path):
    a = tmp_path / "a.jsonl"
    _write_jsonl(a, [{"meta": {"text": d}} for d in docs[:20]])
    b = tmp_path / "b.parquet"
    pq.write_table(pa.table({"content": docs[20:35]}), b)
    c = tmp_path / "c.parquet"
    pq.write_table(pa.table({"doc": pa.array([{"body": d} for d in docs[35:45]])}), c)
    summary = _prepare(
        [f"{a}:meta.text", f"{b}:content", f"{c}:doc.body"], tmp_path / "o", tokenizer
    )
    assert summary["documents"] == 45
    assert Counter(_all_documents(tmp_path / "o")) == Counter(docs[:45])
    assert [r["text_field"] for r in summary["inputs"]] == ["meta.text", "content", "doc.body"]

    listing = tmp_path / "inputs.yaml"
    listing.write_text(f"- path: a.jsonl\n  text_field: meta.text\n- {b.name}:content\n")
    again = prepare_data(
        [], tmp_path / "f", tokenizer=tokenizer, inputs_file=listing, progress=False
    )
    assert again["documents"] == 35

    with pytest.raises(DataError) as e:
        _prepare([b], tmp_path / "x", tokenizer)
    assert "has no column 'text' (columns: content)" in str(e.value)
    assert f"{b}:<column>" in str(e.value)


def test_globs_and_whitespace_only_documents(docs, tokenizer, tmp_path):
    for i in range(3):
        _write_jsonl(tmp_path / f"s{i}.jsonl.gz", [{"text": d} for d in docs[10 * i : 10 * i + 10]])
    _write_jsonl(
        tmp_path / "s3.jsonl.gz", [{"text": "  \n\t "}, {"text": None}, {"text": docs[99]}]
    )
    summary = _prepare([tmp_path / "s*.jsonl.gz"], tmp_path / "o", tokenizer)
    assert summary["documents"] == 31
    (record,) = summary["inputs"]
    assert record["empty_dropped"] == 2 and record["files"] == 4
    with pytest.raises(DataError, match=r"input glob .*nothing\*\.parquet matches no files"):
        _prepare([tmp_path / "nothing*.parquet"], tmp_path / "n", tokenizer)


# ---------------------------------------------------------------------------------------------
# never silent
# ---------------------------------------------------------------------------------------------


def _mixed_folder(root: Path, docs: list[str]) -> Path:
    """The issue's example: 10 .txt files, a parquet of 300 documents and a .jsonl.gz."""
    folder = root / "mixed"
    folder.mkdir()
    for i in range(10):
        (folder / f"doc{i}.txt").write_text(docs[i])
    pq.write_table(pa.table({"text": docs}), folder / "web.parquet")
    _write_jsonl(folder / "extra.jsonl.gz", [{"text": d} for d in docs[:5]])
    return folder


def test_a_folder_of_mixed_formats_reads_every_one(docs, tokenizer, tmp_path):
    summary = _prepare([_mixed_folder(tmp_path, docs)], tmp_path / "o", tokenizer)
    assert summary["documents"] == 10 + 300 + 5


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "m3run.runner.cli", "prepare-data", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )


def test_prepare_cli_exits_78_naming_an_unrecognised_file(docs, tokenizer, tmp_path):
    folder = _mixed_folder(tmp_path, docs)
    blob = folder / "model.ckpt"
    blob.write_bytes(bytes(range(256)) * 8)
    (folder / "empty.txt").write_text(" \n\n")
    result = _cli(str(folder), "--out", str(tmp_path / "o"), "--tokenizer", tokenizer)
    assert result.returncode == 78, result.stderr
    assert f"input file {folder / 'empty.txt'} yields no text" in result.stderr
    assert "--skip-bad" in result.stderr and "Traceback" not in result.stderr
    (folder / "empty.txt").unlink()
    result = _cli(str(folder), "--out", str(tmp_path / "o"), "--tokenizer", tokenizer)
    assert result.returncode == 78
    assert f"input file {blob} is not recognised: binary content" in result.stderr
    assert not (tmp_path / "o" / "train" / "manifest.json").exists()

    # --skip-bad: a printed warning, a count, the rest prepared, exit 0.
    result = _cli(
        str(folder),
        "--out",
        str(tmp_path / "o"),
        "--tokenizer",
        tokenizer,
        "--skip-bad",
        "--progress-interval",
        "0",
    )
    assert result.returncode == 0, result.stderr
    assert f"warning: skipping {blob} (is not recognised" in result.stderr
    assert "prepare-data: tokenising done:" in result.stderr  # progress lines off a terminal
    assert f"input {folder}: 315 documents" in result.stdout
    assert "1 file skipped" in result.stdout
    m = load_manifest(tmp_path / "o" / "train")
    (record,) = m["source"]["inputs"]
    assert record["skipped"] == [{"file": str(blob), "reason": record["skipped"][0]["reason"]}]
    assert record["documents"] == 315


@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [
        ("bad.jsonl.gz", b"not gzip at all", "cannot be read or decompressed"),
        ("bad.parquet", b"PAR1 but truncated", "is not a readable parquet file"),
        ("bad.jsonl", b'{"text": "a"}\n{"text": ', "line 2 is not valid JSON"),
        ("nums.jsonl", b'{"text": 5}\n', "field 'text' is a int, not a string"),
    ],
    ids=["gzip", "parquet", "jsonl", "not-a-string"],
)
def test_undecodable_files_name_the_file_and_the_reason(tokenizer, tmp_path, name, content, needle):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataError) as e:
        _prepare([path], tmp_path / "o", tokenizer)
    assert str(path) in str(e.value) and needle in str(e.value)


def test_progress_lines_off_a_terminal(docs, tokenizer, tmp_path, capsys):
    path = tmp_path / "r.jsonl"
    _write_jsonl(path, [{"text": d} for d in docs])
    _prepare([path], tmp_path / "o", tokenizer, progress=True, progress_interval_s=0)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("prepare-data: tokenising")]
    assert lines and "done: " in lines[-1] and "300 documents" in lines[-1] and "MB/s" in lines[-1]


def test_tokenizer_training_reports_progress_off_a_terminal(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "m3run.runner.cli",
            "prepare-data",
            "stdlib",
            "--tokenizer",
            "bpe:300",
            "--max-bytes",
            "200000",
            "--progress-interval",
            "0",
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    # Lines while the trainer reads the corpus, each further along (not one at its end).
    during = {
        ln.split(": ")[2].split(",")[0]
        for ln in done.stderr.splitlines()
        if "training bpe:300:" in ln and " MB of text" in ln
    }
    assert len(during) >= 2, done.stderr


def test_a_reader_closed_early_needs_no_zstd_for_a_plain_file(tmp_path, monkeypatch):
    """Stopping a reader part-way (a prepare that has read enough) closes its generator; for a
    plain file that must not import the zstd module, which reading it never needed."""
    from m3run.runner.data.readers import BLANK_LINES, read_file

    path = tmp_path / "a.txt"
    path.write_text("first document\n\nsecond document\n", encoding="utf-8")
    monkeypatch.setitem(sys.modules, "zstandard", None)  # `import zstandard` now fails
    texts = read_file(path, "text", BLANK_LINES)
    assert next(texts).strip() == "first document"
    texts.close()
    assert [t.strip() for t in read_file(path, "text", BLANK_LINES)] == [
        "first document",
        "second document",
    ]


def test_prepare_cli_keeps_prepared_data_unless_forced_and_warns_of_a_small_val(
    tokenizer, tmp_path
):
    """An --out holding prepared data is refused (78) and left as it was; --force replaces it.
    A val split under a few eval batches is a warning that says which --val-fraction would do;
    counts read as English."""
    out = tmp_path / "o"
    text = tmp_path / "one.txt"
    text.write_text("def f(x):\n    return x\n", encoding="utf-8")
    first = _cli(str(text), "--out", str(out), "--tokenizer", tokenizer)
    assert first.returncode == 0, first.stderr
    assert "1 document," in first.stdout and "in 1 document →" in first.stdout
    assert "warning: the val split is small" in first.stderr
    assert "too small for 2 eval batches at seq_len 2048" in first.stderr
    manifests = {s: (out / s / "manifest.json").read_bytes() for s in ("train", "val")}

    other = tmp_path / "other.txt"
    other.write_text("class A:\n    pass\n\nclass B:\n    pass\n", encoding="utf-8")
    again = _cli(str(other), "--out", str(out), "--tokenizer", tokenizer)
    assert again.returncode == 78
    assert f"--out {out} already holds prepared data (train: " in again.stderr
    assert "--force" in again.stderr and "Traceback" not in again.stderr
    assert {s: (out / s / "manifest.json").read_bytes() for s in manifests} == manifests

    forced = _cli(str(other), "--out", str(out), "--tokenizer", tokenizer, "--force")
    assert forced.returncode == 0, forced.stderr
    assert (out / "train" / "manifest.json").read_bytes() != manifests["train"]


def test_a_small_val_split_warning_names_a_val_fraction_that_would_do():
    from m3run.runner.data.prepare import small_val_warning

    warning = small_val_warning(2_499, 1_099_574, "hash")
    assert "its 2,499 tokens make 1 / 0 / 0 eval batches" in warning
    assert "prepare again with --val-fraction 0.037 or more" in warning
    fraction = 0.037 / 1.25  # a tail split takes exactly its share of tokens
    assert f"--val-fraction {float(f'{32_769 / 1_099_574:.2g}'):g}" in small_val_warning(
        2_499, 1_099_574, "tail"
    )
    assert abs(32_769 / 1_099_574 - fraction) < 1e-3
    assert small_val_warning(40_000, 2_000_000, "hash") is None  # two batches of 8 × 2048
    assert small_val_warning(0, 2_000_000, "hash") is None  # no val split asked for
