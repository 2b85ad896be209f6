"""The preflight smoke test: numbered checks, skipped ones named with the reason."""

from __future__ import annotations

from helpers.runs import DEMO_CONFIG, tiny_run_overrides

from runner.config import load_config
from runner.worker.smoke import CHECKS, SCRATCH_PREFIX, run_smoke


def test_smoke_passes_on_cpu_and_names_what_it_skipped(corpus):
    lines: list[str] = []
    result = run_smoke(load_config(DEMO_CONFIG, tiny_run_overrides(corpus)), echo=lines.append)
    assert result.ok, result.failed_check_message
    assert [c.number for c in result.checks] == list(range(1, len(CHECKS) + 1))
    by_name = {c.name: c for c in result.checks}
    for name in ("CUDA and bf16", "peak memory of one micro-batch"):
        assert by_name[name].status == "skipped" and "no CUDA device" in by_name[name].message
    for name in ("data readable", "model forward/backward", "scan backend on every block",
                 "scan parity with the reference", "one optimizer step lowers the loss",
                 "checkpoint save/verify/load"):  # fmt: skip
        assert by_name[name].status == "ok", by_name[name]
    # data.reset_at_eos is on by default: the parity check covers the resets training uses.
    assert "recurrent reference with resets" in by_name["scan parity with the reference"].message
    assert len(lines) == len(CHECKS) and lines[0].startswith("  [1/8]")
    for line, check in zip(lines, result.checks, strict=True):  # each line shows its time
        assert line.endswith(f"{check.seconds:6.1f} s  {check.message}"), line


def test_smoke_failure_names_the_check_and_the_problem(tmp_path):
    missing = tmp_path / "absent" / "train"
    cfg = load_config(
        DEMO_CONFIG, tiny_run_overrides(tmp_path, **{"data.train_path": str(missing)})
    )
    result = run_smoke(cfg, echo=None)
    assert not result.ok
    msg = result.failed_check_message
    assert msg.startswith("check 2 (data readable) failed") and str(missing) in msg
    assert "prepare-data" in msg
    dependent = {c.name: c.status for c in result.checks}
    assert dependent["model forward/backward"] == "skipped"


def test_the_checkpoint_round_trip_runs_in_the_run_dir_and_leaves_nothing(corpus, tmp_path):
    # Under the supervisor check 7 writes where the run's checkpoints go, in a scratch
    # directory it removes, along with any a smoke test killed mid-write left behind.
    run_dir = tmp_path / "run"
    stale = run_dir / f"{SCRATCH_PREFIX}killed" / "checkpoints"
    stale.mkdir(parents=True)
    result = run_smoke(load_config(DEMO_CONFIG, tiny_run_overrides(corpus)), run_dir, echo=None)
    assert result.ok, result.failed_check_message
    check = {c.name: c for c in result.checks}["checkpoint save/verify/load"]
    assert check.status == "ok" and "beside checks 3–6" in check.message, check
    assert list(run_dir.iterdir()) == []


def test_a_checkpoint_round_trip_that_fails_on_its_thread_fails_check_7(corpus, tmp_path):
    # Check 7 runs on a thread beside checks 3–6: a run dir that refuses its scratch directory
    # (a file where the directory should be; root cannot get past that either) must fail check
    # 7 with the error and the path, leave the other checks as they were, and not hang.
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    result = run_smoke(load_config(DEMO_CONFIG, tiny_run_overrides(corpus)), blocker, echo=None)
    by_name = {c.name: c for c in result.checks}
    check = by_name["checkpoint save/verify/load"]
    assert check.status == "failed" and str(blocker) in check.message, check
    assert result.failed_check_message.startswith("check 7 (checkpoint save/verify/load) failed")
    for name in ("model forward/backward", "one optimizer step lowers the loss"):
        assert by_name[name].status == "ok", by_name[name]
