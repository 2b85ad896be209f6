"""Run the Triton scan kernels in the Triton interpreter (CPU) and print, as JSON, the largest
relative error of the output, final state and every input gradient against the PyTorch chunked
reference. Run as a script (TRITON_INTERPRET must be set before Triton loads):

    TRITON_INTERPRET=1 python tests/kernels/interpret_scan.py
        fp32, small shapes and several launch plans, against the fp32 reference
    TRITON_INTERPRET=1 M3RUN_SCAN_EMULATE_BF16=1 python tests/kernels/interpret_scan.py --bf16 T
        bf16-valued inputs, dot operands rounded to bf16 as on a GPU, at the benchmark's tile
        shape (p = n = 64, s = 16) and t = T, g = 1 (and g = h up to T = 1024), against float64
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def _numpy_scalar_index() -> None:
    """Triton 3.6's interpreter turns loop bounds into Python ints with ``int(array)``, which
    NumPy ≥ 2.4 refuses for 1-element arrays; read the one element instead."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).flat[0]))

    interpreter._patch_lang_tensor = patched


def _patch_lang_once_a_launch() -> None:
    """Triton 3.6's interpreter patches triton.language (an ``inspect.getmembers`` walk over it,
    its tensor and math) when a kernel launches, restores it when the grid is done, and patches
    it again on every call of a @triton.jit helper inside the kernel, though nothing has changed:
    nearly half the scan's interpreter time, for the same errors to the last bit. Inside a
    launch, a helper's call patches only where
    it sees a language module the launch has not patched yet (the library's own helpers see
    triton.language.core), as the interpreter would; anywhere else it patches as before."""
    import triton.language as tl
    from triton.runtime import interpreter

    patch, run_grid = interpreter._patch_lang, interpreter.GridExecutor.__call__
    langs_of: dict = {}
    launch: dict = {"patched": None}  # ids of the modules patched in the launch under way

    def patch_lang(fn):
        patched = launch["patched"]
        if patched is None:
            return patch(fn)
        langs = langs_of.get(fn)
        if langs is None:
            langs = langs_of[fn] = frozenset(
                id(v) for v in fn.__globals__.values() if v is tl or v is tl.core
            )
        if langs and langs <= patched:
            return interpreter._LangPatchScope()  # nothing changed, nothing to restore
        patched |= langs
        return patch(fn)

    def run_grid_patching_once(self, *args, **kwargs):
        launch["patched"] = set()
        try:
            return run_grid(self, *args, **kwargs)
        finally:
            launch["patched"] = None

    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = run_grid_patching_once


_numpy_scalar_index()
_patch_lang_once_a_launch()

from m3run.kernels.mamba3 import mamba3_siso, triton_siso  # noqa: E402
from m3run.kernels.mamba3 import plans as lp  # noqa: E402
from m3run.kernels.mamba3.triton_siso import mamba3_siso_triton  # noqa: E402

# ``kernel_chunk`` / ``fwd_bv`` / ``dstate_bv`` / ``chunk_hpp`` / ``chunk_cpp`` / ``chunk_bv`` /
# ``wg`` / ``angle_hb``: a launch plan other than the defaults (kernels at another chunk than the
# caller's; the forward or the backward's state kernel in blocks of p rows; its chunk kernel
# taking that many heads of a group, or chunks, in turn, or p in blocks; the forward's and the
# chunk kernel's wide products formed transposed; the angle kernel's heads in blocks).
# ``shared``: one set of angles for every head, (b, t, 1, s), as the model passes them.
# Lengths of no more chunks than a case needs (the interpreter runs every chunk of every head as
# a program in Python): the last one partial, and with resets or ``chunk_cpp`` three or four, a
# middle chunk between the first and the last, or a whole run of cpp chunks and a short one.
CASES = [
    dict(b=2, t=100, h=4, p=32, n=16, s=4, g=1, chunk=64, state=False, d=True, z=True),
    dict(b=2, t=100, h=4, p=32, n=16, s=4, g=1, chunk=64, state=True, d=True, z=True,
         chunk_hpp=2),
    dict(b=1, t=90, h=4, p=16, n=16, s=4, g=1, chunk=32, state=True, d=False, z=True,
         chunk_hpp=4, chunk_cpp=2),
    dict(b=2, t=50, h=2, p=32, n=16, s=4, g=2, chunk=16, state=True, d=True, z=True,
         chunk_cpp=3),
    dict(b=1, t=40, h=4, p=16, n=16, s=4, g=4, chunk=16, state=False, d=True, z=False,
         chunk_hpp=4),
    dict(b=1, t=90, h=5, p=32, n=16, s=4, g=1, chunk=64, state=True, d=True, z=True,
         kernel_chunk=32, dstate_bv=16),
    dict(b=2, t=70, h=4, p=16, n=16, s=4, g=4, chunk=32, state=True, d=True, z=True),
    dict(b=2, t=70, h=4, p=32, n=16, s=4, g=4, chunk=32, state=True, d=True, z=True,
         dstate_bv=16),
    dict(b=1, t=40, h=2, p=16, n=16, s=4, g=1, chunk=16, state=False, d=False, z=False),
    dict(b=1, t=37, h=2, p=24, n=20, s=3, g=1, chunk=16, state=False, d=False, z=True,
         dstate_bv=16),
    dict(b=1, t=64, h=2, p=16, n=16, s=8, g=2, chunk=32, state=False, d=True, z=False),
    # Resets: on a kernel-chunk boundary, inside chunks, two in one chunk, on token 0 with a
    # carried state; per batch row.
    dict(b=2, t=70, h=4, p=32, n=16, s=4, g=1, chunk=32, state=True, d=True, z=True,
         reset=((0, 32, 45, 47), (0, 5, 63, 64, 69))),
    dict(b=1, t=40, h=2, p=16, n=16, s=4, g=2, chunk=16, state=True, d=True, z=True,
         reset=((0, 1, 16, 33),), dstate_bv=16),
    # The launch plans with resets: a plan tiles heads and p, not batch rows, so one row with
    # every reset position of the two above.
    dict(b=1, t=70, h=4, p=32, n=16, s=4, g=1, chunk=32, state=True, d=True, z=True,
         reset=((0, 5, 32, 45, 47, 63, 64, 69),), chunk_hpp=2),
    dict(b=1, t=70, h=4, p=32, n=16, s=4, g=1, chunk=32, state=True, d=True, z=True,
         reset=((0, 5, 32, 45, 47, 63, 64, 69),), chunk_bv=16, fwd_bv=16),
    dict(b=1, t=37, h=2, p=24, n=20, s=3, g=1, chunk=16, state=False, d=False, z=True,
         chunk_bv=16, fwd_bv=16),
    dict(b=1, t=90, h=4, p=32, n=16, s=4, g=1, chunk=32, state=True, d=True, z=False,
         chunk_hpp=2, chunk_cpp=2, chunk_bv=16),
    dict(b=1, t=70, h=4, p=32, n=16, s=4, g=1, chunk=32, state=True, d=True, z=True, wg=1),
    dict(b=2, t=40, h=4, p=16, n=16, s=4, g=4, chunk=16, state=False, d=False, z=True,
         reset=((0, 1, 16, 33), (0, 20, 21)), wg=1),
    # Shared angles: every head in one angle program, and in two blocks of two.
    dict(b=2, t=70, h=4, p=16, n=16, s=4, g=1, chunk=32, state=True, d=True, z=True,
         shared=True),
    dict(b=2, t=70, h=4, p=16, n=16, s=4, g=1, chunk=32, state=True, d=True, z=True,
         shared=True, angle_hb=2, reset=((0, 33), (0, 5, 40))),
]  # fmt: skip


def inputs(b, t, h, p, n, s, g, d, z, gen, shared=False):
    def r(*shape):
        return torch.randn(*shape, generator=gen)

    dt = F.softplus(r(b, h, t) - 2.0)
    return dict(
        q=F.rms_norm(r(b, t, g, n), (n,)),
        k=F.rms_norm(r(b, t, g, n), (n,)),
        v=r(b, t, h, p),
        adt=torch.clamp(-F.softplus(r(b, h, t)), max=-1e-4) * dt,
        dt=dt,
        trap=r(b, h, t),
        q_bias=1 + 0.1 * r(h, n),
        k_bias=1 + 0.1 * r(h, n),
        angles=2 * r(b, t, 1 if shared else h, s),
        d=r(h) if d else None,
        z=r(b, t, h, p) if z else None,
    )


def run(fn, x, state, gy, g_state, chunk, reset=None):
    leaves = {k: v.clone().requires_grad_() for k, v in x.items() if v is not None}
    st = None if state is None else [a.clone().requires_grad_() for a in state]
    extra = {} if reset is None else {"reset": reset}
    y, fin = fn(
        **{k: leaves.get(k) for k in x},
        chunk_size=chunk,
        initial_state=st,
        return_final_state=True,
        **extra,
    )
    loss = (y * gy).sum() + sum((f * g).sum() for f, g in zip(fin, g_state, strict=True))
    names = list(leaves) + ([f"state{i}" for i in range(4)] if st else [])
    grads = torch.autograd.grad(loss, list(leaves.values()) + (st or []))
    return y, fin, dict(zip(names, grads, strict=True))


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def bf16_errors(t: int) -> dict[str, float]:
    """Worst errors of the emulated-bf16 kernels at length t, with g = 1 (the model's one B/C
    group) and, up to t = 1024, g = h too (the CUDA tests take both at every length)."""
    gen = torch.Generator().manual_seed(0)
    worst: dict[str, float] = {}
    for g in (1, 2) if t <= 1024 else (1,):
        x = inputs(1, t, 2, 64, 64, 16, g, d=True, z=True, gen=gen)
        for key in ("q", "k", "v", "z"):  # values a bf16 tensor holds, in fp32
            x[key] = x[key].to(torch.bfloat16).float()
        gy = torch.randn(1, t, 2, 64, generator=gen)

        def grads(fn, f64, x=x, gy=gy):
            leaves = {k: (v.double() if f64 else v).clone().requires_grad_() for k, v in x.items()}
            y = fn(**leaves, chunk_size=64)
            loss = (y.double() * gy.double()).sum() if f64 else (y * gy).sum()
            return y, dict(
                zip(leaves, torch.autograd.grad(loss, list(leaves.values())), strict=True)
            )

        y, gr = grads(mamba3_siso_triton, False)
        y_r, gr_r = grads(lambda **a: mamba3_siso(**a, backend="pytorch"), True)
        errs = {"y": rel(y, y_r), **{f"d{k}": rel(gr[k], gr_r[k]) for k in gr_r}}
        for k, v in errs.items():
            worst[k] = max(worst.get(k, 0.0), v)
    return worst


def main() -> None:
    if "--bf16" in sys.argv:
        assert os.environ.get("M3RUN_SCAN_EMULATE_BF16") == "1", "set M3RUN_SCAN_EMULATE_BF16=1"
        print(json.dumps(bf16_errors(int(sys.argv[sys.argv.index("--bf16") + 1]))))
        return
    gen = torch.Generator().manual_seed(0)
    worst: dict[str, float] = {}
    for case in CASES:
        c = dict(case)
        chunk, with_state = c.pop("chunk"), c.pop("state")
        plan = lp.Plan(c.pop("kernel_chunk", chunk), dict(lp.DEFAULT_CONFIGS))
        for kernel, key in (("fwd", "fwd_bv"), ("bwd_dstate", "dstate_bv")):
            if key in c:
                base = lp.DEFAULT_CONFIGS[kernel]
                plan.configs[kernel] = lp.LaunchConfig(
                    base.num_warps, base.num_stages, bv=c.pop(key)
                )
        if {"chunk_hpp", "chunk_cpp", "chunk_bv"} & c.keys():
            base = lp.DEFAULT_CONFIGS["bwd_chunk"]
            plan.configs["bwd_chunk"] = lp.LaunchConfig(
                base.num_warps,
                base.num_stages,
                bv=c.pop("chunk_bv", 0),
                hpp=c.pop("chunk_hpp", 1),
                cpp=c.pop("chunk_cpp", 1),
            )
        if "angle_hb" in c:
            plan.configs["bwd_angle"] = dataclasses.replace(
                plan.configs["bwd_angle"], hb=c.pop("angle_hb")
            )
        if c.pop("wg", 0):
            for kernel in ("fwd", "bwd_chunk"):
                plan.configs[kernel] = dataclasses.replace(plan.configs[kernel], wg=1)
        starts = c.pop("reset", None)
        triton_siso.plan_for = lambda *args, plan=plan: plan
        x = inputs(**c, gen=gen)
        b, t, h, p = x["v"].shape
        n, s = x["k"].shape[3], x["angles"].shape[3]
        gy = torch.randn(b, t, h, p, generator=gen)
        g_state = [
            torch.randn(*sh, generator=gen)
            for sh in ((b, h, s), (b, h, p, n), (b, h, n), (b, h, p))
        ]
        state = None
        if with_state:
            state = (
                2 * math.pi * torch.rand(b, h, s, generator=gen),
                torch.randn(b, h, p, n, generator=gen),
                torch.randn(b, h, n, generator=gen),
                torch.randn(b, h, p, generator=gen),
            )
        reset = None
        if starts is not None:
            reset = torch.zeros(b, t, dtype=torch.bool)
            for row, positions in enumerate(starts):
                reset[row, list(positions)] = True
        y, fin, grads = run(mamba3_siso_triton, x, state, gy, g_state, chunk, reset)
        ref = lambda **a: mamba3_siso(**a, backend="pytorch")  # noqa: E731
        y_r, fin_r, grads_r = run(ref, x, state, gy, g_state, chunk, reset)
        errs = {
            "y": rel(y, y_r),
            "ssm_state": rel(fin[1], fin_r[1]),
            "k_state": rel(fin[2], fin_r[2]),
        }
        errs.update({f"d{k}": rel(grads[k], grads_r[k]) for k in grads_r})
        for k, v in errs.items():
            worst[k] = max(worst.get(k, 0.0), v)
    print(json.dumps(worst))


if __name__ == "__main__":
    main()
