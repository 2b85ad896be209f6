"""Choose the Triton scan's launch plans on this GPU and write them into the checked-in table.

    python bench/kernels/tune_scan.py [--b 16 --t 2048 --h 32 --p 64 --n 64 --s 16 --g 1]
                              [--chunk 64 ...] [--only bwd_chunk ...] [--dtype bf16] [--no-reset]
                              [--out kernels/mamba3/plans/table.py]

The search is :mod:`m3run.kernels.mamba3.tools.tuning`'s (each kernel timed alone under each
candidate, at each chunk, on the scan called as the model calls it); ``--only`` tunes some kernels
and keeps the table's plan for the rest. The result is merged into the table file under this GPU's
architecture (``sm90`` …) and the tile-shape key of every caller chunk, so a worker reads it at
launch and never autotunes. The table is checked in; tests/kernels compiles every entry for sm_80
without a GPU. A user's GPU the table lacks is tuned by `m3run tune-scan`, into that machine's
plans.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import torch

from m3run.kernels.mamba3 import plans as lp
from m3run.kernels.mamba3 import triton_common as tc
from m3run.kernels.mamba3.tools import tuning


def _table_configs(arch: str, key: str) -> dict[str, lp.LaunchConfig]:
    """The checked-in table's configurations for this GPU and shape key, the defaults for any
    kernel it does not name."""
    from m3run.kernels.mamba3.plans.table import TABLE

    return lp.entry_configs(TABLE.get(arch, {}).get(key, {}))


def read_table(src: str) -> tuple[str, dict]:
    """The table module's docstring and TABLE."""
    tree = ast.parse(src)
    table = {}
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "TABLE":
            table = ast.literal_eval(node.value)
    return ast.get_docstring(tree, clean=False) or "", table


def render_table(doc: str, table: dict) -> str:
    """The table module's source, laid out as ruff format leaves it (sorted keys, one launch
    configuration a line), so a re-tuned table is checked in as written."""

    def value(v) -> str:
        return f'"{v}"' if isinstance(v, str) else repr(v)

    lines = [f'"""{doc}"""', "", "TABLE: dict[str, dict[str, dict[str, dict]]] = {"]
    for arch in sorted(table):
        lines.append(f'    "{arch}": {{')
        for key in sorted(table[arch]):
            lines.append(f'        "{key}": {{')
            for name, item in sorted(table[arch][key].items()):
                if isinstance(item, dict):
                    fields = ", ".join(f'"{k}": {value(v)}' for k, v in sorted(item.items()))
                    lines.append(f'            "{name}": {{{fields}}},')
                else:
                    lines.append(f'            "{name}": {value(item)},')
            lines.append("        },")
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines) + "\n"


def write_table(path: Path, arch: str, key: str, entry: dict) -> None:
    """Merge one (arch, key) entry into the table module, keeping its docstring."""
    doc, table = read_table(path.read_text())
    table.setdefault(arch, {})[key] = entry
    path.write_text(render_table(doc, table))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (
        ("b", 16),
        ("t", 2048),
        ("h", 32),
        ("p", 64),
        ("n", 64),
        ("s", 16),
        ("g", 1),
    ):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument(
        "--chunk",
        type=int,
        nargs="+",
        choices=tc.CHUNK_SIZES,
        default=list(tc.CHUNK_SIZES),
        help="chunks to try",
    )
    ap.add_argument(
        "--only",
        nargs="+",
        choices=lp.KERNELS,
        default=list(lp.KERNELS),
        help="tune these kernels; the others keep this GPU's table entry at each "
        "chunk (the defaults where it has none)",
    )
    ap.add_argument("--dtype", choices=sorted(lp.DOT_DTYPES), default="bf16")
    ap.add_argument(
        "--no-reset",
        action="store_true",
        help="no packed documents (by default a reset every 512 tokens, as the "
        "recipes train with data.reset_at_eos)",
    )
    ap.add_argument("--out", type=Path, default=Path("kernels/mamba3/plans/table.py"))
    a = ap.parse_args()

    dtype = lp.DOT_DTYPES[a.dtype]
    shape = tuning.Shape(a.b, a.t, a.h, a.p, a.n, a.s, a.g, dtype, reset=not a.no_reset)
    device = torch.device("cuda", torch.cuda.current_device())
    arch = lp.arch_key(device)
    print(f"tuning on {torch.cuda.get_device_name()} ({arch}), {shape.describe()}")

    def start_for(chunk: int) -> dict[str, lp.LaunchConfig]:
        return _table_configs(arch, lp.shape_key(tc.Tiles.of(a.p, a.n, chunk), dtype))

    tuned = tuning.tune_shape(shape, device, chunks=a.chunk, names=a.only, start_for=start_for)
    for key in shape.table_keys():
        write_table(a.out, arch, key, tuned.entry)
    print(f"{tuning.summary(tuned)}\nwrote {arch} {shape.describe()}: {tuned.entry} to {a.out}")


if __name__ == "__main__":
    main()
