"""Launch-plan edits for the benchmarks: time our scan kernels under their table's plan with a
few fields changed (``bwd_chunk.hpp=2``), without touching the checked-in table.

Used by bench_scan_gpu.py (the scan alone, beside the official kernel) and bench_train.py (the
434m step), so that a candidate is timed where the bar is measured before it goes into
kernels/mamba3/plans/table.py.
"""

from __future__ import annotations

import contextlib
import dataclasses

from m3run.kernels.mamba3 import plans as lp
from m3run.kernels.mamba3 import triton_siso

FIELDS = frozenset(f.name for f in dataclasses.fields(lp.LaunchConfig))


def is_plan_key(key: str) -> bool:
    """``KERNEL.FIELD`` with KERNEL one of the scan's kernels (a config key names a section)."""
    return key.partition(".")[0] in lp.KERNELS


def plan_edit(edits: dict[str, dict], item: str, spec: str, flag: str) -> None:
    """Add ``KERNEL.FIELD=VALUE`` (VALUE an integer or ``none``) to ``edits``, or exit naming
    the flag, the item and what it takes."""
    key, _, value = item.partition("=")
    kernel, _, field = key.partition(".")
    number = value == "none" or value.lstrip("-").isdigit()
    if kernel not in lp.KERNELS or field not in FIELDS or not number:
        raise SystemExit(
            f"{flag} {spec!r}: {item!r} is not KERNEL.FIELD=VALUE with KERNEL one of "
            f"{', '.join(lp.KERNELS)}, FIELD one of {', '.join(sorted(FIELDS))} and VALUE an "
            "integer or none"
        )
    edits.setdefault(kernel, {})[field] = None if value == "none" else int(value)


@contextlib.contextmanager
def edited_plan(edits: dict | None):
    """Within: our kernels launch under their plan with ``edits`` ({kernel: {field: value}})
    applied, forward and backward alike (None: unchanged)."""
    if not edits:
        yield
        return
    plan_for = triton_siso.plan_for

    def edited(*args):
        plan = plan_for(*args)
        configs = dict(plan.configs)
        for kernel, fields in edits.items():
            configs[kernel] = dataclasses.replace(configs[kernel], **fields)
        return lp.Plan(plan.chunk, configs)

    triton_siso.plan_for = edited
    try:
        yield
    finally:
        triton_siso.plan_for = plan_for


def parse_variant(spec: str, config_keys: bool = False) -> tuple[str, list[str], dict]:
    """``NAME:KEY=VALUE,...`` → (NAME, config overrides, launch-plan edits). A KEY whose first
    part names a scan kernel (``bwd_chunk.hpp``) edits the plan; with ``config_keys`` any other
    is the caller's: a config override (``train.compile_mode``), or, starting with ``@``, an
    option bench_train.py passes to the Trainer (``@overlap=0``); without it, an error."""
    name, _, body = spec.partition(":")
    sets: list[str] = []
    edits: dict[str, dict] = {}
    for item in filter(None, body.split(",")):
        key, eq, _ = item.partition("=")
        if config_keys and not is_plan_key(key):
            if not eq:
                raise SystemExit(f"--variant {spec!r}: {item!r} is not KEY=VALUE")
            sets.append(item)
        else:
            plan_edit(edits, item, spec, "--variant")
    if not name or not (sets or edits):
        form = "KEY=VALUE" if config_keys else "KERNEL.FIELD=VALUE"
        raise SystemExit(f"--variant {spec!r}: give NAME:{form},...")
    return name, sets, edits
