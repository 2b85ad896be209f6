"""Compile the scan's kernels before their first launch, all at once, on a pool of threads.

A Triton kernel compiles at its first launch, one after another, so the first training step
(the smoke test's, a restart's with empty compile caches) waits for every compile in turn
(docs/benchmarks.md has how long).
:func:`scan_launches` records every launch of the scan that a training step (the forward with
saves, the backward) and an evaluation (the forward without) make at the model's shapes: the
scan runs on meta tensors as the model calls it, its operators run their launchers under the
GPU's launch plan (:func:`triton_siso.recording_for`), and the launches go to a recorder instead
of the GPU, so nothing is computed. :func:`precompile` compiles each with Triton's ``warmup`` on
a pool of threads: ptxas and most of Triton's passes run without the GIL, so the compiles
overlap even on a few cores (docs/benchmarks.md).
A kernel compiled here is in the process's kernel cache and on disk (TRITON_CACHE_DIR), so its
first real launch finds it; one the warmup missed compiles at its launch, as before. A scan
launched while the compile runs waits for it (``launching.launch``) rather than compiling its
kernels a second time, one after another, so a caller need not wait for it before its work.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from .. import launching
from ..launching import LaunchConfig
from ..triton_siso import mamba3_siso_triton, recording_for


@dataclass(frozen=True)
class Launch:
    """One kernel launch as the launcher made it (launching.launch's arguments)."""

    name: str
    kernel: object
    grid: tuple
    args: tuple
    constexprs: dict
    cfg: LaunchConfig

    def key(self) -> tuple:
        """What Triton compiles one kernel for: the kernel, its constexprs and launch options,
        and each argument as Triton specialises it (a tensor by dtype and 16-byte alignment, an
        integer by being 1 or a multiple of 16, anything else by value)."""
        return (
            self.kernel,
            tuple(sorted(self.constexprs.items())),
            self.cfg,
            tuple(_specialised(a) for a in self.args),
        )

    def run(self, cfg: LaunchConfig | None = None) -> None:
        """Launch it again on its arguments, under ``cfg`` where given (the tuner's candidate)."""
        cfg = cfg or self.cfg
        self.kernel[self.grid](*self.args, **self.constexprs, **cfg.launch_kwargs())


def _specialised(arg) -> object:
    if isinstance(arg, torch.Tensor):
        return ("tensor", arg.dtype, arg.data_ptr() % 16 == 0)
    if isinstance(arg, bool) or arg is None:
        return arg
    if isinstance(arg, int):
        return ("int", arg == 1, arg % 16 == 0, -(2**31) <= arg < 2**31)
    return ("value", arg)


def scan_launches(
    b: int,
    t: int,
    h: int,
    p: int,
    n: int,
    s: int,
    *,
    g: int = 1,
    chunk_size: int,
    dtype: torch.dtype,
    reset: bool,
    device: torch.device,
) -> list[Launch]:
    """The launches of the scan's forward with saves, its backward and its forward without
    saves, called as the model's mixer calls it: q, k (b, t, g, n) and z, x packed (b, t, 2, h,
    p) in ``dtype``; Δ, A·Δ and λ̃ (b, h, t), the biases (h, n), one set of angles for every head
    (b, t, 1, s) and ``d`` (h,) in fp32; resets when ``reset``; no carried state. Recorded on
    meta tensors under ``device``'s launch plan; nothing runs on a GPU."""
    launches: list[Launch] = []
    meta = torch.device("meta")

    def leaf(*shape, dt=torch.float32):
        return torch.empty(*shape, dtype=dt, device=meta, requires_grad=True)

    q, k = leaf(b, t, g, n, dt=dtype), leaf(b, t, g, n, dt=dtype)
    zv = leaf(b, t, 2, h, p, dt=dtype)
    adt, dt_, trap = leaf(b, h, t), leaf(b, h, t), leaf(b, h, t)
    q_bias, k_bias, d = leaf(h, n), leaf(h, n), leaf(h)
    angles = leaf(b, t, s).unsqueeze(2)
    rst = torch.zeros(b, t, dtype=torch.bool, device=meta) if reset else None

    def scan():
        return mamba3_siso_triton(
            q,
            k,
            None,
            adt,
            dt_,
            trap,
            q_bias,
            k_bias,
            angles,
            d,
            None,
            chunk_size=chunk_size,
            reset=rst,
            zv=zv,
        )

    launching.set_recorder(lambda *launch: launches.append(Launch(*launch)))
    try:
        with recording_for(device):
            y = scan()
            y.backward(torch.empty_like(y))
            with torch.no_grad():
                scan()
    finally:
        launching.set_recorder(None)
    return launches


def precompile(
    launches: list[Launch], device: torch.device, threads: int | None = None
) -> Future[str]:
    """Compile each distinct launch with Triton's ``warmup`` on ``threads`` daemon threads (at
    most one a launch and one a CPU), the CUDA ``device`` current on each. Returns at once; the
    future holds a one-line summary when every compile has ended, or the first error. Daemon
    threads: a process that exits meanwhile does not wait for them. A CUDA device without an
    index is the caller's current one."""
    if device.type == "cuda" and device.index is None:  # set_device() needs the index
        device = torch.device("cuda", torch.cuda.current_device())
    distinct = list({launch.key(): launch for launch in launches}.values())
    done: Future[str] = Future()
    if not distinct:
        done.set_result("no scan kernels to compile")
        return done
    todo: queue.SimpleQueue[Launch] = queue.SimpleQueue()
    for launch in distinct:
        todo.put(launch)
    n = max(1, min(len(distinct), threads or os.cpu_count() or 1))
    lock, left, errors = threading.Lock(), [n], []
    t0 = time.perf_counter()

    def work() -> None:
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            while True:
                try:
                    launch = todo.get_nowait()
                except queue.Empty:
                    break
                try:
                    launch.kernel.warmup(
                        *launch.args,
                        grid=launch.grid,
                        **launch.constexprs,
                        **launch.cfg.launch_kwargs(),
                    )
                except Exception as e:  # reported through the future, never raised here
                    errors.append(RuntimeError(f"compiling {launch.name} failed: {e}"))
        except Exception as e:
            errors.append(e)
        finally:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                if errors:
                    done.set_exception(errors[0])
                else:
                    done.set_result(
                        f"{len(distinct)} scan kernels compiled in "
                        f"{time.perf_counter() - t0:.1f} s on {n} threads"
                    )

    launching.compiling_ahead(done)  # a scan launched meanwhile waits for it
    for i in range(n):
        threading.Thread(target=work, name=f"m3run-precompile-{i}", daemon=True).start()
    return done
