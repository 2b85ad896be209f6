"""Launch-plan edits for the benchmarks: time our scan kernels under their table's plan with a
few fields changed (``bwd_chunk.hpp=2``), without touching the checked-in table.

Used by bench_scan_gpu.py (the scan alone, beside the official kernel) and bench_train.py (the
434m step), so that a candidate is timed where the bar is measured before it goes into
kernels/mamba3/launch_table.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib

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
    is a config override (``train.compile_mode``), or, starting with ``@``, a code switch for
    :func:`switched` (``@m3run.kernels.swiglu.BLOCK=2048``), else an error."""
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


def parse_switch(item: str) -> tuple[object, str, int]:
    """``@MODULE.ATTR=INT`` or ``@MODULE.CLASS.ATTR=INT`` → (owner, attribute, value): one of the
    code's module or class constants (``@m3run.kernels.swiglu.BLOCK=2048``) or a library's option
    (``@torch._inductor.config.triton.mix_order_reduction_split_size=64``), checked to exist
    and to hold an int, a bool or None (an option left to the library)."""
    path, _, value = item[1:].partition("=")
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:-1]:
            owner = getattr(owner, name, None)
        attr = parts[-1]
        known = owner is not None and hasattr(owner, attr)
        known = known and (getattr(owner, attr) is None or isinstance(getattr(owner, attr), int))
        if known and value.lstrip("-").isdigit():
            return owner, attr, int(value)
        break
    raise SystemExit(
        f"--variant switch {item!r}: give @MODULE[.CLASS].ATTR=INT naming an int, bool or "
        "unset (None) constant of the code or option of a library"
    )


@contextlib.contextmanager
def switched(items: list[str]):
    """Within: each ``@MODULE[.CLASS].ATTR=INT`` of ``items`` set (a bool constant to the int's
    truth), restored after."""
    saved = []
    try:
        for item in items:
            owner, attr, value = parse_switch(item)
            old = getattr(owner, attr)
            saved.append((owner, attr, old))
            setattr(owner, attr, bool(value) if isinstance(old, bool) else value)
        yield
    finally:
        for owner, attr, old in reversed(saved):
            setattr(owner, attr, old)
