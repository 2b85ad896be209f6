"""Compiling the scan's kernels ahead of their first launch (kernels/mamba3/tools/precompile.py):
the launches recorded on meta tensors are, kernel for kernel and argument for argument as Triton
specialises them, those the model's mixer makes in training and evaluation; recording takes only
its own thread's launches; the pool compiles each distinct launch once and reports; and, on a
GPU, a scan after the precompile compiles nothing more."""

from __future__ import annotations

import threading

import pytest
import torch

from m3run.kernels.mamba3 import api, mamba3_siso
from m3run.kernels.mamba3 import launching as lp
from m3run.kernels.mamba3.tools.precompile import Launch, precompile, scan_launches
from m3run.model.config import ModelConfig
from m3run.model.mixer import Mamba3Mixer

CUDA = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="compiling for a GPU needs one"),
]


def recorded(fn) -> list[Launch]:
    launches: list[Launch] = []
    lp.set_recorder(lambda *launch: launches.append(Launch(*launch)))
    try:
        fn()
    finally:
        lp.set_recorder(None)
    return launches


@pytest.mark.parametrize("reset", [True, False], ids=["resets", "no-resets"])
def test_the_recorded_launches_are_those_the_mixer_makes(reset, monkeypatch):
    # The mixer's own forward, backward and no-grad forward on the CPU with its scan on the
    # Triton operators (the launches recorded, not run: their outputs are left unwritten), as
    # a training step and an evaluation call it; against scan_launches at the same shapes.
    monkeypatch.setattr(api, "triton_unavailable_reason", lambda device: None)
    cfg = ModelConfig.preset("tiny", scan_backend="triton")
    mixer = Mamba3Mixer(cfg)
    b, t = 2, 256
    u = torch.randn(b, t, cfg.d_model, requires_grad=True)
    rst = torch.zeros(b, t, dtype=torch.bool)
    rst[:, 100] = True

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = mixer(u, reset=rst if reset else None)
            y.float().sum().backward()
            with torch.no_grad():
                mixer(u, reset=rst if reset else None)

    real = recorded(step)
    ahead = scan_launches(
        b,
        t,
        cfg.nheads,
        cfg.headdim,
        cfg.d_state,
        cfg.n_angles,
        g=cfg.ngroups,
        chunk_size=cfg.chunk_size,
        dtype=torch.bfloat16,
        reset=reset,
        device=torch.device("cpu"),
    )
    assert [x.name for x in real] == [x.name for x in ahead]
    assert len(real) == 7  # forward, the backward's five kernels, the forward without saves
    for r, a in zip(real, ahead, strict=True):
        assert r.key() == a.key(), r.name
        assert r.grid == a.grid, r.name


def test_recording_takes_only_the_recording_threads_launches():
    class Kernel:  # stands in for a jitted kernel: what a launch would run
        def __init__(self):
            self.ran = []

        def __getitem__(self, grid):
            return lambda *args, **kw: self.ran.append(grid)

    kernel, cfg = Kernel(), lp.LaunchConfig(num_warps=4, num_stages=1)
    started, release = threading.Event(), threading.Event()

    def other_thread():
        started.set()
        release.wait(10)
        lp.launch("k", kernel, (3,), (), {}, cfg)

    worker = threading.Thread(target=other_thread)
    worker.start()
    started.wait(10)

    def here():
        release.set()
        worker.join(10)
        lp.launch("k", kernel, (1,), (), {}, cfg)

    mine = recorded(here)
    assert [x.grid for x in mine] == [(1,)]
    assert kernel.ran == [(3,)]


class Warmable:
    """Stands in for a jitted kernel's warmup: what precompile asks of Triton."""

    def __init__(self, fail: bool = False):
        self.fail, self.calls = fail, []
        self.lock = threading.Lock()

    def warmup(self, *args, grid, **kwargs):
        with self.lock:
            self.calls.append((args, grid, kwargs))
        if self.fail:
            raise ValueError("ptxas ran out of registers")


def test_precompile_compiles_each_distinct_launch_once_and_says_so():
    cfg = lp.LaunchConfig(num_warps=2, num_stages=3, maxnreg=128)
    a, b = Warmable(), Warmable()
    x = torch.empty(4, 16)
    launches = [
        Launch("a", a, (8,), (x, 2048), {"BT": 32}, cfg),
        Launch("a", a, (8,), (torch.empty(4, 16), 4096), {"BT": 32}, cfg),  # the same compile
        Launch("a", a, (8,), (x, 2048), {"BT": 64}, cfg),
        Launch("b", b, (2, 2), (x, 1), {}, cfg),
    ]
    summary = precompile(launches, torch.device("cpu"), threads=3).result(timeout=30)
    assert summary.startswith("3 scan kernels compiled in ") and summary.endswith("on 3 threads")
    assert sorted(kw["BT"] for _, _, kw in a.calls) == [32, 64]
    assert b.calls == [((x, 1), (2, 2), {"num_warps": 2, "num_stages": 3, "maxnreg": 128})]


def test_a_failed_compile_is_the_futures_error_and_the_rest_still_compile():
    cfg = lp.LaunchConfig(num_warps=4, num_stages=1)
    bad, good = Warmable(fail=True), Warmable()
    x = torch.empty(16)
    job = precompile(
        [Launch("bwd_chunk", bad, (1,), (x,), {}, cfg), Launch("fwd", good, (1,), (x,), {}, cfg)],
        torch.device("cpu"),
    )
    with pytest.raises(RuntimeError, match="compiling bwd_chunk failed: ptxas ran out"):
        job.result(timeout=30)
    assert len(good.calls) == 1


class Launchable(Warmable):
    """A kernel whose compile (warmup) waits for ``release``, and whose launches (what
    launching.launch calls) record how many compiles had ended before them."""

    def __init__(self):
        super().__init__()
        self.release, self.launched = threading.Event(), []

    def warmup(self, *args, grid, **kwargs):
        self.release.wait(timeout=60)
        super().warmup(*args, grid=grid, **kwargs)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launched.append(len(self.calls))


def test_a_launch_while_its_kernels_compile_ahead_waits_for_the_compile():
    # Compiled again on the launching thread, one kernel after another, the scan's first step
    # would take as long as the pool's compile of every kernel: the launch waits for the pool.
    kernel, cfg, x = Launchable(), lp.LaunchConfig(num_warps=4, num_stages=1), torch.empty(16)
    job = precompile([Launch("fwd", kernel, (1,), (x,), {}, cfg)], torch.device("cpu"))
    threading.Timer(0.1, kernel.release.set).start()
    lp.launch("fwd", kernel, (1,), (x,), {}, cfg)
    assert kernel.launched == [1]  # after its compile had ended
    assert job.done() and not lp._hooks.waiting
    lp.launch("fwd", kernel, (1,), (x,), {}, cfg)  # nothing left to wait for
    assert kernel.launched == [1, 1]


def test_a_compile_ahead_that_outlasts_the_wait_is_waited_for_no_more(monkeypatch, caplog):
    kernel, cfg, x = Launchable(), lp.LaunchConfig(num_warps=4, num_stages=1), torch.empty(16)
    monkeypatch.setattr(lp, "AHEAD_WAIT_S", 0.05)
    job = precompile([Launch("fwd", kernel, (1,), (x,), {}, cfg)], torch.device("cpu"))
    try:
        with caplog.at_level("WARNING", logger=lp.__name__):
            lp.launch("fwd", kernel, (1,), (x,), {}, cfg)
        assert kernel.launched == [0] and not job.done() and not lp._hooks.waiting
        assert "compile ahead still runs after 0 s" in caplog.text
        lp.launch("fwd", kernel, (1,), (x,), {}, cfg)  # given up on: no second wait, no log
        assert kernel.launched == [0, 0] and caplog.text.count("still runs") == 1
    finally:
        kernel.release.set()
    assert job.result(timeout=30).startswith("1 scan kernels compiled")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA test below runs it for real")
def test_the_recorded_launches_compile_with_tritons_warmup_without_a_gpu(tmp_path, monkeypatch):
    # Triton's own warmup of every recorded launch at the 434m preset's shapes, compiled for
    # sm_90 through a driver that reports an H200 (a CPU has no CUDA driver); then each launch
    # again with real tensors of the same shapes and strides finds its kernel compiled.
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase
    from triton.runtime.driver import driver

    class H200(DriverBase):
        def is_active(self):
            return True

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_device_interface(self):
            return None

        def get_benchmarker(self):
            return None

        def map_python_to_cpp_type(self, ty):
            return ty

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    launches = scan_launches(
        16,
        2048,
        32,
        64,
        64,
        16,
        chunk_size=64,
        dtype=torch.bfloat16,
        reset=True,
        device=torch.device("cpu"),
    )
    kernels = {launch.kernel for launch in launches}
    was = driver._active
    driver.set_active(H200())
    try:
        summary = precompile(launches, torch.device("cpu")).result(timeout=300)
        assert summary.startswith("7 scan kernels compiled in ")
        for launch in launches:
            cache = launch.kernel.device_caches[0][0]
            n = len(cache)
            real = tuple(
                torch.empty_strided(a.shape, a.stride(), dtype=a.dtype)
                if isinstance(a, torch.Tensor)
                else a
                for a in launch.args
            )
            launch.kernel.warmup(
                *real, grid=launch.grid, **launch.constexprs, **launch.cfg.launch_kwargs()
            )
            assert len(cache) == n, launch.name
    finally:
        driver._active = was
        for kernel in kernels:  # nothing compiled for the stand-in driver outlives the test
            kernel.device_caches.clear()


@pytest.mark.parametrize("reset", [True, False], ids=["resets", "no-resets"])
@CUDA[0]
@CUDA[1]
def test_after_the_precompile_a_scan_compiles_nothing(reset):
    dev = torch.device("cuda")
    b, t, h, p, n, s = 2, 512, 4, 64, 64, 16
    launches = scan_launches(
        b, t, h, p, n, s, chunk_size=64, dtype=torch.bfloat16, reset=reset, device=dev
    )
    kernels = {launch.kernel for launch in launches}
    for kernel in kernels:  # what earlier tests compiled in this process does not count
        kernel.device_caches.clear()

    def compiled() -> int:
        return sum(len(k.device_caches[dev.index or 0][0]) for k in kernels)

    precompile(launches, dev).result(timeout=600)
    before = compiled()
    assert before == len({launch.key() for launch in launches}) == 7
    g = torch.Generator(device="cpu").manual_seed(0)

    def r(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dev, dtype).requires_grad_()

    dt = torch.nn.functional.softplus(r(b, h, t).detach() - 2).requires_grad_()
    args = dict(
        q=r(b, t, 1, n, dtype=torch.bfloat16),
        k=r(b, t, 1, n, dtype=torch.bfloat16),
        v=None,
        adt=(-dt.detach() * 0.5).requires_grad_(),
        dt=dt,
        trap=r(b, h, t),
        q_bias=r(h, n),
        k_bias=r(h, n),
        angles=r(b, t, 1, s),
        d=r(h),
    )
    zv = r(b, t, 2, h, p, dtype=torch.bfloat16)
    rst = None
    if reset:
        rst = torch.zeros(b, t, dtype=torch.bool, device=dev)
        rst[:, 100] = True
    y = mamba3_siso(**args, zv=zv, reset=rst, chunk_size=64, backend="triton")
    y.float().sum().backward()
    with torch.no_grad():
        mamba3_siso(**args, zv=zv, reset=rst, chunk_size=64, backend="triton")
    torch.cuda.synchronize()
    assert compiled() == before
