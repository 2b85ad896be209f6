"""Run by test_triton_cpu.py in the Triton interpreter (TRITON_INTERPRET=1, set before Triton
loads): the launch-plan tuner (kernels/mamba3/tools/tuning.py) on a small shape with two
candidates a kernel, timed by the wall clock. A chunk the kernels do not take is refused. A
plans file that cannot be written is an error that names it and the fix, holding the plan; what
it keeps must be one of the candidates, stored in a plans file and read back, and a scan under
the tuned plan must give what it gives under the defaults (the plan changes launches, not the
function).
Prints "ok" at the end."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import interpret_scan  # noqa: F401  (the interpreter's patches, as for the scan's runs)
import torch

from m3run.kernels.mamba3 import plans as lp
from m3run.kernels.mamba3.tools import tuning

C = lp.LaunchConfig
CANDIDATES = {  # the second of each changes the launch's grid or flags: recorded afresh
    "fwd": [C(4, 2), C(2, 1, bv=16)],
    "bwd_dstate": [C(4, 1), C(2, 1, bv=16)],
    "bwd_chunk": [C(4, 1), C(2, 1, bv=16)],
    "bwd_angle": [C(4, 2), C(1, 1, hb=2)],
}


def wall_ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def outputs(x: dict, plan: lp.Plan) -> list[torch.Tensor]:
    with lp.launch_plans().forcing(plan):
        y = tuning._scan(x, plan.chunk)
        y.backward(torch.ones_like(y))
    out = [y.detach()] + [v.grad.clone() for v in x.values() if v.grad is not None]
    for v in x.values():
        v.grad = None
    return out


def main() -> None:
    shape = tuning.Shape(1, 64, 4, 32, 16, 4, 1, torch.float32, reset=True)
    try:  # a chunk the kernels do not take is an error, never silently dropped
        tuning.tune_shape(shape, torch.device("cpu"), chunks=[16, 48], timer=wall_ms)
    except ValueError as e:
        assert str(e) == "chunks must be among (16, 32, 64), got [16, 48]", e
    else:
        raise AssertionError("chunk 48 was tuned")
    lines: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        blocker = Path(tmp) / "a-file"  # a plans file under a file: it cannot be written
        blocker.write_text("")
        try:
            tuning.tune_and_store(
                shape,
                torch.device("cpu"),
                chunks=[16],
                log=lines.append,
                path=blocker / "plans.json",
                timer=wall_ms,
                candidates=CANDIDATES,
            )
        except tuning.PlansNotStored as e:
            tuned, message = e.tuned, str(e)
        else:
            raise AssertionError("a plans file under a file was written")
    assert message.startswith(f"cannot write the tuned launch plans to {blocker}"), message
    assert "M3RUN_SCAN_PLANS" in message
    entry = tuned.entry
    assert entry["chunk"] == 16, entry
    for name in lp.KERNELS:
        assert C(**entry[name]) in CANDIDATES[name], (name, entry[name])
    assert tuned.ms > 0 and tuned.baseline_ms > 0, tuned
    assert sum("best" in line for line in lines) == len(lp.KERNELS), lines

    with tempfile.TemporaryDirectory() as tmp:
        os.environ[lp.PLANS_ENV] = str(Path(tmp) / "plans.json")
        local = lp.launch_plans().local
        path = local.store("sm_test", shape.table_keys(), entry, {"gpu": "interpreter"})
        assert local.lookup("sm_test", shape.table_keys()[1]) == entry
        assert local.lookup("sm_other", shape.table_keys()[1]) is None
        assert list(Path(tmp).iterdir()) == [path]  # no temporary left beside it

    x = tuning.scan_inputs(shape, torch.device("cpu"))
    recorded = tuning.record(x, lp.Plan(16, dict(lp.DEFAULT_CONFIGS)))
    assert set(lp.KERNELS) <= set(recorded), sorted(recorded)  # the backward's launches too
    got = outputs(x, lp.Plan(16, lp.entry_configs(entry)))
    want = outputs(x, lp.Plan(16, dict(lp.DEFAULT_CONFIGS)))
    for a, b in zip(got, want, strict=True):
        err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
        assert err <= 1e-5, err
    print("ok")


if __name__ == "__main__":
    main()
