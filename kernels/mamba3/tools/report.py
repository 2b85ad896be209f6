"""Compile the scan's kernels for a GPU architecture without a GPU and report their resources.

The forward and backward launchers run on ``meta`` tensors with a recorder in place of the
launches (:func:`m3run.kernels.mamba3.launching.set_recorder`), so every kernel is compiled with
exactly the arguments, constexprs and launch configuration a real call would use. ``ptxas -v``
(the one bundled with Triton) then gives registers, spills and stack per thread; Triton gives the
shared memory. Used by tests/kernels (sm_80 fit) and bench/tune_scan.py; ``python -m
m3run.kernels.mamba3.tools.report`` prints it for the defaults and every table entry.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import launching
from .. import plans as lp
from .precompile import Launch

# Per-architecture limits a launch must fit (CUDA programming guide, compute capabilities).
SMEM_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}  # opt-in bytes per block
REGS_PER_SM = 65536
MAX_REGS_PER_THREAD = 255

_TYPES = {
    torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
    torch.int64: "i64", torch.int32: "i32", torch.uint8: "u8", torch.bool: "i1",
}  # fmt: skip


@dataclass(frozen=True)
class KernelReport:
    kernel: str
    arch: int
    cfg: lp.LaunchConfig
    registers: int
    spill_stores: int
    spill_loads: int
    stack: int
    shared: int

    @property
    def threads(self) -> int:
        return 32 * self.cfg.num_warps

    def fit_error(self) -> str | None:
        """Why this compiled kernel cannot launch on the architecture (None when it can)."""
        smem = SMEM_LIMIT.get(self.arch, 101376)
        if self.shared > smem:
            return f"{self.kernel}: {self.shared} B shared memory > sm_{self.arch}'s {smem} B"
        if self.registers > MAX_REGS_PER_THREAD:
            return f"{self.kernel}: {self.registers} registers > {MAX_REGS_PER_THREAD}"
        if self.registers * self.threads > REGS_PER_SM:
            return (
                f"{self.kernel}: {self.registers} registers × {self.threads} threads > "
                f"{REGS_PER_SM} per SM"
            )
        return None

    def line(self) -> str:
        c = self.cfg
        return (
            f"sm_{self.arch} {self.kernel:9} warps {c.num_warps} stages {c.num_stages} maxnreg "
            f"{c.maxnreg or '-'}: {self.registers} regs, spills {self.spill_stores} B st / "
            f"{self.spill_loads} B ld, stack {self.stack} B, smem {self.shared} B"
        )


def _ptxas(ptx: str, arch: int) -> dict[str, int]:
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(arch).path
    sm = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        # The PTX targets the architecture it was generated for; ptxas takes it as it is.
        src.write_text(ptx)
        out = subprocess.run(
            [ptxas, "-v", f"--gpu-name={sm}", str(src), "-o", str(Path(tmp) / "k.o")],
            capture_output=True,
            text=True,
            check=True,
        ).stderr

    def num(pattern: str) -> int:
        m = re.search(pattern, out)
        return int(m.group(1)) if m else 0

    return {
        "registers": num(r"Used (\d+) registers"),
        "spill_stores": num(r"(\d+) bytes spill stores"),
        "spill_loads": num(r"(\d+) bytes spill loads"),
        "stack": num(r"(\d+) bytes stack frame"),
    }


def compile_kernel(kernel, args: tuple, constexprs: dict, cfg: lp.LaunchConfig, arch: int):
    """Compile one launch for ``sm_<arch>``; returns Triton's compiled kernel (PTX, metadata)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    signature, consts, attrs = {}, dict(constexprs), {}
    for i, (name, val) in enumerate(zip(names, args, strict=False)):
        if isinstance(val, torch.Tensor):
            signature[name] = "*" + _TYPES[val.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif val is None:  # an absent optional pointer, compiled out (``is None`` in the kernel)
            signature[name] = "constexpr"
            consts[name] = None
        elif isinstance(val, bool):
            signature[name] = "i1"
        elif isinstance(val, int):
            dont = name in kernel.do_not_specialize or names.index(name) in kernel.do_not_specialize
            if val == 1 and not dont:
                signature[name] = "constexpr"
                consts[name] = 1
                continue
            signature[name] = "i32" if -(2**31) <= val < 2**31 else "i64"
            if val % 16 == 0 and not dont:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            raise TypeError(f"argument {name} of {kernel.__name__}: {type(val).__name__}")
    for name in constexprs:
        signature[name] = "constexpr"
    src = ASTSource(kernel, signature, constexprs=consts, attrs=attrs)
    opts = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if cfg.maxnreg is not None:
        opts["maxnreg"] = cfg.maxnreg
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)


def record_launches(
    b=2,
    t=256,
    h=4,
    p=64,
    n=64,
    s=16,
    g=1,
    chunk_size=64,
    dtype=torch.bfloat16,
    cfgs: dict[str, lp.LaunchConfig] | None = None,
    per_head_qk: bool = False,
):
    """Run the forward and backward launchers on meta tensors; returns every launch they make
    (:class:`~m3run.kernels.mamba3.tools.precompile.Launch`), with d, z, an initial state and resets
    present (the largest variant of each kernel); q, k in g groups, or with ``per_head_qk`` one
    a head."""
    g = h if per_head_qk else g
    from ..triton_bwd import siso_bwd
    from ..triton_fwd import siso_fwd

    cfgs = dict(cfgs or lp.DEFAULT_CONFIGS)
    m = dict(device="meta")
    q, k = (torch.empty(b, t, g, n, dtype=dtype, **m) for _ in range(2))
    v, z, dy = (torch.empty(b, t, h, p, dtype=dtype, **m) for _ in range(3))
    adt, dt, trap = (torch.empty(b, h, t, **m) for _ in range(3))
    q_bias, k_bias = torch.empty(h, n, **m), torch.empty(h, n, **m)
    angles = torch.empty(b, t, 1, s, **m)  # one set for every head, as the model passes them
    d = torch.empty(h, **m)
    phi0, g0 = torch.empty(b, h, s, **m), torch.empty(b, h, p, n, **m)
    nc = -(-t // chunk_size)
    seg = torch.empty(b, nc * chunk_size, dtype=torch.int32, **m)
    launches: list[Launch] = []
    launching.set_recorder(lambda *launch: launches.append(Launch(*launch)))
    try:
        _, _, _, g_in, phi_in = siso_fwd(
            q,
            k,
            v,
            z,
            adt,
            dt,
            trap,
            q_bias,
            k_bias,
            angles,
            d,
            phi0,
            g0,
            seg,
            chunk_size,
            True,
            cfgs["fwd"],
        )
        dg_t, dphi_t = torch.empty(b, h, p, n, **m), torch.empty(b, h, s, **m)
        siso_bwd(
            q,
            k,
            v,
            z,
            adt,
            dt,
            trap,
            q_bias,
            k_bias,
            angles,
            d,
            seg,
            g_in,
            phi_in,
            dy,
            dg_t,
            dphi_t,
            chunk_size,
            cfgs,
        )
    finally:
        launching.set_recorder(None)
    return launches


def report(arch: int, plan: lp.Plan, **shape) -> list[KernelReport]:
    """Compile every kernel of one forward+backward under ``plan`` for ``sm_<arch>``; one report
    per kernel, and one more of the chunk kernel with q, k per head (``bwd_chunk/h``: it then
    forms the bias partials itself, the head sum's work with grouped q, k)."""
    out = []
    launches = record_launches(cfgs=plan.configs, chunk_size=plan.chunk, **shape)
    launches += [
        dataclasses.replace(launch, name=f"{launch.name}/h")
        for launch in record_launches(
            cfgs=plan.configs, chunk_size=plan.chunk, per_head_qk=True, **shape
        )
        if launch.name == "bwd_chunk"
    ]
    for launch in launches:
        ck = compile_kernel(launch.kernel, launch.args, launch.constexprs, launch.cfg, arch)
        res = _ptxas(ck.asm["ptx"], arch)
        out.append(KernelReport(launch.name, arch, launch.cfg, shared=ck.metadata.shared, **res))
    return out


def table_plans() -> list[tuple[str, dict, lp.Plan]]:
    """The defaults (at DEFAULT_CHUNK) and each distinct plan
    of the launch table, as (name, shape, plan) with the shape arguments of :func:`report`."""
    from ..plans.table import TABLE

    bench = dict(p=64, n=64, dtype=torch.bfloat16)
    defaults = dict(lp.DEFAULT_CONFIGS)
    out = [("defaults", bench, lp.Plan(lp.DEFAULT_CHUNK, defaults))]
    seen = set()
    for arch, keys in sorted(TABLE.items()):
        for key, entry in sorted(keys.items()):
            _, p, n, dtype = key.split("-")
            configs = lp.entry_configs(entry)
            plan = lp.Plan(int(entry.get("chunk", 64)), configs)
            shape = dict(p=int(p[1:]), n=int(n[1:]), dtype=lp.DOT_DTYPES[dtype])
            ident = (plan.chunk, tuple(sorted(configs.items())), p, n, dtype)
            if ident not in seen:
                seen.add(ident)
                out.append((f"{arch} {key} (chunk {plan.chunk})", shape, plan))
    return out


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="registers, spills and shared memory per kernel")
    ap.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    a = ap.parse_args()
    for name, shape, plan in table_plans():
        for arch in a.arch:
            for r in report(arch, plan, **shape):
                print(f"{name}: {r.line()}")


if __name__ == "__main__":
    main()
