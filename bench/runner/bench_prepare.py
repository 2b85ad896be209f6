"""prepare-data throughput (MB/s of text) against its tokenizer driven directly, per core.

    python bench/runner/bench_prepare.py --mb 64 --workers 1 4 8 --dir /tmp/prepbench
    python bench/runner/bench_prepare.py --mb 8 --workers 1 --dir /tmp/prepbench         # CPU smoke

Generates a corpus of word-salad documents (seeded, ~2 kB each, the length of a typical web
page) as JSON Lines and parquet, trains a byte-level BPE of --vocab tokens on a slice of it (or
takes --tokenizer: `gpt2` or a tokenizer.json), then measures in the same run:

* direct: the tokenizer library's own batch encoder over the same texts, already in memory,
  one thread per process (tokenizers' `encode_batch` or `encode_batch_fast`, whichever is
  faster, under RAYON_NUM_THREADS=1; tiktoken's `encode_ordinary_batch(num_threads=1)`), in N
  processes each encoding 1/N of the texts: the ceiling for N cores on this machine (a core's
  speed drops as more of its neighbours work, so N=1 would flatter nothing).
* prepare: `prepare_data` end to end (read and parse the file, tokenise, hash, split, write and
  fsync the shards, the manifests) with `--workers N` tokenizer processes.

Reported: MB/s, MB/s per core (÷ min(N, cores)), and prepare as a share of direct at the same N;
the target is ≥ 80%. The best of --reps runs is kept for each. Prints one JSON line per
measurement and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

# One encoder thread everywhere: the direct baseline and the in-process path measure one core.
os.environ["RAYON_NUM_THREADS"] = "1"

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from m3run.runner.data.prepare import prepare_data  # noqa: E402
from m3run.runner.data.tokenizer import Tokenizer, train_bpe  # noqa: E402

_SYLLABLES = (
    "ka ro mi the an ing er on al re de ti st ou se ma le pro con ver ex pre com par ly "
    "ment tion über na ï 数 据 def ret urn imp ort self ( ) : = 0 1 2 3 . , ; http www"
)


def _corpus(n_bytes: int, seed: int) -> list[str]:
    """Documents of Zipf-distributed pseudo-words from a 20,000-word lexicon, so a BPE of a
    few thousand tokens has real merges to learn and the encoder works as on prose."""
    rng = random.Random(seed)
    syllables = _SYLLABLES.split()
    lexicon = ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(20_000)]
    weights = [1.0 / (i + 1) for i in range(len(lexicon))]
    docs, size = [], 0
    while size < n_bytes:
        n = rng.randint(150, 550)
        words = rng.choices(lexicon, weights, k=n)
        lines = [" ".join(words[i : i + 14]) for i in range(0, n, 14)]
        doc = "\n".join(lines) + "\n"
        docs.append(doc)
        size += len(doc.encode())
    return docs


def _encode(tok: Tokenizer, docs: list[str], fast: bool) -> None:
    batch = 1024
    for i in range(0, len(docs), batch):
        texts = docs[i : i + batch]
        if tok.kind == "tiktoken":
            tok._backend.encode_ordinary_batch(texts, num_threads=1)
        elif fast:
            tok._backend.encode_batch_fast(texts, add_special_tokens=False)
        else:
            tok._backend.encode_batch(texts, add_special_tokens=False)


def _encode_slice(kind: str, spec: str, docs: list[str], fast: bool) -> tuple[float, float]:
    """In a pool process: encode docs; the wall-clock (start, end) of the encoding alone."""
    tok = Tokenizer.load(kind, spec)
    started = time.time()
    _encode(tok, docs, fast)
    return started, time.time()


def _direct_mb_s(tok: Tokenizer, docs: list[str], mb: float, n: int) -> float:
    """The library's batch encoder, its faster variant where it has one, over n processes
    each encoding 1/n of the texts already in memory: the ceiling for n tokenizer cores."""
    best = 0.0
    for fast in (False, True) if tok.kind == "hf" else (False,):
        if n == 1:
            started = time.perf_counter()
            _encode(tok, docs, fast)
            best = max(best, mb / (time.perf_counter() - started))
            continue
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(n, mp_context=ctx) as pool:
            parts = [docs[i::n] for i in range(n)]
            spans = list(
                pool.map(_encode_slice, [tok.kind] * n, [tok.source] * n, parts, [fast] * n)
            )
        best = max(best, mb / (max(e for _, e in spans) - min(s for s, _ in spans)))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=32, help="MB of generated text")
    ap.add_argument("--workers", type=int, nargs="+", default=[1])
    ap.add_argument("--formats", nargs="+", default=["jsonl", "parquet"])
    ap.add_argument("--tokenizer", default=None, help="gpt2 | tokenizer.json (default: train BPE)")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dir", type=Path, required=True)
    args = ap.parse_args()

    root = args.dir
    root.mkdir(parents=True, exist_ok=True)
    docs = _corpus(int(args.mb * 1e6), seed=0)
    mb = sum(len(d.encode()) for d in docs) / 1e6
    files = {}
    if "jsonl" in args.formats:
        files["jsonl"] = root / "corpus.jsonl"
        with open(files["jsonl"], "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    if "parquet" in args.formats:
        import pyarrow as pa
        import pyarrow.parquet as pq

        files["parquet"] = root / "corpus.parquet"
        pq.write_table(pa.table({"text": docs}), files["parquet"], row_group_size=8192)

    if args.tokenizer is None:
        tok_path = root / "tokenizer.json"
        if not tok_path.is_file():
            train_bpe(docs[: max(1, len(docs) // 8)], args.vocab, tok_path)
        spec = str(tok_path)
    else:
        spec = args.tokenizer
    tok = Tokenizer.load("tiktoken", spec) if spec == "gpt2" else Tokenizer.load("hf", str(spec))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()

    rows = []
    direct = {}
    for n in args.workers:
        direct[n] = max(_direct_mb_s(tok, docs, mb, n) for _ in range(args.reps))
        row = {"what": "direct", "workers": n, "mb": round(mb, 1), "mb_s": round(direct[n], 2)}
        row["mb_s_per_core"] = round(direct[n] / min(n, cores), 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    for fmt, path in files.items():
        for n in args.workers:
            best = 0.0
            for _ in range(args.reps):
                out = root / "out"
                shutil.rmtree(out, ignore_errors=True)
                started = time.perf_counter()
                prepare_data([str(path)], out, tokenizer=spec, workers=n, progress=False)
                best = max(best, mb / (time.perf_counter() - started))
            row = {
                "what": f"prepare {fmt}",
                "workers": n,
                "mb": round(mb, 1),
                "mb_s": round(best, 2),
                "mb_s_per_core": round(best / min(n, cores), 2),
                "of_direct": round(best / direct[n], 3),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\ntokenizer {spec} (vocab {tok.vocab_size}), {mb:.1f} MB, {cores} cores")
    print(f"{'what':<16}{'workers':>8}{'MB/s':>10}{'MB/s/core':>11}{'of direct':>11}")
    for r in rows:
        per_core = r["mb_s_per_core"]
        share = f"{r['of_direct']:.0%}" if "of_direct" in r else "—"
        print(f"{r['what']:<16}{r['workers']:>8}{r['mb_s']:>10.2f}{per_core:>11.2f}{share:>11}")


if __name__ == "__main__":
    main()
