"""The Triton scan kernels without a GPU: run in the Triton interpreter on small shapes against the
PyTorch chunked reference, and compiled offline for sm_80 (A100) and sm_90 at the benchmark tile
shape with every configuration of the checked-in launch table and the defaults, which must fit
the architecture's shared memory and registers. Both need Triton installed (not a GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from kernels.mamba3 import triton_common as tc
from kernels.mamba3 import triton_report
from kernels.mamba3.launch_table import TABLE

HERE = Path(__file__).resolve().parent


def test_kernels_in_the_interpreter_match_the_reference():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run(
        [sys.executable, str(HERE / "interpret_scan.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    worst = json.loads(out.stdout.strip().splitlines()[-1])
    bad = {k: v for k, v in worst.items() if not v <= 1e-5}
    assert not bad, f"fp32 interpreter run over 1e-5: {bad}; all: {worst}"


def _plans() -> list[tuple[str, str, tc.Plan]]:
    """The defaults at chunk 64 and every table entry at its chunk, with the shape key."""
    plans = [("defaults", "c64-p64-n64-bf16", tc.Plan(64, dict(tc.DEFAULT_CONFIGS)))]
    for arch, keys in TABLE.items():
        for key, entry in keys.items():
            configs = {name: tc.LaunchConfig(**entry[name]) if name in entry else
                       tc.DEFAULT_CONFIGS[name] for name in tc.KERNELS}  # fmt: skip
            plans.append((f"{arch} {key}", key, tc.Plan(int(entry.get("chunk", 64)), configs)))
    return plans


def _shape(key: str) -> dict:
    _, p, n, dtype = key.split("-")
    dtypes = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
    import torch

    return dict(p=int(p[1:]), n=int(n[1:]), dtype=getattr(torch, dtypes[dtype]))


@pytest.mark.parametrize("arch", [80, 90])
def test_every_launch_configuration_fits_the_architecture(arch):
    """Offline compile (no GPU): the defaults and each table entry, at its shape, fit sm_80's and
    sm_90's shared memory and registers; the spills are printed (pytest -s) for the record."""
    errors = []
    for name, key, plan in _plans():
        for rep in triton_report.report(arch, cfgs=plan.configs, chunk_size=plan.chunk,
                                        **_shape(key)):  # fmt: skip
            print(f"{name}: {rep.line()}")
            err = rep.fit_error()
            if err:
                errors.append(f"{name}: {err}")
    assert not errors, errors
