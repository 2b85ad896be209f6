"""The Triton scan kernels without a GPU: run in the Triton interpreter on small shapes against the
PyTorch chunked reference, and compiled offline for sm_80 and sm_90 at the benchmark tile
shape with every configuration of the checked-in launch table and the defaults, which must fit
the architecture's shared memory and registers. The SwiGLU operator's and the
cross-entropy kernels run in the interpreter too. All need Triton installed (not a GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from m3run.kernels.mamba3.tools import report as resource_report

HERE = Path(__file__).resolve().parent


# The interpreter runs (each a process: TRITON_INTERPRET must be set before Triton loads), by
# name: (arguments, extra environment).
RUNS = {
    "fp32": ((), {}),
    "bf16-1024": (("--bf16", "1024"), {"M3RUN_SCAN_EMULATE_BF16": "1"}),
    "bf16-2048": (("--bf16", "2048"), {"M3RUN_SCAN_EMULATE_BF16": "1"}),
}
SCRIPTS = {  # a script each
    "opcheck": "opcheck_scan.py",
    "swiglu": "interpret_swiglu.py",
    "cross_entropy": "interpret_cross_entropy.py",
    "add_rms_norm": "interpret_add_rms_norm.py",
    "tune": "interpret_tune.py",
}


@pytest.fixture(scope="module")
def interpreted():
    """Every interpreter run, started at once (they are single-threaded: on a 2-core machine the
    three take the time of the longest, not their sum); maps a name to its process."""
    runs = {name: ("interpret_scan.py", args, env) for name, (args, env) in RUNS.items()}
    runs |= {name: (script, (), {}) for name, script in SCRIPTS.items()}
    procs = {
        name: subprocess.Popen(
            [sys.executable, str(HERE / script), *args],
            env=dict(os.environ, TRITON_INTERPRET="1", **env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, (script, args, env) in runs.items()
    }
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def _worst(procs: dict, name: str) -> dict[str, float]:
    """The largest relative error per output and gradient that run ``name`` printed."""
    out, err = procs[name].communicate(timeout=900)
    assert procs[name].returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("arch", [80, 90])
def test_every_launch_configuration_fits_the_architecture(interpreted, arch):
    """Offline compile (no GPU): the defaults and each table entry, at its shape, fit sm_80's and
    sm_90's shared memory and registers; the spills are printed (pytest -s) for the record. (It
    takes ``interpreted`` so that the interpreter runs go on beside the compiles.)"""
    errors = []
    for name, shape, plan in resource_report.table_plans():
        for rep in resource_report.report(arch, plan, **shape):
            print(f"{name}: {rep.line()}")
            err = rep.fit_error()
            if err:
                errors.append(f"{name}: {err}")
    assert not errors, errors


def test_the_tuning_script_writes_the_table_as_it_is_checked_in(tmp_path, monkeypatch):
    """bench/kernels/tune_scan.py renders the checked-in launch table byte for byte (so what it
    writes is what `ruff format --check` accepts), and an entry it merges reads back beside the
    others."""
    monkeypatch.syspath_prepend(str(HERE.parents[1] / "bench" / "kernels"))
    import tune_scan

    table_file = HERE.parents[1] / "kernels" / "mamba3" / "plans" / "table.py"
    src = table_file.read_text()
    doc, table = tune_scan.read_table(src)
    assert table and tune_scan.render_table(doc, table) == src
    copy = tmp_path / "table.py"
    copy.write_text(src)
    entry = {"chunk": 32, "fwd": {"bv": 0, "maxnreg": None, "num_stages": 2, "num_warps": 4}}
    tune_scan.write_table(copy, "sm80", "c32-p64-n64-bf16", entry)
    doc2, merged = tune_scan.read_table(copy.read_text())
    assert doc2 == doc and merged["sm80"] == {"c32-p64-n64-bf16": entry}
    assert {k: v for k, v in merged.items() if k != "sm80"} == table


def test_the_tuner_keeps_a_candidate_and_the_plan_leaves_the_function_as_it_is(interpreted):
    """kernels/mamba3/tools/tuning.py in the interpreter, timed by the wall clock: it keeps one of
    the candidates of each kernel, the plans file stores and reads it back, and the scan under it
    equals the scan under the defaults (interpret_tune.py asserts each)."""
    _ran_ok(interpreted, "tune")


def test_the_default_plans_log_outside_a_compiled_trace_without_breaking_it(monkeypatch, caplog):
    """A shape or GPU missing from the table runs the defaults, logged once; the log must not
    come from torch.compile's trace of the scan's caller (a log call breaks a block's one graph
    into several), but from the first call that runs."""
    import torch

    from m3run.kernels.mamba3 import plans as lp
    from m3run.kernels.mamba3.plans import lookup

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(lookup, "PLANS", lp.LaunchPlans())  # nothing logged yet
    monkeypatch.setattr(lp.launch_plans(), "arch_key", lambda device: "sm_none")  # not tuned

    def scaled(x):
        return x * lp.plan_for(torch.device("cuda"), 64, 64, 64, torch.bfloat16).chunk

    caplog.set_level("INFO", logger=lookup.__name__)
    torch._dynamo.reset()
    try:  # fullgraph: a graph break raises
        out = torch.compile(scaled, backend="eager", fullgraph=True)(torch.ones(2))
    finally:
        torch._dynamo.reset()
    assert out.tolist() == [lp.DEFAULT_CHUNK] * 2 and "no tuned launch plan" not in caplog.text
    for _ in range(2):
        assert lp.plan_for(torch.device("cuda"), 64, 64, 64, torch.bfloat16).chunk == 32
    assert caplog.text.count("no tuned launch plan for sm_none c64-p64-n64-bf16") == 1


def test_kernels_in_the_interpreter_match_the_reference(interpreted):
    worst = _worst(interpreted, "fp32")
    bad = {k: v for k, v in worst.items() if not v <= 1e-5}
    assert not bad, f"fp32 interpreter run over 1e-5: {bad}; all: {worst}"


@pytest.mark.parametrize("t", [1024, 2048])
def test_bf16_accuracy_at_long_sequences(interpreted, t):
    """The accuracy bar at long sequences, on the CPU: with every dot operand rounded to bf16 as
    on a GPU (the emulation reproduces a GPU's errors), every input gradient within 1e-2 of
    float64 and the angles' within 4e-2, at t = 1024 and 2048."""
    worst = _worst(interpreted, f"bf16-{t}")
    bounds = {"dangles": 4e-2}
    bad = {k: v for k, v in worst.items() if not v <= bounds.get(k, 1e-2)}
    assert not bad, f"over bound at t={t}: {bad}; all: {worst}"


def test_the_custom_operators_compile_as_they_run_eagerly(interpreted):
    """torch.compile (fullgraph) through the scan's forward and backward operators gives the
    eager results bitwise, and opcheck passes their schemas and fake implementations."""
    _ran_ok(interpreted, "opcheck")


def test_the_swiglu_operator_matches_the_plain_module(interpreted):
    """The fused SwiGLU operator's output and both gradients equal the plain module's formula
    (fp32 against float64), compiled as eagerly, and opcheck passes both operators."""
    _ran_ok(interpreted, "swiglu")


def test_the_cross_entropy_kernel_matches_the_pytorch_loss(interpreted):
    """The cross-entropy kernel in the chunked loss (interpret_cross_entropy.py): the loss and
    both gradients against the PyTorch form in float64, with ignored targets and padding
    columns; ignored rows get nothing; compiled as eagerly; opcheck passes the operator."""
    _ran_ok(interpreted, "cross_entropy")


def test_the_add_rms_norm_operator_matches_the_plain_formula(interpreted):
    """The residual add + RMSNorm operator (interpret_add_rms_norm.py): both outputs and the
    three gradients against the plain formula in float64, with a width and rows that end
    inside the kernel's blocks; two backward calls bitwise equal; compiled as eagerly; opcheck
    passes the backward operator."""
    _ran_ok(interpreted, "add_rms_norm")


def _ran_ok(procs: dict, name: str) -> None:
    out, err = procs[name].communicate(timeout=900)
    assert procs[name].returncode == 0, err[-3000:]
    assert out.strip().splitlines()[-1] == "ok"
