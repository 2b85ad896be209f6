"""The token-weighted mixture of prepared sources: proportions, order, epoch caps, ranks, and
resume (exact, fingerprinted, re-derived under --force)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.runs import tiny_run_overrides
from helpers.tokens import text
from helpers.training import run_worker, sigterm_worker_at, train_losses
from safetensors.torch import load_file

from m3run.runner.checkpoint.layout import latest_complete
from m3run.runner.data.loader import BatchLoader
from m3run.runner.data.manifest import DataError
from m3run.runner.data.mixture import MixtureLoader, Source
from m3run.runner.data.prepare import prepare_data
from m3run.runner.files import read_jsonl

SEQ, MBS = 16, 4


def _source(root: Path, name: str, words: list[str], n_docs: int, tokenizer: str) -> Path:
    rng = random.Random(name)
    path = root / f"{name}.jsonl"
    with open(path, "w") as f:
        for _ in range(n_docs):
            doc = " ".join(rng.choice(words) for _ in range(60)) + "\n"
            f.write(json.dumps({"text": doc}) + "\n")
    prepare_data([str(path)], root / name, tokenizer=tokenizer, val_fraction=0, progress=False)
    return root / name / "train"


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """Two sources with disjoint words, so every window's source is plain from its tokens, and
    a third prepared with another tokenizer."""
    root = tmp_path_factory.mktemp("mix")
    rng = random.Random(0)
    corpus = root / "all.txt"
    corpus.write_text("\n\n".join(text(rng, 48) for _ in range(50)) + "\nxq zv kw yj\n")
    prepare_data([str(corpus)], root / "tok", tokenizer="bpe:300", progress=False)
    tok = str(root / "tok" / "tokenizer.json")
    prepare_data([str(corpus)], root / "other", tokenizer="bpe:280", progress=False)
    return {
        "web": _source(root, "web", ["the", "cat", "sat", "on", "mat", "über"], 80, tok),
        "code": _source(root, "code", ["def", "return", "(", ")", ":", "="], 4, tok),
        "other": root / "other" / "train",
    }


def _windows_of(split: Path) -> set[tuple[int, ...]]:
    loader = BatchLoader(split, SEQ, 1, seed=0, prefetch=0)
    rows = {tuple(loader.windows[i].tolist()) for i in range(loader.num_windows)}
    loader.close()
    return rows


def _mix(sources, weights=(0.8, 0.2), **kwargs) -> MixtureLoader:
    kwargs.setdefault("seed", 3)
    caps = kwargs.pop("max_epochs", (None, None))
    srcs = [
        Source(str(sources[n]), w, cap)
        for n, w, cap in zip(("web", "code"), weights, caps, strict=True)
    ]
    return MixtureLoader(srcs, SEQ, MBS, **kwargs)


def _read(loader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [loader.next_batch() for _ in range(n)]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b, strict=True)
    )


def test_a_two_source_mix_follows_the_weights_by_tokens(sources):
    web, code = _windows_of(sources["web"]), _windows_of(sources["code"])
    assert not web & code
    loader = _mix(sources)
    seen = {"web": 0, "code": 0}
    for x, y in _read(loader, 50):  # 200 windows
        for row in torch.cat([x, y[:, -1:]], dim=1):
            key = tuple(row.tolist())
            seen["web" if key in web else "code"] += 1
            assert key in web or key in code
    assert sum(seen.values()) == 200
    assert abs(seen["web"] / 200 - 0.8) <= 0.02 and abs(seen["code"] / 200 - 0.2) <= 0.02
    assert loader.tokens_by_source() == {"web": seen["web"] * SEQ, "code": seen["code"] * SEQ}
    # The small source is read past its end: it wraps into a fresh permutation (epoch 1).
    state = loader.state_dict()
    assert state["sources"][1]["windows"] == seen["code"]
    assert state["sources"][1]["epoch"] == seen["code"] // state["sources"][1]["num_windows"] >= 1
    loader.close()


def test_order_is_fixed_by_the_seed(sources):
    a, b, c = _mix(sources, seed=5), _mix(sources, seed=5), _mix(sources, seed=6)
    first, again, other = _read(a, 6), _read(b, 6), _read(c, 6)
    assert _same(first, again) and not _same(first, other)
    for loader in (a, b, c):
        loader.close()


def test_resume_from_state_dict_is_exact(sources, tmp_path):
    reference = _mix(sources, prefetch=3)
    _read(reference, 7)
    state = reference.state_dict()
    expected = _read(reference, 9)
    torch.save(state, tmp_path / "state.pt")
    restored = torch.load(tmp_path / "state.pt", weights_only=True)
    resumed = _mix(sources, prefetch=2)
    _read(resumed, 3)  # a running prefetcher is reset by load_state_dict
    resumed.load_state_dict(restored)
    assert resumed.tokens_by_source() == {s["name"]: s["windows"] * SEQ for s in state["sources"]}
    assert _same(_read(resumed, 9), expected)
    for loader in (reference, resumed):
        loader.close()


def test_another_mix_is_refused_unless_forced(sources):
    loader = _mix(sources)
    _read(loader, 5)
    state = loader.state_dict()
    loader.close()
    changed = _mix(sources, weights=(0.5, 0.5))
    with pytest.raises(DataError) as e:
        changed.load_state_dict(state)
    msg = str(e.value)
    assert "belongs to another data mix (web (weight 0.8), code (weight 0.2))" in msg
    assert "--force" in msg and "global window 20" in msg
    changed.close()

    lines = []
    forced = _mix(sources, weights=(0.5, 0.5), force=True, log=lines.append)
    forced.load_state_dict(state)
    assert forced.windows_consumed == 20
    assert forced.tokens_by_source() == {"web": 10 * SEQ, "code": 10 * SEQ}
    assert len(lines) == 1 and "data mix changed (--force)" in lines[0]
    assert "web=10, code=10" in lines[0]
    forced.next_batch()
    forced.close()

    # A single-source checkpoint is another mix too.
    single = BatchLoader(sources["web"], SEQ, MBS, seed=3)
    with pytest.raises(DataError, match=r"another data mix \(one source \(data.train_path\)\)"):
        _mix(sources).load_state_dict(single.state_dict())
    single.close()


def test_one_source_mix_reads_what_train_path_reads(sources):
    mix = MixtureLoader([Source(str(sources["web"]), 1.0)], SEQ, MBS, seed=4)
    single = BatchLoader(sources["web"], SEQ, MBS, seed=4)
    assert _same(_read(mix, 30), _read(single, 30))  # past an epoch boundary too
    mix.close()
    single.close()


def test_an_epoch_cap_takes_a_source_out_of_the_mix(sources):
    code = _windows_of(sources["code"])
    loader = _mix(sources, max_epochs=(None, 1.0), prefetch=0)
    n_code = len(loader.windows[1])
    drawn = []
    for x, y in _read(loader, 2 * n_code):
        drawn += [tuple(r.tolist()) in code for r in torch.cat([x, y[:, -1:]], dim=1)]
    assert sum(drawn) == n_code, "the capped source gives exactly one epoch"
    assert not any(drawn[-MBS * 4 :]), "then only the other source is read"
    # Every source capped: a clear error once they are spent.
    capped = _mix(sources, max_epochs=(0.05, 0.05), prefetch=0)
    with pytest.raises(DataError, match="every data source has reached its max_epochs"):
        _read(capped, 100)
    for lo in (loader, capped):
        lo.close()


def test_ranks_take_disjoint_slices_of_the_global_batch(sources):
    whole = _mix(sources, seed=11)
    whole_batches = _read(whole, 1)
    whole.close()
    srcs = [Source(str(sources["web"]), 0.8), Source(str(sources["code"]), 0.2)]
    ranks = [MixtureLoader(srcs, SEQ, MBS // 2, seed=11, rank=r, world_size=2) for r in range(2)]
    (x0, _), (x1, _) = (r.next_batch() for r in ranks)
    assert torch.equal(torch.cat([x0, x1]), whole_batches[0][0])
    assert ranks[0].state_dict() == ranks[1].state_dict()
    for r in ranks:
        r.close()


@pytest.mark.parametrize(
    ("build", "needle"),
    [
        (lambda s: [Source(str(s["web"]), 0.0)], "weight 0.0 must be a number > 0"),
        (lambda s: [Source(str(s["web"]), 1.0, -1.0)], "max_epochs -1.0 must be > 0"),
        (lambda s: [], "data.sources is empty"),
        (
            lambda s: [Source(str(s["web"]), 1.0), Source(str(s["other"]), 1.0)],
            "prepare every source with the same --tokenizer",
        ),
        (
            lambda s: [Source(str(s["web"]), 1.0), Source(str(s["web"]), 1.0)],
            "the same name twice",
        ),
    ],
    ids=["zero-weight", "negative-cap", "empty", "two-tokenizers", "same-name"],
)
def test_bad_mixes_name_the_problem(sources, build, needle):
    with pytest.raises(DataError, match=needle):
        MixtureLoader(build(sources), SEQ, MBS, seed=0)


def test_stride_schedule_shares_stay_within_one_window():
    from m3run.runner.data.mixture import StrideSchedule

    weights = [0.50, 0.20, 0.15, 0.10, 0.05]  # the seed recipe's mix
    schedule = StrideSchedule(weights, [None] * 5)
    picks = [s for s, _ in schedule.slots(0, 2000)]
    for n in (20, 200, 2000):
        counts = np.bincount(picks[:n], minlength=5)
        assert np.all(np.abs(counts - np.array(weights) * n) <= 1.0), (n, counts)
    assert schedule.derive(2000) == schedule.counts_at(2000)


# ---------------------------------------------------------------------------------------------
# a mixed training run
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def second_source(corpus, tmp_path_factory) -> Path:
    """A small source in the session corpus's tokenizer: it wraps into new epochs mid-run."""
    root = tmp_path_factory.mktemp("second")
    rng = random.Random(7)
    (root / "notes.txt").write_text("\n\n".join(text(rng, 36) for _ in range(12)))
    prepare_data(
        [str(root / "notes.txt")],
        root / "notes",
        tokenizer=str(corpus / "tokenizer.json"),
        val_fraction=0,
        progress=False,
    )
    return root / "notes" / "train"


def _mixed_overrides(corpus: Path, second: Path) -> list[str]:
    mix = f"[{{path: {corpus / 'train'}, weight: 0.8}}, {{path: {second}, weight: 0.2}}]"
    return tiny_run_overrides(corpus, **{"data.train_path": "null", "data.sources": mix})


@pytest.mark.slow
def test_sigterm_then_resume_of_a_mixed_run_is_bitwise(corpus, second_source, tmp_path):
    ov = _mixed_overrides(corpus, second_source)
    ref = run_worker(tmp_path / "ref", ov)
    assert ref.returncode == 0, ref.stdout + ref.stderr

    run_dir = tmp_path / "stopped"
    stopped_at = sigterm_worker_at(run_dir, ov)

    again = run_worker(run_dir, ov)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"(step {stopped_at})" in again.stdout
    assert train_losses(run_dir) == train_losses(tmp_path / "ref")  # bitwise, every step
    ref_weights = load_file(str(latest_complete(tmp_path / "ref").path / "model.safetensors"))
    weights = load_file(str(latest_complete(run_dir).path / "model.safetensors"))
    assert all(torch.equal(ref_weights[k], weights[k]) for k in ref_weights)

    # Tokens per source: in every logged record, in the checkpoint, and by the weights.
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    last = records[-1]["tokens_by_source"]
    assert sum(last.values()) == records[-1]["tokens_seen"]
    assert abs(last["notes"] / sum(last.values()) - 0.2) < 0.01
    meta = json.loads((latest_complete(run_dir).path / "meta.json").read_text())
    state = meta["data_state"]
    assert [s["windows"] * 64 for s in state["sources"]] == [last["data"], last["notes"]]
    assert state["sources"][1]["epoch"] >= 1, "the small source wrapped"


@pytest.mark.slow
def test_resuming_on_changed_data_needs_force(corpus, tmp_path):
    """The config is the same, but a source was prepared again with other text: its manifest
    digest, so the mix's fingerprint, changed. Exit 78 naming it; --force re-derives."""
    rng = random.Random(8)
    notes = tmp_path / "notes.txt"
    notes.write_text("\n\n".join(text(rng, 36) for _ in range(12)))
    tok = str(corpus / "tokenizer.json")
    prepare_data([str(notes)], tmp_path / "notes", tokenizer=tok, val_fraction=0, progress=False)
    ov = [*_mixed_overrides(corpus, tmp_path / "notes" / "train"), "train.total_steps=10"]
    first = run_worker(tmp_path / "r", ov)
    assert first.returncode == 0, first.stdout + first.stderr

    notes.write_text("\n\n".join(text(rng, 36) for _ in range(14)))
    prepare_data([str(notes)], tmp_path / "notes", tokenizer=tok, val_fraction=0, progress=False)
    longer = [*ov, "train.total_steps=12"]
    forced = run_worker(tmp_path / "r", longer, "--force")  # --force: total_steps changed too
    assert forced.returncode == 0, forced.stdout + forced.stderr
    assert "data mix changed (--force)" in forced.stdout
    assert "per-source positions re-derived at window 40" in forced.stdout
    prepare_data([str(notes)], tmp_path / "notes", tokenizer=tok, val_fraction=0.2, progress=False)
    again = run_worker(tmp_path / "r", [*ov, "train.total_steps=12"])
    assert again.returncode == 78, again.stdout + again.stderr
    assert "belongs to another data mix" in again.stdout + again.stderr
