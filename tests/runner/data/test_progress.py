"""Progress of data preparation while a BPE tokenizer trains: its merges, which report nothing
themselves, are shown as they run (a line off a terminal, every interval and at both ends)."""

from __future__ import annotations

import contextlib
import time

from m3run.runner.data.prepare import prepare_data
from m3run.runner.data.progress import Progress
from m3run.runner.data.tokenizer import train_bpe


def test_waiting_says_it_started_how_long_it_has_run_and_when_it_ended(capsys):
    seen = ""
    with Progress("lines", interval_s=0.01) as bar, bar.waiting("computing merges"):
        deadline = time.monotonic() + 60
        while "so far)" not in seen and time.monotonic() < deadline:
            seen += capsys.readouterr().err
    seen += capsys.readouterr().err
    lines = seen.splitlines()
    assert lines[0] == "prepare-data: computing merges"
    assert any(line.endswith(" s so far)") for line in lines[1:-1]), seen
    assert lines[-1].startswith("prepare-data: computing merges done in ")


def test_waiting_is_silent_with_progress_off(capsys):
    with Progress("off") as bar, bar.waiting("computing merges"):
        pass
    assert capsys.readouterr().err == ""


def test_train_bpe_enters_merging_once_every_text_is_read_and_leaves_before_it_saves(tmp_path):
    texts = [f"document {i} with some words, the words repeat: {i % 7}" for i in range(200)]
    read = []
    path = tmp_path / "tokenizer.json"
    seen: dict[str, object] = {}

    def counted():
        for t in texts:
            read.append(t)
            yield t

    @contextlib.contextmanager
    def merging():
        seen["read_at_start"] = len(read)
        yield
        seen["saved_at_end"] = path.exists()

    train_bpe(counted(), 300, path, merging())
    assert seen == {"read_at_start": len(texts), "saved_at_end": False}
    assert path.is_file()


def test_prepare_data_shows_the_merges_of_a_bpe_it_trains(tmp_path, capsys):
    prepare_data(["stdlib"], tmp_path / "data", tokenizer="bpe:512", max_bytes=100_000)
    err = capsys.readouterr().err
    assert "prepare-data: training bpe:512: computing merges\n" in err, err
    assert "prepare-data: training bpe:512: computing merges done in " in err, err
