"""Preflight smoke test (`m3run smoke CONFIG`): numbered checks, each proving one layer.

The supervisor runs it before the first worker starts, as a child process: `python -m
m3run.runner.worker.smoke CONFIG --run-dir RUN_DIR` runs the checks and writes the verdict to
RUN_DIR/smoke.json; a failing check stops the launch with that check's message. On CPU the checks
that need a GPU are reported as skipped, with why. Device, precision, model and optimizer are built
as the trainer builds them (runner.worker.build).

The checkpoint round trip (check 7) is disk and hashing work on a CPU copy of the fresh model: it
starts on a thread as soon as check 3 has built the model and runs beside checks 3–6 (the first
forward/backward compiles the kernels), and check 7 waits for its verdict; run in turn it was a
large part of the smoke test's time on a launch's path. Under the supervisor it writes inside the
run dir (a hidden scratch directory, removed after), so it proves the filesystem the run's
checkpoints go to; `m3run smoke` alone writes to the system's temp directory. Its write speed,
with the size of a full checkpoint of this run (the weights, and the optimizer state check 6
leaves), goes into the verdict: the supervisor says at launch from them whether a save on a stop
fits in the time the stop leaves.

With train.compile, check 3 runs the model as the worker's steps will: compiled by the trainer's
own call (build.compile_for_training), at the run's micro-batch and sequence length, under the
same determinism switches. Its compile fails the launch here rather than crash-looping the
worker, its peak memory is the compiled step's, and it leaves inductor's and Triton's caches
(TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR, shared with the worker) holding what the worker's
first step compiles: the worker then loads it instead of compiling. The checks after it that run
other shapes (check 4's single row) run eagerly, and check 6 steps a fresh, uncompiled copy.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from m3run.kernels.mamba3 import BackendUnavailableError, mamba3_siso, resolve_backend
from m3run.model import Mamba3LM
from m3run.runner.checkpoint import layout as ckpt
from m3run.runner.checkpoint.snapshot import leaves_of, nbytes
from m3run.runner.config import ConfigError, RunConfig, load_config
from m3run.runner.data.loader import check_vocab, eval_batches
from m3run.runner.data.manifest import DataError, load_manifest
from m3run.runner.data.mixture import train_loader
from m3run.runner.files import atomic_write_json
from m3run.runner.procs import exit_now
from m3run.runner.protocol import (
    EXIT_CONFIG,
    EXIT_OK,
    LOG_FORMAT_ENV,
    SMOKE_FILE,
    SMOKE_PROGRESS_FILE,
    LogFormat,
    SmokeCheckRecord,
    SmokeProgress,
    SmokeVerdict,
    StopSaveFigures,
    worker_record_line,
)

from .build import (
    autocast,
    build_model,
    build_optimizer,
    compile_for_training,
    compile_phases,
    describe_compile_phases,
    precision_dtype,
    resolve_device,
    scan_shape,
    set_determinism,
)
from .preimport import DYNAMO, CompileStack, import_in_background, wait_imported
from .smoke_round_trip import RoundTripFailed, start_round_trip


class CheckFailed(Exception):
    pass


class CheckSkipped(Exception):
    pass


@dataclass
class Check:
    number: int
    name: str
    status: str  # "ok" | "failed" | "skipped"
    message: str
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class SmokeResult:
    checks: list[Check] = field(default_factory=list)
    stop_save: StopSaveFigures | None = None  # what checks 3, 6 and 7 measured of a full save

    @property
    def ok(self) -> bool:
        return all(c.status != "failed" for c in self.checks)

    @property
    def failed_check_message(self) -> str | None:
        for c in self.checks:
            if c.status == "failed":
                return f"check {c.number} ({c.name}) failed: {c.message}"
        return None


class _Smoke:
    def __init__(
        self,
        cfg: RunConfig,
        scratch: Path | None = None,
        compile_backend="inductor",
        compile_stack: CompileStack | None = None,
        echo=print,
    ):
        self.cfg = cfg
        self.echo = echo or (lambda line: None)  # progress inside a long check
        self.scratch = scratch  # where check 7 writes (None: the system's temp directory)
        self.compile_backend = compile_backend  # train.compile's (tests pass a CPU-only one)
        # torch's compile stack being imported on a thread (preimport.py), as in the worker.
        self.compile_stack = compile_stack
        if cfg.train.deterministic:
            wait_imported(self.compile_stack)  # its switches import inductor: the whole stack first
        set_determinism(cfg.train.deterministic)  # as the trainer: the compile's cache keys too
        self.device = resolve_device(cfg)
        self.amp = precision_dtype(cfg, self.device)
        self.model: Mamba3LM | None = None
        self.peak: int | None = None  # check 3's peak GPU memory, bytes
        self.batch: tuple[torch.Tensor, torch.Tensor] | None = None
        self.eos_id: int | None = None  # with data.reset_at_eos, as the trainer runs the model
        self.backend: str | None = None
        self.round_trip: Future[tuple[str, float | None]] | None = None  # check 7's, from check 3
        # A full checkpoint's parts, bytes (checks 3 and 6), and the write speed (check 7).
        self.model_bytes: int | None = None
        self.optim_bytes: int | None = None
        self.write_bytes_per_s: float | None = None

    def autocast(self):
        return autocast(self.device, self.amp)

    # 1
    def cuda_bf16(self) -> str:
        if self.device.type != "cuda":
            raise CheckSkipped("no CUDA device: the run trains on CPU in fp32")
        name = torch.cuda.get_device_name(self.device)
        if not torch.cuda.is_bf16_supported():
            raise CheckFailed(f"{name} does not support bf16; set train.precision=fp32")
        a = torch.randn(256, 256, device=self.device)
        b = torch.randn(256, 256, device=self.device)
        ref = a @ b
        got = (a.bfloat16() @ b.bfloat16()).float()
        err = ((got - ref).norm() / ref.norm()).item()
        if not err < 2e-2:
            raise CheckFailed(f"bf16 matmul on {name} is off by {err:.2e} relative")
        return f"{name}, CUDA {torch.version.cuda}, bf16 matmul rel. error {err:.1e}"

    # 2
    def data(self) -> str:
        c = self.cfg
        paths = c.data.train_paths()
        for path in paths:
            check_vocab(load_manifest(path), c.model.vocab_size)
        loader = train_loader(
            c.data.train_path,
            c.data.sources,
            c.data.seq_len,
            c.train.micro_batch_size,
            c.train.seed,
            prefetch=0,
        )
        try:
            # Fewer windows than a batch would train on repeats of the same windows.
            if loader.num_windows < c.train.micro_batch_size:
                raise DataError(
                    f"the training data ({', '.join(map(str, paths))}) has "
                    f"{loader.num_windows} windows of {c.data.seq_len + 1} tokens; one batch "
                    f"of train.micro_batch_size={c.train.micro_batch_size} needs "
                    f"{c.train.micro_batch_size}: prepare more data, or lower "
                    "train.micro_batch_size or data.seq_len"
                )
            self.batch = loader.next_batch()
            self.eos_id = loader.eos_id if c.data.reset_at_eos else None
        finally:
            loader.close()
        mix = f" from {len(c.data.sources)} sources" if c.data.sources else ""
        msg = f"train: {loader.num_tokens:,} tokens{mix}, vocab {loader.vocab_size}"
        if c.data.val_path:
            v = load_manifest(c.data.val_path)
            msg += f"; val: {v['total_tokens']:,} tokens"
            if c.eval.interval_steps:
                # The trainer's own eval set, one batch of it: a split too small for one
                # eval batch is found here, not at the run's first eval.
                eval_batches(c.data.val_path, c.data.seq_len, c.train.micro_batch_size, 1)
        return msg

    # 3
    def forward_backward(self) -> str:
        if self.batch is None:
            raise CheckSkipped("no batch: the data check failed")
        tuned = self._tune_scan()  # first: the scan's kernels then compile under its plan
        self.model = build_model(self.cfg, self.device)
        self.model_bytes = nbytes(leaves_of(self.model.state_dict(), {}))
        self.round_trip = start_round_trip(self.model, self.scratch)
        x, y = (t.to(self.device) for t in self.batch)
        # The scan's kernels compile on a pool of threads while torch.compile traces and compiles
        # the rest (the scan's first launch waits for them), as in the worker.
        dtype = self.amp or torch.float32
        # Dynamo first: the recording of the scan's launches runs autograd.
        wait_imported(self.compile_stack, DYNAMO)
        job = self.model.precompile_scan(*x.shape, dtype, reset=self.eos_id is not None)
        wait_imported(self.compile_stack)
        step_model = compile_for_training(self.model, self.cfg.train, backend=self.compile_backend)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            with self.autocast():
                loss = step_model(x, y, eos_id=self.eos_id)
            loss.backward()
        except Exception as e:
            if self.cfg.train.compile and _is_compile_error(e):
                cause = getattr(e, "inner_exception", None) or e  # what a backend raised
                raise CheckFailed(
                    f"torch.compile of the training step failed ({first_line(cause)}). "
                    "Fix: set train.compile=false to train without it, or repair what it names "
                    "(the worker would fail the same way at its first step)"
                ) from e
            raise
        if self.device.type == "cuda":  # check 8's: this step's, not check 6's second model's
            self.peak = torch.cuda.max_memory_allocated(self.device)
        grads = [p.grad for p in self.model.parameters()]
        if not math.isfinite(loss.item()):
            raise CheckFailed(f"the loss of a fresh model is {loss.item()}")
        missing = sum(g is None for g in grads)
        if missing:
            raise CheckFailed(f"{missing} parameters got no gradient")
        bad = sum(not torch.isfinite(g).all() for g in grads)
        if bad:
            raise CheckFailed(f"{bad} parameters got non-finite gradients")
        self.model.zero_grad(set_to_none=True)
        expect = math.log(self.cfg.model.vocab_size)
        t = self.cfg.train
        how = f", compiled (scope {t.compile_scope}) as the worker runs it" if t.compile else ""
        if t.compile and (phases := compile_phases()):
            how += f" (torch.compile's timers, nested: {describe_compile_phases(phases)})"
        return (
            f"loss {loss.item():.3f} (ln V = {expect:.3f}), "
            f"{self.model.num_params():,} params{how}{_precompiled(job)}{tuned}"
        )

    def _tune_scan(self) -> str:
        """supervisor.tune_scan: where this GPU has no tuned launch plan for the run's scan
        (an architecture the checked-in table lacks), tune one and store it where every worker
        reads it (kernels/mamba3/tools/tuning.py; once per machine: the next launch finds it).
        At one chunk, the one the defaults run (the model's, at most DEFAULT_CHUNK): a fraction
        of the time a tune over every chunk takes, and the other chunks have lost to it
        (docs/benchmarks.md); `m3run tune-scan` tries them all."""
        c, m = self.cfg, self.cfg.model
        if not c.supervisor.tune_scan or self.device.type != "cuda":
            return ""
        try:
            if resolve_backend(m.scan_backend, self.device) != "triton":
                return ""
        except BackendUnavailableError:
            return ""  # check 4 says why
        from m3run.kernels.mamba3 import plans as lp
        from m3run.kernels.mamba3 import triton_common as tc
        from m3run.kernels.mamba3.tools import tuning

        shape = scan_shape(c, self.device)
        if lp.launch_plans().has_tuned(self.device, shape.p, shape.n, m.chunk_size, shape.dtype):
            return ""
        untuned = lp.untuned_plan(m.chunk_size)
        self.echo(
            f"  no tuned launch plan for the scan on this GPU: tuning one at "
            f"{shape.describe()}, chunk {untuned.chunk} (once per machine, under a "
            f"minute)"
        )
        try:
            tuned, path = tuning.tune_and_store(
                shape, self.device, chunks=(untuned.chunk,), baseline=untuned, log=lambda line: None
            )
        except tuning.PlansNotStored as e:  # the run trains on, at the defaults: said here
            return f"; the scan's launch plans were tuned ({tuning.summary(e.tuned)}) but {e}"
        except Exception as e:
            raise CheckFailed(
                f"tuning the scan's launch plans failed ({first_line(e)}). Fix: "
                "set supervisor.tune_scan=false to run the default plans, or run `m3run "
                "tune-scan CONFIG` alone to see the candidates"
            ) from e
        others = " and ".join(str(n) for n in tc.CHUNK_SIZES if n != untuned.chunk)
        return (
            f"; the scan's launch plans tuned for this GPU, {tuning.summary(tuned)}, in "
            f"{path} (`m3run tune-scan CONFIG` also tries chunks {others})"
        )

    def eager(self):
        """Runs what check 3 compiled eagerly inside it: the later checks' shapes and copies
        would otherwise compile again (or run the compiled blocks of the model they copied)."""
        if not self.cfg.train.compile:
            return contextlib.nullcontext()
        return torch.compiler.set_stance("force_eager")

    # 4
    def backend_every_block(self) -> str:
        if self.model is None or self.batch is None:
            raise CheckSkipped("no model: the forward/backward check failed")
        try:
            self.backend = resolve_backend(self.cfg.model.scan_backend, self.device)
        except BackendUnavailableError as e:
            raise CheckFailed(str(e)) from e
        outputs: list[tuple[int, bool]] = []

        def record(mod, inp, out):
            outputs.append((mod.layer_idx, bool(torch.isfinite(out).all())))

        hooks = [blk.mixer.register_forward_hook(record) for blk in self.model.layers]
        try:
            with torch.no_grad(), self.autocast(), self.eager():
                self.model(self.batch[0][:1].to(self.device), eos_id=self.eos_id)
        finally:
            for h in hooks:
                h.remove()
        ran = sorted(i for i, _ in outputs)
        if ran != list(range(self.cfg.model.n_layers)):
            raise CheckFailed(f"mixers that ran: {ran}, expected all {self.cfg.model.n_layers}")
        bad = [i for i, ok in outputs if not ok]
        if bad:
            raise CheckFailed(f"non-finite mixer output in block(s) {bad} with {self.backend}")
        return f"backend {self.backend} ran in all {len(ran)} blocks{self._plans()}"

    def _plans(self) -> str:
        """Where the Triton scan's launch plans come from (untuned defaults are slower: said
        here, at launch, with the command that tunes them)."""
        if self.backend != "triton":
            return ""
        from m3run.kernels.mamba3.plans import launch_plans

        shape = scan_shape(self.cfg, self.device)  # the shape check 3's tune took
        source = launch_plans().source(
            self.device, shape.p, shape.n, self.cfg.model.chunk_size, shape.dtype
        )
        return f"; launch plans: {source}"

    # 5
    def parity(self) -> str:
        m = self.cfg.model
        backend = self.backend or resolve_backend(m.scan_backend, self.device)
        g = torch.Generator().manual_seed(0)
        b, t, h, p, n, s = (
            2,
            2 * m.chunk_size + 7,
            min(m.nheads, 4),
            m.headdim,
            m.d_state,
            m.n_angles,
        )
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32

        def r(*shape, dt=torch.float32):
            return torch.randn(*shape, generator=g).to(self.device, dt)

        dt_ = torch.nn.functional.softplus(r(b, h, t) - 2)
        args = dict(
            q=r(b, t, 1, n, dt=dtype),
            k=r(b, t, 1, n, dt=dtype),
            v=r(b, t, h, p, dt=dtype),
            adt=-torch.rand(b, h, t, generator=g).to(self.device) * dt_,
            dt=dt_,
            trap=r(b, h, t),
            q_bias=r(h, n),
            k_bias=r(h, n),
            angles=r(b, t, h, s),
            d=r(h),
            z=r(b, t, h, p, dt=dtype),
        )
        if self.cfg.data.reset_at_eos:
            # Document starts inside a chunk and on a chunk boundary, as training gives them.
            args["reset"] = torch.zeros(b, t, dtype=torch.bool, device=self.device)
            args["reset"][:, [5, m.chunk_size]] = True
        if backend == "pytorch":
            # The reference is what runs: check it against the token-by-token ground truth.
            from m3run.kernels.mamba3 import mamba3_siso_recurrent

            ref = mamba3_siso_recurrent(**args).float()
            other, label = (
                mamba3_siso(**args, chunk_size=m.chunk_size, backend="pytorch"),
                "recurrent",
            )
        else:
            ref = mamba3_siso(**args, chunk_size=m.chunk_size, backend="pytorch").float()
            other, label = mamba3_siso(**args, chunk_size=m.chunk_size, backend=backend), "pytorch"
        err = ((other.float() - ref).norm() / ref.norm()).item()
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        label += " reference" + (" with resets" if "reset" in args else "")
        if not err <= tol:
            raise CheckFailed(f"{backend} vs {label}: rel. error {err:.2e} > {tol:g}")
        return f"{backend} vs {label}: rel. error {err:.1e} (≤ {tol:g})"

    # 6
    def optimizer_step(self) -> str:
        if self.model is None or self.batch is None:
            raise CheckSkipped("no model: the forward/backward check failed")
        # A fresh build of the same seed: the model of check 3 before its step, and not compiled
        # (a copy of it would call check 3's compiled blocks, which hold check 3's model).
        model = build_model(self.cfg, self.device)
        # lr 1e-3 and torch's default eps whatever the recipe: one step must visibly lower the loss
        opt = build_optimizer(model, self.device, self.cfg.train, lr=1e-3)
        x, y = (v.to(self.device) for v in self.batch)
        with self.autocast():
            before = model(x, y, eos_id=self.eos_id)
        before.backward()
        opt.step()
        # The trainer's optimizer, stepped: its state is what a checkpoint's optim.pt holds
        # beside the loader's and the schedule's few bytes.
        self.optim_bytes = nbytes(leaves_of({}, opt.state_dict()))
        opt.zero_grad(set_to_none=True)
        with torch.no_grad(), self.autocast():
            after = model(x, y, eos_id=self.eos_id)
        if not after.item() < before.item():
            raise CheckFailed(f"loss did not fall: {before.item():.4f} → {after.item():.4f}")
        del model, opt
        return f"loss {before.item():.4f} → {after.item():.4f} after one AdamW step"

    # 7
    def checkpoint_round_trip(self) -> str:
        if self.round_trip is None:
            raise CheckSkipped("no model: the forward/backward check failed")
        try:
            message, self.write_bytes_per_s = self.round_trip.result()
        except RoundTripFailed as e:
            raise CheckFailed(str(e)) from e
        return message

    def stop_save(self) -> StopSaveFigures | None:
        """A full checkpoint's size and the write speed, once checks 3, 6 and 7 measured them."""
        if self.model_bytes is None or self.optim_bytes is None or not self.write_bytes_per_s:
            return None
        return StopSaveFigures(self.model_bytes + self.optim_bytes, self.write_bytes_per_s)

    # 8
    def memory(self) -> str:
        if self.device.type != "cuda":
            raise CheckSkipped("no CUDA device: GPU memory is not a limit on CPU")
        if self.model is None or self.peak is None:
            raise CheckSkipped("no model: the forward/backward check failed")
        peak = self.peak
        total = torch.cuda.get_device_properties(self.device).total_memory
        # AdamW keeps two fp32 moments per parameter on top of the weights and gradients.
        need, extra = peak + 8 * self.model.num_params(), "AdamW moments"
        if self.cfg.train.grad_accum_steps > 1:
            # Check 3's backward allocated the gradients as it freed activations; a later
            # micro-batch's backward starts with all of them held (without them the estimate
            # fell short of the 434m step's measured peak).
            need += sum(p.numel() * p.element_size() for p in self.model.parameters())
            extra += " and the gradients held across micro-batches"
        frac = need / total
        msg = (
            f"one micro-batch peaks at {peak / 2**30:.1f} GiB; with {extra} "
            f"≈{need / 2**30:.1f} GiB of {total / 2**30:.0f} GiB ({frac:.0%})"
        )
        if frac > 0.95:
            raise CheckFailed(
                msg + ": lower train.micro_batch_size or enable train.activation_checkpointing"
            )
        return msg


def first_line(e: BaseException) -> str:
    """An error's type and the first line of its message, for a one-line verdict (a check's,
    or `m3run tune-scan`'s)."""
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


def _is_compile_error(e: BaseException) -> bool:
    """Whether ``e`` is torch.compile's (dynamo's or a backend's, which dynamo wraps)."""
    from torch._dynamo.exc import TorchDynamoException

    return isinstance(e, TorchDynamoException)


def _precompiled(job: Future[str] | None) -> str:
    """What the scan kernels' compile ahead did, for check 3's message (a compile that failed or
    still runs is said there: its kernels then compiled at their first launch)."""
    if job is None:
        return ""
    if not job.done():  # the launches gave up waiting for it (launching.AHEAD_WAIT_S)
        return "; the scan kernels' precompile still ran: they compiled at their first launch"
    try:
        return f"; {job.result()}"
    except Exception as e:
        return f"; precompiling the scan kernels failed ({e}): compiled at first launch"


CHECKS: list[tuple[str, Callable[[_Smoke], str]]] = [
    ("CUDA and bf16", _Smoke.cuda_bf16),
    ("data readable", _Smoke.data),
    ("model forward/backward", _Smoke.forward_backward),
    ("scan backend on every block", _Smoke.backend_every_block),
    ("scan parity with the reference", _Smoke.parity),
    ("one optimizer step lowers the loss", _Smoke.optimizer_step),
    ("checkpoint save/verify/load", _Smoke.checkpoint_round_trip),
    ("peak memory of one micro-batch", _Smoke.memory),
]


def run_smoke(
    cfg: RunConfig,
    run_dir: str | Path | None = None,
    echo=print,
    compile_backend="inductor",
    on_start: Callable[[SmokeProgress], None] | None = None,
    on_check: Callable[[Check], None] | None = None,
) -> SmokeResult:
    """Run every check in order (later checks are skipped when one they need failed). With
    ``run_dir`` the checkpoint round trip writes there (see the module docstring);
    ``compile_backend`` is train.compile's torch.compile backend (another one in tests).
    ``on_start`` hears of each check as it starts; each outcome goes to ``on_check``, else to
    ``echo`` as a text line."""
    result = SmokeResult()
    # With train.compile, dynamo and inductor import beside checks 1–3's setup, as the worker
    # imports them beside its own: their import is seconds of CPU that check 3 would otherwise
    # wait for.
    stack = import_in_background() if cfg.train.compile else None
    try:
        smoke = _Smoke(
            cfg, None if run_dir is None else Path(run_dir), compile_backend, stack, echo
        )
    except ConfigError as e:
        result.checks.append(Check(1, CHECKS[0][0], "failed", str(e), 0.0))
        return result
    for number, (name, fn) in enumerate(CHECKS, start=1):
        if on_start is not None:
            on_start(SmokeProgress(number, len(CHECKS), name, time.time()))
        t0 = time.perf_counter()
        try:
            status, message = "ok", fn(smoke)
        except CheckSkipped as e:
            status, message = "skipped", str(e)
        except (CheckFailed, DataError, ConfigError, ckpt.CheckpointError) as e:
            status, message = "failed", str(e)
        except Exception as e:  # any other error is a failed check, never a crashed launch
            status, message = "failed", f"{type(e).__name__}: {e}"
        check = Check(number, name, status, message, time.perf_counter() - t0)
        result.checks.append(check)
        if on_check is not None:
            on_check(check)
        elif echo is not None:
            line = f"{name:<36} {status.upper():<7} {check.seconds:6.1f} s  {message}"
            echo(f"  [{number}/{len(CHECKS)}] {line}")
    result.stop_save = smoke.stop_save()
    return result


def _verdict(result: SmokeResult) -> SmokeVerdict:
    checks = [c.to_dict() for c in result.checks]
    ran = sum(c["status"] == "ok" for c in checks)
    skipped = sum(c["status"] == "skipped" for c in checks)
    message = (
        f"{ran} checks passed, {skipped} skipped" if result.ok else str(result.failed_check_message)
    )
    return SmokeVerdict(ok=result.ok, message=message, checks=checks, stop_save=result.stop_save)


def main(argv: list[str] | None = None) -> int:
    """The supervisor's smoke child: run the checks, write smoke.json, exit 0 or 78."""
    p = argparse.ArgumentParser(prog="python -m m3run.runner.worker.smoke", description=__doc__)
    p.add_argument("config", type=Path)
    p.add_argument("--run-dir", type=Path, required=True)
    a = p.parse_args(argv)

    def started(progress: SmokeProgress) -> None:  # `m3run status` shows it (state.json)
        atomic_write_json(a.run_dir / SMOKE_PROGRESS_FILE, progress.to_dict())

    def checked(check: Check) -> None:
        record = SmokeCheckRecord(time=time.time(), total=len(CHECKS), **check.to_dict())
        print(worker_record_line(record), flush=True)

    json_lines = os.environ.get(LOG_FORMAT_ENV) == LogFormat.JSON
    result = run_smoke(
        load_config(a.config), a.run_dir, on_start=started, on_check=checked if json_lines else None
    )
    verdict = _verdict(result)
    atomic_write_json(a.run_dir / SMOKE_FILE, verdict.to_dict())
    print(f"smoke: {'ok' if verdict.ok else 'FAILED'}: {verdict.message}", flush=True)
    return EXIT_OK if verdict.ok else EXIT_CONFIG


if __name__ == "__main__":
    exit_now(main())  # the verdict is in smoke.json: the supervisor need not wait out a teardown
