"""A worker attempt's environment: M3RUN_FAULT_SCOPE=first keeps the fault to the first worker;
an unknown scope warns once, naming the value, and acts as all."""

from __future__ import annotations

from m3run.runner.supervisor import worker


def test_first_scope_keeps_the_fault_to_the_first_worker():
    base = {"M3RUN_FAULT": "crash_at_step=3", "M3RUN_FAULT_SCOPE": "first"}
    assert worker.worker_env(base, 1)["M3RUN_FAULT"] == "crash_at_step=3"
    assert "M3RUN_FAULT" not in worker.worker_env(base, 2)


def test_an_unknown_fault_scope_warns_once_and_acts_as_all(capsys):
    worker._warn_fault_scope.cache_clear()
    base = {"M3RUN_FAULT": "crash_at_step=3", "M3RUN_FAULT_SCOPE": "frist"}
    for attempt in (1, 2, 3):
        assert worker.worker_env(base, attempt)["M3RUN_FAULT"] == "crash_at_step=3"
    err = capsys.readouterr().err
    assert err.count("M3RUN_FAULT_SCOPE='frist'") == 1 and "using all" in err
