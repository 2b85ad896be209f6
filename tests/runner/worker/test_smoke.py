"""The preflight smoke test: numbered checks, skipped ones named with the reason."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from helpers.runs import DEMO_CONFIG, tiny_run_overrides
from torch._dynamo.utils import counters

from m3run.runner.config import load_config
from m3run.runner.data.mixture import train_loader
from m3run.runner.protocol import EXIT_CONFIG, EXIT_OK, SMOKE_FILE, StopSaveFigures
from m3run.runner.worker.build import build_model, compile_for_training
from m3run.runner.worker.smoke import CHECKS, run_smoke
from m3run.runner.worker.smoke_round_trip import SCRATCH_PREFIX


def test_smoke_passes_on_cpu_and_names_what_it_skipped(corpus):
    lines: list[str] = []
    result = run_smoke(load_config(DEMO_CONFIG, tiny_run_overrides(corpus)), echo=lines.append)
    assert result.ok, result.failed_check_message
    assert [c.number for c in result.checks] == list(range(1, len(CHECKS) + 1))
    by_name = {c.name: c for c in result.checks}
    for name in ("CUDA and bf16", "peak memory of one micro-batch"):
        assert by_name[name].status == "skipped" and "no CUDA device" in by_name[name].message
    for name in (
        "data readable",
        "model forward/backward",
        "scan backend on every block",
        "scan parity with the reference",
        "one optimizer step lowers the loss",
        "checkpoint save/verify/load",
    ):
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


@pytest.mark.parametrize("data_ok", [True, False])
def test_the_smoke_child_leaves_its_verdict_its_output_and_its_exit_code(corpus, tmp_path, data_ok):
    # As the supervisor runs it: the child skips the interpreter's teardown once the verdict is
    # written, so nothing it printed may be lost and its exit code must still say pass or fail.
    train = corpus / "train" if data_ok else tmp_path / "absent" / "train"
    config = tmp_path / "config.yaml"
    cfg = load_config(DEMO_CONFIG, tiny_run_overrides(corpus, **{"data.train_path": str(train)}))
    config.write_text(cfg.to_yaml())
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    child = subprocess.run(
        [sys.executable, "-m", "m3run.runner.worker.smoke", str(config), "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    verdict = json.loads((run_dir / SMOKE_FILE).read_text())
    lines = child.stdout.splitlines()
    numbers = [f"  [{n}/{len(CHECKS)}]" for n in range(1, len(CHECKS) + 1)]
    assert [line[: len(numbers[0])] for line in lines[: len(CHECKS)]] == numbers, child.stdout
    if data_ok:
        assert child.returncode == EXIT_OK and verdict["ok"], child.stdout + child.stderr
        assert lines[-1] == "smoke: ok: 6 checks passed, 2 skipped", child.stdout
        # What a save on a stop costs, for the supervisor's launch line: a full checkpoint's
        # bytes (the weights and the stepped AdamW's two moments, so about three times the
        # weights) and the write speed check 7 saw.
        figures = StopSaveFigures.from_dict(verdict["stop_save"])
        weights = 4 * build_model(cfg, torch.device("cpu")).num_params()
        assert figures is not None and figures.write_bytes_per_s > 0, verdict
        assert 3 * weights <= figures.checkpoint_bytes < 3.1 * weights, (figures, weights)
    else:
        assert child.returncode == EXIT_CONFIG and not verdict["ok"], child.stdout + child.stderr
        assert lines[-1].startswith("smoke: FAILED: check 2 (data readable) failed"), lines[-1]
        assert str(train) in verdict["message"]


@pytest.mark.parametrize("scope", ["blocks", "model"])
def test_with_train_compile_check_3_runs_the_compiled_step_and_nothing_else_compiles(corpus, scope):
    # Check 3 compiles what the worker's first step compiles (its graphs, at the run's shapes,
    # cached for the worker); check 4's single row and check 6's fresh model run eagerly, so
    # the smoke test traces no graph the worker will not use. aot_eager: CI has no compiler.
    cfg = load_config(
        DEMO_CONFIG,
        tiny_run_overrides(corpus, **{"train.compile": "true", "train.compile_scope": scope}),
    )
    try:
        torch._dynamo.reset()
        counters.clear()
        result = run_smoke(cfg, echo=None, compile_backend="aot_eager")
        graphs = counters["stats"]["unique_graphs"]
        # What one compiled forward/backward at the run's shapes traces, as the worker runs it.
        torch._dynamo.reset()
        counters.clear()
        model = build_model(cfg, torch.device("cpu"))
        step = compile_for_training(model, cfg.train, backend="aot_eager")
        loader = train_loader(
            cfg.data.train_path,
            None,
            cfg.data.seq_len,
            cfg.train.micro_batch_size,
            cfg.train.seed,
            prefetch=0,
        )
        try:
            step(*loader.next_batch(), eos_id=loader.eos_id).backward()
        finally:
            loader.close()
        expected = counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    assert result.ok, result.failed_check_message
    by_name = {c.name: c for c in result.checks}
    check = by_name["model forward/backward"]
    assert f"compiled (scope {scope}) as the worker runs it" in check.message, check
    # Where the compile's time went, by torch's own timers (what a cold launch's profile reads).
    assert re.search(r"torch.compile's timers, nested: tracing [\d.]+ s, backend", check.message)
    for name in ("scan backend on every block", "one optimizer step lowers the loss"):
        assert by_name[name].status == "ok", by_name[name]
    # blocks: one graph that every layer shares, and the loss's.
    assert expected == 2 if scope == "blocks" else expected >= 1
    assert graphs == expected, counters["stats"]


def test_a_compile_that_fails_fails_check_3_with_the_fix(corpus):
    # What a broken toolchain does to torch.compile (inductor needs a C compiler and Triton's
    # own): the launch stops here with the way out, not at the worker's first step, restarted
    # again and again.
    def broken(gm, example_inputs):
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable")

    cfg = load_config(DEMO_CONFIG, tiny_run_overrides(corpus, **{"train.compile": "true"}))
    torch._dynamo.reset()
    try:
        result = run_smoke(cfg, echo=None, compile_backend=broken)
    finally:
        torch._dynamo.reset()
    msg = result.failed_check_message
    assert msg.startswith("check 3 (model forward/backward) failed: torch.compile of the "), msg
    assert "Failed to find C compiler" in msg and "set train.compile=false" in msg, msg


def test_without_train_compile_check_3_says_nothing_of_a_compile(corpus):
    result = run_smoke(load_config(DEMO_CONFIG, tiny_run_overrides(corpus)), echo=None)
    check = {c.name: c for c in result.checks}["model forward/backward"]
    assert check.status == "ok" and "compiled" not in check.message, check


# The smoke test, then the worker's setup as the trainer runs it (the scan's precompile, the
# compile, a forward/backward), each in a process of its own sharing the caches, as under the
# supervisor.
_WORKER_COMPILE = """
import sys, torch
from torch._dynamo.utils import counters
from m3run.runner.config import load_config
from m3run.runner.worker.build import autocast, build_model, compile_for_training
from m3run.runner.data.mixture import train_loader

cfg = load_config(sys.argv[1], sys.argv[2:])
t = cfg.train
model = build_model(cfg, torch.device("cuda"))
loader = train_loader(cfg.data.train_path, cfg.data.sources, cfg.data.seq_len,
                      t.micro_batch_size, t.seed, prefetch=0)
model.precompile_scan(t.micro_batch_size, cfg.data.seq_len, torch.bfloat16, reset=True)
step = compile_for_training(model, cfg.train)
x, y = (v.cuda() for v in loader.next_batch())
with autocast(x.device, torch.bfloat16):
    loss = step(x, y, eos_id=loader.eos_id)
loss.backward()
cache = counters["inductor"]
print("CACHE", cache["fxgraph_cache_hit"], cache["fxgraph_cache_miss"], dict(counters["stats"]))
"""


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_after_a_compiled_smoke_test_the_workers_compile_is_read_from_the_caches(corpus, tmp_path):
    on_cuda = {"train.device": "cuda", "train.precision": "bf16", "train.compile": "true"}
    overrides = tiny_run_overrides(corpus, **on_cuda)
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
        "TRITON_CACHE_DIR": str(tmp_path / "triton"),
        "M3RUN_SCAN_PLANS": str(tmp_path / "scan_plans.json"),  # none tuned on this machine
    }
    config = tmp_path / "config.yaml"
    config.write_text(load_config(DEMO_CONFIG, overrides).to_yaml())
    smoke = subprocess.run(
        [
            sys.executable,
            "-m",
            "m3run.runner.worker.smoke",
            str(config),
            "--run-dir",
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert smoke.returncode == 0, smoke.stdout + smoke.stderr
    # Check 4 says where the scan's launch plans come from (the tiny shapes are in no table).
    assert "launch plans: no tuned launch plan for sm" in smoke.stdout, smoke.stdout
    assert "m3run tune-scan CONFIG" in smoke.stdout
    worker = subprocess.run(
        [sys.executable, "-c", _WORKER_COMPILE, str(config)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert worker.returncode == 0, worker.stdout + worker.stderr
    hits, misses = map(int, worker.stdout.split("CACHE")[1].split()[:2])
    assert hits >= 2 and misses == 0, worker.stdout  # the block's and the loss's graphs


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_without_a_tuned_plan_the_smoke_test_tunes_one_once(corpus, tmp_path, monkeypatch):
    """supervisor.tune_scan: on a GPU that neither this machine's plans nor the checked-in table
    cover, check 3 tunes the scan's plans first (here over two candidates a kernel), stores
    them, and the kernels run under them; the next smoke test finds them and does not tune. A
    plans file that cannot be written does not stop the launch: check 3 says so, with the fix,
    and the run keeps the defaults."""
    from m3run.kernels.mamba3 import plans as lp
    from m3run.kernels.mamba3.plans import lookup
    from m3run.kernels.mamba3.tools import tuning

    C = lp.LaunchConfig
    monkeypatch.setattr(
        tuning,
        "CANDIDATES",
        {
            "fwd": [C(4, 2), C(4, 3)],
            "bwd_dstate": [C(4, 1), C(4, 2)],
            "bwd_chunk": [C(4, 1), C(2, 1)],
            "bwd_angle": [C(4, 2), C(2, 1)],
        },
    )
    monkeypatch.setattr(lookup, "PLANS", lp.LaunchPlans())  # this test's: restored after
    monkeypatch.setattr(lp.launch_plans(), "arch_key", lambda device: "sm_untuned")
    plans = tmp_path / "scan_plans.json"
    monkeypatch.setenv(lp.PLANS_ENV, str(plans))
    on_cuda = {
        "train.device": "cuda",
        "train.precision": "bf16",
        "train.compile": "false",
        "supervisor.tune_scan": "true",
    }
    cfg = load_config(DEMO_CONFIG, tiny_run_overrides(corpus, **on_cuda))
    blocker = tmp_path / "a-file"  # a plans file under a file cannot be written
    blocker.write_text("")
    monkeypatch.setenv(lp.PLANS_ENV, str(blocker / "scan_plans.json"))
    unstored = run_smoke(cfg, echo=None)
    assert unstored.ok, unstored.failed_check_message
    assert "but cannot write the tuned launch plans" in unstored.checks[2].message
    assert "no tuned launch plan" in unstored.checks[3].message
    monkeypatch.setenv(lp.PLANS_ENV, str(plans))
    lines: list[str] = []
    first = run_smoke(cfg, echo=lines.append)
    assert first.ok, first.failed_check_message
    check3 = first.checks[2].message
    assert "launch plans tuned for this GPU" in check3 and str(plans) in check3, check3
    assert any("tuning one at" in line for line in lines), lines
    assert "`m3run tune-scan CONFIG` also tries chunks" in check3, check3
    stored = json.loads(plans.read_text())["plans"]["sm_untuned"]
    # At the one chunk the defaults run, not the three `m3run tune-scan` tries.
    assert {e["chunk"] for e in stored.values()} == {lp.untuned_plan(cfg.model.chunk_size).chunk}
    assert "tuned on this machine" in first.checks[3].message
    second = run_smoke(cfg, echo=None)
    assert second.ok and "tuned for this GPU" not in second.checks[2].message


@pytest.fixture(scope="module")
def small_splits(corpus, tmp_path_factory):
    """Splits of a few hundred tokens with the corpus's tokenizer: too small for a batch of
    4 windows of 65 tokens."""
    from m3run.runner.data.prepare import prepare_data

    text = tmp_path_factory.mktemp("small") / "small.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 12, encoding="utf-8")
    out = text.parent / "data"
    prepare_data(
        [str(text)],
        out,
        tokenizer=str(corpus / "tokenizer.json"),
        val_fraction=0.5,
        val_split="tail",
        progress=False,
    )
    return out


def test_a_val_split_too_small_for_one_eval_batch_fails_the_data_check(corpus, small_splits):
    """Found by the smoke test (exit 78 with the fix), not at the run's first eval."""
    cfg = load_config(
        DEMO_CONFIG,
        tiny_run_overrides(
            corpus, **{"data.val_path": str(small_splits / "val"), "eval.interval_steps": 10}
        ),
    )
    result = run_smoke(cfg, echo=None)
    msg = result.failed_check_message
    assert msg.startswith("check 2 (data readable) failed"), msg
    assert "one eval batch needs 4" in msg and "val_fraction" in msg, msg
    # With evaluation off the same split is no obstacle.
    cfg = load_config(
        DEMO_CONFIG, tiny_run_overrides(corpus, **{"data.val_path": str(small_splits / "val")})
    )
    assert run_smoke(cfg, echo=None).checks[1].status == "ok"


def test_training_data_too_small_for_one_batch_fails_the_data_check(corpus, small_splits):
    cfg = load_config(
        DEMO_CONFIG, tiny_run_overrides(corpus, **{"data.train_path": str(small_splits / "train")})
    )
    result = run_smoke(cfg, echo=None)
    msg = result.failed_check_message
    assert msg.startswith("check 2 (data readable) failed"), msg
    assert "train.micro_batch_size=4 needs 4" in msg and "prepare more data" in msg, msg
