"""Where the scan's launch plans come from, without a GPU: this machine's tuned plans
(kernels/mamba3/plans/local.py, written by `m3run tune-scan`) before the checked-in table, the
table before the defaults; a plans file tuned on other kernels, unreadable or holding an entry
that makes no plan is ignored with a warning that names the fix, never a crash. And the command
itself refuses a machine it cannot tune on with exit 78 and a message."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from typer.testing import CliRunner

from m3run.kernels.mamba3 import plans as lp
from m3run.kernels.mamba3 import triton_common as tc
from m3run.kernels.mamba3.plans import lookup
from m3run.kernels.mamba3.plans.table import TABLE
from m3run.runner.cli import app

CUDA = torch.device("cuda")  # a device object only: plan_for reads its type, arch_key is patched
ENTRY = {
    "chunk": 16,
    "fwd": {"num_warps": 8, "num_stages": 2, "maxnreg": None, "bv": 0},
    "bwd_chunk": {"num_warps": 4, "num_stages": 1, "maxnreg": 168, "bv": 0, "hpp": 2},
}


@pytest.fixture
def plans(tmp_path, monkeypatch):
    """A plans file of this test's own, on an architecture the test names, and launch plans of
    the test's own (nothing read or logged yet; the process's are put back after)."""
    path = tmp_path / "cache" / "scan_plans.json"
    monkeypatch.setenv(lp.PLANS_ENV, str(path))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(lookup, "PLANS", lp.LaunchPlans())
    return path


def _local() -> lp.LocalPlans:
    return lp.launch_plans().local


def _plan(arch: str, monkeypatch, chunk: int = 64) -> lp.Plan:
    monkeypatch.setattr(lp.launch_plans(), "arch_key", lambda device: arch)
    return lp.plan_for(CUDA, 64, 64, chunk, torch.bfloat16)


def test_a_plan_tuned_on_this_machine_runs_and_serves_every_caller_chunk(plans, monkeypatch):
    keys = [lp.shape_key(tc.Tiles.of(64, 64, c), torch.bfloat16) for c in tc.CHUNK_SIZES]
    assert _local().store("sm80", keys, ENTRY, {"gpu": "A100"}) == plans
    for chunk in tc.CHUNK_SIZES:
        plan = _plan("sm80", monkeypatch, chunk)
        assert plan.chunk == 16
        assert plan.configs["fwd"] == lp.LaunchConfig(8, 2)
        assert plan.configs["bwd_chunk"] == lp.LaunchConfig(4, 1, 168, hpp=2)
        assert plan.configs["bwd_angle"] == lp.DEFAULT_CONFIGS["bwd_angle"]  # not named: default
    assert "tuned on this machine" in lp.launch_plans().source(CUDA, 64, 64, 64, torch.bfloat16)
    doc = json.loads(plans.read_text())
    assert doc["fingerprint"] == lp.fingerprint()
    assert doc["tuned"]["sm80"][keys[0]] == {"gpu": "A100"}


def test_this_machines_plan_comes_before_the_checked_in_table(plans, monkeypatch):
    arch, key = next((a, k) for a in TABLE for k in TABLE[a])
    chunk = int(key.split("-")[0][1:])
    table = TABLE[arch][key]
    assert _plan(arch, monkeypatch, chunk) == lp.Plan(table["chunk"], lp.entry_configs(table))
    assert "checked-in" in lp.launch_plans().source(CUDA, 64, 64, chunk, torch.bfloat16)
    _local().store(arch, [key], ENTRY, {})
    assert _plan(arch, monkeypatch, chunk).configs["fwd"] == lp.LaunchConfig(8, 2)


def test_a_shapes_plan_is_looked_up_once_until_the_local_plans_are_read_again(plans, monkeypatch):
    """Every scan call asks for its plan (three times a forward and backward): the second ask
    gets the first's Plan without a lookup, and a plan stored meanwhile (the smoke test's tune,
    which reads the file again) applies from the next call."""
    first = _plan("sm80", monkeypatch)
    assert first == lp.untuned_plan(64)
    with monkeypatch.context() as m:
        m.setattr(lp.launch_plans(), "tuned", lambda *args: pytest.fail("looked up again"))
        assert _plan("sm80", monkeypatch) is first
    keys = [lp.shape_key(tc.Tiles.of(64, 64, 64), torch.bfloat16)]
    _local().store("sm80", keys, ENTRY, {"gpu": "A100"})  # reads the file again
    assert _plan("sm80", monkeypatch).configs["fwd"] == lp.LaunchConfig(8, 2)


def test_without_a_plan_the_defaults_run_and_the_warning_names_the_command(
    plans, monkeypatch, caplog
):
    caplog.set_level(logging.WARNING)
    plan = _plan("sm_untuned", monkeypatch)
    assert plan == lp.Plan(lp.DEFAULT_CHUNK, dict(lp.DEFAULT_CONFIGS))
    assert "m3run tune-scan CONFIG" in caplog.text and str(plans) in caplog.text
    source = lp.launch_plans().source(CUDA, 64, 64, 64, torch.bfloat16)
    assert source.startswith("no tuned launch plan for sm_untuned c64-p64-n64-bf16")


def test_plans_tuned_on_other_kernels_are_ignored_and_replaced_when_stored(
    plans, monkeypatch, caplog
):
    key = lp.shape_key(tc.Tiles.of(64, 64, 64), torch.bfloat16)
    _local().store("sm80", [key], ENTRY, {})
    doc = json.loads(plans.read_text())
    doc["fingerprint"] = "0" * 16  # as if the kernels changed since
    plans.write_text(json.dumps(doc))
    _local().reload()
    caplog.set_level(logging.WARNING)
    assert _plan("sm80", monkeypatch) == lp.Plan(lp.DEFAULT_CHUNK, dict(lp.DEFAULT_CONFIGS))
    assert "tuned on other kernels" in caplog.text and "m3run tune-scan" in caplog.text
    # A new tune writes a file of this fingerprint with its own entry only.
    other = lp.shape_key(tc.Tiles.of(64, 64, 32), torch.bfloat16)
    _local().store("sm80", [other], ENTRY, {})
    doc = json.loads(plans.read_text())
    assert doc["fingerprint"] == lp.fingerprint() and list(doc["plans"]["sm80"]) == [other]


@pytest.mark.parametrize(
    "content, why",
    [
        ("{not json", "cannot read it"),
        ('["a list"]', "not a plans file"),
    ],
)
def test_an_unreadable_plans_file_is_ignored_with_a_warning(
    plans, monkeypatch, caplog, content, why
):
    plans.parent.mkdir(parents=True)
    plans.write_text(content)
    caplog.set_level(logging.WARNING)
    _local().reload()
    assert _plan("sm80", monkeypatch).chunk == lp.DEFAULT_CHUNK
    assert why in caplog.text and str(plans) in caplog.text


def test_an_entry_that_makes_no_plan_is_skipped_for_the_next_source(plans, monkeypatch, caplog):
    key = lp.shape_key(tc.Tiles.of(64, 64, 64), torch.bfloat16)
    bad = {"chunk": 16, "fwd": {"num_warps": 3, "num_stages": 1}}  # no such warp count
    _local().store("sm80", [key], bad, {})
    caplog.set_level(logging.WARNING)
    assert _plan("sm80", monkeypatch) == lp.Plan(lp.DEFAULT_CHUNK, dict(lp.DEFAULT_CONFIGS))
    assert "not usable" in caplog.text and "num_warps=3" in caplog.text
    _local().store("sm80", [key], {"chunk": 48}, {})  # not a kernel chunk
    monkeypatch.setattr(lookup, "PLANS", lp.LaunchPlans())  # a process started after, logs fresh
    assert _plan("sm80", monkeypatch).chunk == lp.DEFAULT_CHUNK
    assert "chunk 48 is not one of" in caplog.text


def test_a_store_replaces_the_file_whole(plans):
    keys = [lp.shape_key(tc.Tiles.of(64, 64, 64), torch.bfloat16)]
    _local().store("sm80", keys, ENTRY, {})
    _local().store("sm86", keys, {"chunk": 32}, {})
    doc = json.loads(plans.read_text())
    assert set(doc["plans"]) == {"sm80", "sm86"} and doc["plans"]["sm80"][keys[0]] == ENTRY
    assert [p.name for p in plans.parent.iterdir()] == [plans.name]  # no temporary left


def test_the_default_plans_path_is_under_the_cache_home(monkeypatch, tmp_path):
    monkeypatch.delenv(lp.PLANS_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert lp.plans_path() == tmp_path / "m3run" / "scan_plans.json"


def test_tune_scan_without_a_gpu_exits_78_with_the_fix(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the command would tune")
    result = CliRunner().invoke(app, ["tune-scan", "configs/pretrain_a100_434m.yaml"])
    assert result.exit_code == 78, result.output
    assert "no CUDA GPU here" in result.output and "Fix:" in result.output
    assert "Traceback" not in result.output


def test_tune_scan_with_a_bad_config_exits_78(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  warmup_steps: 0\n")
    result = CliRunner().invoke(app, ["tune-scan", str(bad)])
    assert result.exit_code == 78, result.output
    assert "warmup_steps" in result.output and "Traceback" not in result.output


def test_torch_compile_traces_a_local_plan_without_a_graph_break(plans, monkeypatch):
    """The scan's caller reads the plan's chunk inside a compiled block (its segment ids): with
    this machine's plan in force the trace must still be one graph (fullgraph raises on a
    break), and give the chunk an eager call gives."""
    key = lp.shape_key(tc.Tiles.of(64, 64, 64), torch.bfloat16)
    _local().store("sm80", [key], ENTRY, {})
    monkeypatch.setattr(lp.launch_plans(), "arch_key", lambda device: "sm80")

    def scaled(x):
        return x * lp.plan_for(CUDA, 64, 64, 64, torch.bfloat16).chunk

    torch._dynamo.reset()
    try:
        compiled = torch.compile(scaled, backend="eager", fullgraph=True)
        out = compiled(torch.ones(2))
        # Eager calls keep the plan they looked up (the scan's operators, between compiled
        # calls); the compiled code's guards must not see that, or every block would compile
        # again at its next call.
        frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        assert lp.plan_for(CUDA, 64, 64, 64, torch.bfloat16).chunk == 16
        assert compiled(torch.ones(2)).tolist() == [16.0, 16.0]
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames
    finally:
        torch._dynamo.reset()
    assert out.tolist() == [16.0, 16.0]


def test_the_plans_file_is_read_at_the_first_lookup_not_when_the_kernels_are_imported(
    plans, monkeypatch
):
    """A warm spare imports the kernels while the smoke test, in another process, may still tune
    a plan: the plans are read at the spare's first lookup (after it is handed the run), so they
    include that plan; one stored by another process later applies from the next process on."""
    key = lp.shape_key(tc.Tiles.of(64, 64, 64), torch.bfloat16)
    assert lp.launch_plans().local._entries is None  # nothing read when made (at import)
    lp.LocalPlans(lp.entry_error).store("sm80", [key], ENTRY, {})  # the smoke test's process
    assert _plan("sm80", monkeypatch).chunk == 16
    lp.LocalPlans(lp.entry_error).store("sm80", [key], {"chunk": 64}, {})
    assert _plan("sm80", monkeypatch).chunk == 16  # read once a process


def test_a_first_lookup_inside_a_compiled_trace_reads_the_plans_without_a_graph_break(
    plans, monkeypatch
):
    """Where torch.compile traces the first lookup of the process (the scan's caller compiled
    before any eager call), the plans file is read as an eager lookup reads it, and the trace
    stays one graph (fullgraph raises on a break)."""
    key = lp.shape_key(tc.Tiles.of(64, 64, 64), torch.bfloat16)
    lp.LocalPlans(lp.entry_error).store("sm80", [key], ENTRY, {})
    monkeypatch.setattr(lp.launch_plans(), "arch_key", lambda device: "sm80")

    def scaled(x):
        return x * lp.plan_for(CUDA, 64, 64, 64, torch.bfloat16).chunk

    torch._dynamo.reset()
    try:
        out = torch.compile(scaled, backend="eager", fullgraph=True)(torch.ones(2))
    finally:
        torch._dynamo.reset()
    assert out.tolist() == [16.0, 16.0]
    assert lp.launch_plans().local._entries is not None
