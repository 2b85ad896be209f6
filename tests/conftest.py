"""Shared fixtures: a small token corpus prepared once per session. The tests dir goes on
sys.path so that what tests share imports as `helpers.*`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """Token shards prepared from ~400 kB of the Python standard library with a 512-token BPE
    (seconds on 2 cores). Returns the output dir holding train/ and val/."""
    from m3run.runner.data.prepare import prepare_data

    out = tmp_path_factory.mktemp("corpus") / "data"
    prepare_data(["stdlib"], out, tokenizer="bpe:512", max_bytes=400_000, progress=False)
    return out
