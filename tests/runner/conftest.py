"""Fixtures of the runner tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.supervision import STANDIN


@pytest.fixture
def standin() -> Path:
    """The stand-in worker script the supervisor tests run (tests/helpers/supervision.py)."""
    return STANDIN
