"""Small corpora on disk and readers of prepared token shards, for the data tests."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import numpy as np

from m3run.runner.data.manifest import load_manifest
from m3run.runner.data.tokenizer import EOS_TEXT, load_tokenizer

# Multi-byte characters and code-like symbols, so byte-level BPE has something to merge.
WORDS = ["the", "a", "cat", "sat", "on", "mat", "über", "naïve", "数据", "alpha", "beta"]
WORDS += ["gamma", "delta", "=", "(", ")", ":", "def", "return"]


def text(rng: random.Random, n_words: int) -> str:
    lines = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(n_words // 12)]
    return "\n".join(lines) + "\n"


def documents_on_disk(root: Path) -> tuple[list[Path], Path, list[str]]:
    """12 text files in nested folders (+ a hidden file, never read) and a jsonl of 20."""
    rng = random.Random(1234)
    folder = root / "corpus"
    texts = []
    for i in range(12):
        path = folder / f"part{i % 3}" / f"doc{i:02d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = text(rng, 120)
        if i == 5:
            doc += f"a document that mentions {EOS_TEXT} literally\n"
        path.write_text(doc, encoding="utf-8")
        texts.append(doc)
    (folder / ".hidden.txt").write_text("never read\n")
    jsonl = root / "records.jsonl"
    with open(jsonl, "w", encoding="utf-8") as f:
        for i in range(20):
            doc = text(rng, 60)
            f.write(json.dumps({"id": i, "text": doc}) + "\n")
            texts.append(doc)
            if i == 10:
                f.write("\n")  # blank lines are allowed
    return [folder, jsonl], jsonl, texts


def tiny_inputs(root: Path, n_docs: int) -> Path:
    """A folder of n_docs small text files."""
    folder = root / f"tiny{n_docs}"
    rng = random.Random(n_docs)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n_docs):
        (folder / f"{i}.txt").write_text(text(rng, 24))
    return folder


def stream(split_dir: Path) -> np.ndarray:
    """The split's token stream, read straight from the shard files the manifest lists."""
    m = json.loads((split_dir / "manifest.json").read_text())
    dtype = {"uint16": "<u2", "uint32": "<u4"}[m["dtype"]]
    parts = [np.fromfile(split_dir / s["file"], dtype=dtype) for s in m["shards"]]
    return np.concatenate(parts).astype(np.int64)


def decoded_documents(split_dir: Path) -> list[str]:
    """The split's documents, decoded: the stream cut at every EOS."""
    tokens = stream(split_dir)
    m = load_manifest(split_dir)
    assert tokens[-1] == m["eos_id"], "the stream must end with EOS"
    ends = np.flatnonzero(tokens == m["eos_id"])
    tok = load_tokenizer(split_dir)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tok.decode(tokens[a:b]) for a, b in zip(starts, ends, strict=True)]


def val_fraction_of(doc: str) -> float:
    return int.from_bytes(hashlib.sha1(doc.encode()).digest()[:8], "big") / 2**64
