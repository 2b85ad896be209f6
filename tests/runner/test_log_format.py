"""`m3run launch --log-format json`: every line on stdout and stderr is one JSON object, from the
supervisor, the worker (logged steps, evals and smoke checks as records with their numbers as
fields) and the launch itself (refusals, usage errors), with the exit code the text console
would give."""

from __future__ import annotations

import json
import subprocess

import pytest
from helpers.launching import launch_argv
from helpers.run_dirs import invoke
from helpers.runs import DEMO_CONFIG, REPO, tiny_run_overrides, worker_env

from m3run.runner.files import read_jsonl
from m3run.runner.protocol import (
    EXIT_CONFIG,
    EXIT_OK,
    METRICS_FILE,
    StepRecord,
    worker_record_line,
)
from m3run.runner.supervisor.events import EventLog

KEYS = {"time", "source", "level", "event"}


def _records(text: str) -> list[dict]:
    """Each non-empty line of `text` as a JSON object (a line that is not one fails)."""
    records = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            pytest.fail(f"not a JSON line: {line!r}\n--- the whole output:\n{text}")
        assert isinstance(rec, dict) and rec.keys() >= KEYS, line
        records.append(rec)
    return records


@pytest.mark.slow
def test_a_json_launch_prints_only_records_with_steps_as_numbers(corpus, tmp_path):
    run_dir = tmp_path / "run"
    sets = tiny_run_overrides(
        corpus, **{"train.total_steps": 4, "eval.interval_steps": 2, "supervisor.smoke": "true"}
    )
    done = subprocess.run(
        launch_argv(run_dir, sets, "--log-format", "json"),
        capture_output=True,
        text=True,
        cwd=REPO,
        env=worker_env(),
        timeout=300,
    )
    assert done.returncode == EXIT_OK, done.stdout + done.stderr
    records = _records(done.stdout) + _records(done.stderr)
    steps = [r for r in records if r["source"] == "worker" and r["event"] == "train"]
    evals = [r for r in records if r["source"] == "worker" and r["event"] == "eval"]
    logged = [r for r in read_jsonl(run_dir / METRICS_FILE) if r["kind"] == "train"]
    assert [r["step"] for r in steps] == [r["step"] for r in logged] == [1, 2, 3, 4]
    for rec, metrics in zip(steps, logged, strict=True):
        assert rec["total_steps"] == 4
        for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
            assert isinstance(rec[key], float), (key, rec)
            assert rec[key] == pytest.approx(metrics[key], rel=1e-6)
        assert isinstance(rec["tokens_seen"], int)
    assert [r["step"] for r in evals] == [2, 4]
    assert all(isinstance(r["eval_loss"], float) for r in evals)
    checks = [r for r in records if r["event"] == "smoke_check"]
    assert [(r["number"], r["total"]) for r in checks] == [(n, 8) for n in range(1, 9)]
    assert {r["status"] for r in checks} <= {"ok", "skipped"}
    assert all(isinstance(r["seconds"], float) and r["name"] for r in checks)
    assert {"launch", "finished"} <= {r["event"] for r in records if r["source"] == "supervisor"}


def test_a_bad_config_with_json_is_one_error_record_and_exit_78(tmp_path):
    result = invoke(
        "launch", DEMO_CONFIG, "--run-dir", tmp_path / "r", "--set", "train.lr=abc",
        "--log-format", "json",
    )  # fmt: skip
    assert result.exit_code == EXIT_CONFIG, result.output
    assert result.stdout == ""
    (rec,) = _records(result.stderr)
    assert (rec["source"], rec["level"], rec["exit_code"]) == ("launch", "error", EXIT_CONFIG)
    assert "train.lr: must be a number, got 'abc'" in rec["reason"]
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "args, says",
    [
        ((), "Missing argument 'CONFIG'"),
        ((DEMO_CONFIG, "--bogus"), "No such option: --bogus"),
        ((DEMO_CONFIG, "--resume", "newest"), "--resume must be latest, none or a step number"),
    ],
    ids=["missing-config", "unknown-option", "bad-resume"],
)
def test_usage_errors_with_json_are_error_records_and_exit_2(tmp_path, args, says):
    result = invoke("launch", *args, "--run-dir", tmp_path / "r", "--log-format=json")
    assert result.exit_code == 2, result.output
    (rec,) = _records(result.output)
    assert rec["event"] == "usage_error" and rec["exit_code"] == 2
    assert says in rec["reason"]


def test_usage_errors_stay_text_without_json(tmp_path):
    result = invoke("launch", DEMO_CONFIG, "--bogus")
    assert result.exit_code == 2 and "No such option: --bogus" in result.output
    assert not result.output.lstrip().startswith("{")


def test_the_json_console_gives_worker_records_their_fields_and_lines_a_level(tmp_path, capsys):
    step = StepRecord(
        time=1.5, step=7, total_steps=10, loss=2.25, ppl=9.49, lr=3e-4, grad_norm=0.5,
        tokens_per_s=1234.5, tokens_seen=4096, eta_s=float("nan"),
    )  # fmt: skip
    log = EventLog(tmp_path, console=True, log_format="json")
    try:
        log.echo(worker_record_line(step) + "\n")
        log.echo("error: data file missing\n")
        log.echo('{"kind": "something a library printed"}\n')
    finally:
        log.close()
    first, second, third = _records(capsys.readouterr().out)
    assert first["event"] == "train" and first["source"] == "worker"
    assert (first["step"], first["loss"], first["tokens_per_s"]) == (7, 2.25, 1234.5)
    assert first["time"] == "1970-01-01T00:00:01.500Z" and first["eta_s"] is None
    assert (second["event"], second["level"]) == ("output", "error")
    assert second["line"] == "error: data file missing"
    assert third["event"] == "output" and third["line"] == '{"kind": "something a library printed"}'
