"""Choose the Triton scan's launch configurations on this GPU and write them as the launch table.

    python bench/tune_scan.py [--b 16 --t 2048 --h 32 --p 64 --n 64 --s 16 --g 1]
                              [--chunk 64 ...] [--only bwd_chunk ...] [--dtype bf16]
                              [--out kernels/mamba3/launch_table.py] [--per-head-angles]

One forward+backward runs with every launch recorded (and executed); then each kernel is timed
alone, on the recorded arguments, under each candidate configuration (num_warps, num_stages,
ptxas maxnreg, the p block of the forward and the chunk kernel, the chunk kernel's heads and
chunks a program), and the fastest is kept; ``--only`` tunes some kernels and keeps the table's
plan for the rest. The result is merged into the table file under this GPU's architecture
(``sm90`` …) and the tile-shape key, so a worker reads it at launch and never autotunes. The
table is checked in; tests/kernels compiles every entry for sm_80 without a GPU. The angles are
one set for every head, as the model passes them, unless ``--per-head-angles``.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import torch

from kernels.mamba3 import mamba3_siso, triton_siso
from kernels.mamba3 import triton_common as tc

C = tc.LaunchConfig
CANDIDATES: dict[str, list[tc.LaunchConfig]] = {
    # bv 32: twice the sequential programs (b·h·2, one per p half), each with half the state
    # tile; slower than whole p on an earlier forward (docs/benchmarks.md), retried on this one.
    # wg 1: the wide products transposed (64 rows), warpgroup MMAs on sm_90. maxnreg 128: four
    # programs an SM instead of two, so b·h ≤ 528 sequential programs run in one wave on an
    # H200 (388 B of spills a thread at 3 stages, 368 B at 1; sm_90, ptxas).
    "fwd": [C(4, 2), C(4, 3), C(8, 2), C(4, 3, 168), C(4, 2, bv=32), C(4, 3, bv=32),
            C(2, 3, bv=32), C(4, 2, wg=1), C(4, 3, wg=1), C(4, 1, 128, wg=1),
            C(4, 2, 128, wg=1), C(4, 3, 128, wg=1)],
    # maxnreg 128 at bv 0: four programs an SM, so b·h ≤ 528 sequential programs run in one
    # wave on an H200 (no spills on sm_90 since the kernel only carries dG).
    "bwd_dstate": [C(4, 2), C(4, 1), C(8, 2), C(4, 2, bv=32), C(4, 3, bv=32), C(2, 2, bv=16),
                   C(4, 2, bv=16), C(4, 1, 128), C(4, 2, 128)],
    # maxnreg 168 / 128: three / four programs an SM instead of two (ncu: latency-bound at 12%
    # occupancy), for 196 / 472 B of spills a thread against none (sm_90, ptxas). hpp 2 / 4:
    # half / a quarter of the per-head dq, dk written and summed (timed with the head sum);
    # cpp with stages > 1: a chunk's loads under the work on the one before (cp.async). ptxas at
    # chunk 32, sm_90: 12 B of spills at 8 warps and hpp 2, 728 B at (4, 1, 168, hpp 2); 8 B at
    # (8, 2, cpp 2), 696 B at (4, 2, 168, cpp 2). wg 1: 100 B at (4, 1, 168), 172 B at
    # (8, 1, 128). 2 warps (255 registers, 404 B of spills, four programs an SM): half the
    # warps at each of the kernel's 124 barriers; faster than any 4-warp plan on an H200.
    "bwd_chunk": [C(2, 1), C(2, 1, 232), C(2, 1, bv=32), C(4, 1), C(8, 1), C(4, 1, 168),
                  C(4, 1, 128), C(8, 1, 128),
                  C(4, 1, 168, hpp=2), C(8, 1, hpp=2), C(8, 1, hpp=4), C(8, 2, hpp=2),
                  C(8, 2, cpp=2), C(8, 2, cpp=4), C(8, 3, cpp=4), C(4, 2, 168, cpp=2),
                  C(4, 1, 168, bv=32), C(4, 2, 168, bv=32), C(4, 1, 168, bv=16),
                  C(8, 1, 128, bv=32), C(4, 1, wg=1), C(4, 1, 168, wg=1), C(4, 1, 128, wg=1),
                  C(8, 1, 128, wg=1)],
    # hb: with shared angles, the heads in blocks, a program each (their sums added after,
    # timed with the kernel): more programs than the b·chunks that take every head in turn.
    "bwd_angle": [C(2, 1), C(4, 1), C(1, 1), C(2, 1, hb=4), C(4, 1, hb=2), C(4, 1, hb=4),
                  C(4, 1, hb=8), C(2, 1, hb=8), C(1, 1, hb=8)],
}  # fmt: skip

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# A kernel whose work depends on another's configuration, timed with it: the head sum adds
# what the chunk kernel's hpp leaves of a group's dq, dk (nothing at a whole group).
FOLLOWERS = {"bwd_chunk": "bwd_head_sum"}


def record(x: dict, plan: tc.Plan) -> dict[str, tuple]:
    """Every launch of one forward+backward under ``plan`` (executed, whatever the table says
    now), by kernel name, kept for re-timing: (kernel, grid, args, constexprs, config)."""
    launches = {}

    def rec(name, kern, grid, args, ce, cfg):
        kern[grid](*args, **ce, **cfg.launch_kwargs())
        launches[name] = (kern, grid, args, ce, cfg)

    leaves = {key: val.clone().requires_grad_() for key, val in x.items()}
    saved = triton_siso.plan_for
    triton_siso.plan_for = lambda *args: plan
    tc.set_recorder(rec)
    try:
        y = mamba3_siso(**leaves, chunk_size=plan.chunk, backend="triton")
        y.backward(torch.randn_like(y))
    finally:
        tc.set_recorder(None)
        triton_siso.plan_for = saved
    torch.cuda.synchronize()
    return launches


def tune(x: dict, chunk: int, names=tc.KERNELS, start: dict | None = None,
         log=print) -> tuple[float, dict[str, dict]]:  # fmt: skip
    """Time each kernel of ``names`` alone under each candidate at this chunk, the others under
    ``start`` (the defaults when None); returns the sum of the best times (ms) and {kernel: best
    config as a dict}. A candidate that changes a launch's grid, buffers or flags (a ``bv``,
    ``hpp``, ``cpp``, ``wg`` or ``hb`` other than the starting one's) is recorded afresh from a
    forward+backward under it;
    a kernel's follower (FOLLOWERS) is timed with it, and the angle kernel with its head
    blocks' sum."""
    import triton.testing

    start = dict(start or tc.DEFAULT_CONFIGS)
    base = record(x, tc.Plan(chunk, start))
    best, total = {}, 0.0
    for name in names:
        if name not in base:
            continue
        times = []
        for cfg in CANDIDATES[name]:
            try:
                default = start[name]
                launches = base
                fields = ("bv", "hpp", "cpp", "wg", "hb")
                if any(getattr(cfg, f) != getattr(default, f) for f in fields):
                    launches = record(x, tc.Plan(chunk, dict(start, **{name: cfg})))
                kern, grid, args, ce, _ = launches[name]
                follower = launches.get(FOLLOWERS.get(name, ""))

                # The angle kernel's head blocks (shared angles: head stride 0; hb > 1) are
                # summed after it.
                blocks = None
                if name == "bwd_angle":
                    arg = dict(zip(kern.arg_names, args, strict=False))
                    if arg["s_ah"] == 0 and arg["dth"].shape[2] > 1:
                        blocks = arg["dth"]

                def call(kern=kern, grid=grid, args=args, ce=ce, cfg=cfg, follower=follower,
                         blocks=blocks):  # fmt: skip
                    kern[grid](*args, **ce, **cfg.launch_kwargs())
                    if blocks is not None:
                        blocks.sum(2, keepdim=True)
                    if follower is not None:
                        f_kern, f_grid, f_args, f_ce, f_cfg = follower
                        f_kern[f_grid](*f_args, **f_ce, **f_cfg.launch_kwargs())

                ms = triton.testing.do_bench(call, warmup=10, rep=60, return_mode="median")
            except Exception as exc:  # a config that does not compile or launch here
                log(f"  {name} {cfg}: failed ({type(exc).__name__}: {str(exc)[:80]})")
                continue
            times.append((ms, cfg))
            with_follower = f" (with {FOLLOWERS[name]})" if follower is not None else ""
            log(f"  {name:9} {cfg.as_dict()}: {ms * 1e3:8.1f} us{with_follower}")
        ms, cfg = min(times, key=lambda mc: mc[0])
        log(f"{name}: best {cfg.as_dict()} {ms * 1e3:.1f} us")
        best[name] = cfg.as_dict()
        total += ms
    return total, best


def _table_configs(arch: str, key: str) -> dict[str, tc.LaunchConfig]:
    """The checked-in table's configurations for this GPU and shape key, the defaults for any
    kernel it does not name."""
    from kernels.mamba3.launch_table import TABLE

    return tc.entry_configs(TABLE.get(arch, {}).get(key, {}))


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
    for name, default in (("b", 16), ("t", 2048), ("h", 32), ("p", 64), ("n", 64), ("s", 16),
                          ("g", 1)):  # fmt: skip
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--chunk", type=int, nargs="+", default=[64, 32, 16], help="chunks to try")
    ap.add_argument("--only", nargs="+", choices=tc.KERNELS, default=list(tc.KERNELS),
                    help="tune these kernels; the others keep this GPU's table entry at each "
                    "chunk (the defaults where it has none)")  # fmt: skip
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    ap.add_argument("--per-head-angles", action="store_true",
                    help="(b, t, h, s) angles; by default one set for every head, as the model "
                    "passes them (the angle kernel then sums the heads' gradients)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=Path("kernels/mamba3/launch_table.py"))
    a = ap.parse_args()

    from bench_scan_gpu import make_inputs

    x = make_inputs(a.b, a.t, a.h, a.p, a.n, a.s, a.g, shared_angles=not a.per_head_angles)
    dtype = _DTYPES[a.dtype]
    for key in ("q", "k", "v", "z"):
        x[key] = x[key].to(dtype)
    arch = tc.arch_key(x["v"].device)
    angles = "per head" if a.per_head_angles else "shared"
    print(f"tuning on {torch.cuda.get_device_name()} ({arch}), b{a.b} t{a.t} h{a.h} p{a.p} "
          f"n{a.n} s{a.s} g{a.g} {a.dtype}, angles {angles}")  # fmt: skip
    results, starts = {}, {}
    for chunk in a.chunk:
        print(f"\nchunk {chunk}")
        starts[chunk] = _table_configs(arch, tc.shape_key(tc.Tiles.of(a.p, a.n, chunk), dtype))
        results[chunk] = tune(x, chunk, a.only, starts[chunk])
        print(f"chunk {chunk}: {results[chunk][0]:.3f} ms of the kernels tuned")
    chunk = min(results, key=lambda c: results[c][0])
    kept = {name: cfg.as_dict() for name, cfg in starts[chunk].items()}
    entry = {"chunk": chunk, **kept, **results[chunk][1]}
    # The kernels' chunk does not change the result beyond rounding: every caller chunk size
    # of this shape runs at the fastest one.
    for caller in tc.CHUNK_SIZES:
        key = tc.shape_key(tc.Tiles.of(a.p, a.n, caller), dtype)
        write_table(a.out, arch, key, entry)
    print(f"wrote {arch} p{a.p} n{a.n} {a.dtype}: chunk {chunk} {entry} to {a.out}")


if __name__ == "__main__":
    main()
