"""The test-only fault hook refuses what it cannot inject: a misspelt fault or an unusable value
would otherwise leave a chaos test passing with nothing injected."""

from __future__ import annotations

import pytest
from helpers.runs import tiny_run_overrides, worker_env
from helpers.training import run_worker

from m3run.runner.config import ConfigError
from m3run.runner.protocol import EXIT_CONFIG, FAULT_ENV, FAULTS
from m3run.runner.worker.faults import Faults


@pytest.mark.parametrize(
    "raw",
    [
        "crash_at_step=3,nan_at_step=7x3,slow_save=0.5,hold_save=/tmp/x,crash_at_startup",
        "",
    ],
)
def test_known_faults_parse(monkeypatch, raw):
    monkeypatch.setenv(FAULT_ENV, raw)
    faults = Faults.from_env()
    assert set(faults.spec) <= set(FAULTS)
    assert faults.asked == bool(raw)


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ("nan_at_stpe=7", "names the unknown fault 'nan_at_stpe' (known: nan_at_step,"),
        ("crash_at_step=three", "crash_at_step needs a step number, e.g. =7"),
        ("nan_at_step=7x", "nan_at_step needs a step number"),
        ("slow_save=fast", "slow_save needs a number of seconds"),
        ("hold_save=", "hold_save needs a file path"),
        ("crash_at_startup=1", "crash_at_startup needs no value"),
    ],
)
def test_a_fault_the_hook_cannot_inject_is_refused(monkeypatch, raw, says):
    monkeypatch.setenv(FAULT_ENV, raw)
    with pytest.raises(ConfigError, match="M3RUN_FAULT=") as e:
        Faults.from_env()
    assert says in str(e.value)


@pytest.mark.slow
def test_the_worker_exits_78_naming_a_misspelt_fault(corpus, tmp_path):
    r = run_worker(
        tmp_path / "run", tiny_run_overrides(corpus), env=worker_env(M3RUN_FAULT="crash_at_stpe=3")
    )
    assert r.returncode == EXIT_CONFIG, r.stderr
    assert "unknown fault 'crash_at_stpe'" in r.stderr and "Traceback" not in r.stderr
