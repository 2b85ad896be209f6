"""`m3run tune-scan`: tune the scan kernels' launch plans on this machine's GPU, once.

The checked-in launch table holds plans for the GPUs the kernels were tuned on; on any other
(an architecture the table lacks) a launch's smoke test tunes them first
(supervisor.tune_scan), or the scan runs safe defaults and says so. This command does the same
tune on its own, ahead of a launch or again after a driver change: it times the candidates at
the config's shapes on this GPU, outside any training process, and stores the best plan in
this machine's plans file (kernels/mamba3/plans/local.py: on the image's runs volume, or the
systemd unit's cache directory), which every later scan reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from m3run.runner.cli.app import Overrides, app, fail
from m3run.runner.protocol import EXIT_CONFIG

EPILOG = (
    "Exit codes: 0 tuned and stored, 78 bad config or no GPU the Triton scan runs on, 1 the "
    "tune failed (nothing stored)."
)


@app.command("tune-scan", epilog=EPILOG)
def tune_scan(
    config: Annotated[Path, typer.Argument(metavar="CONFIG", help="YAML run config.")],
    overrides: Overrides = None,
    chunks: Annotated[
        list[int] | None,
        typer.Option(
            "--chunk", metavar="N", help="Kernel chunk to try (repeatable; default 16, 32 and 64)."
        ),
    ] = None,
    plans: Annotated[
        Path | None,
        typer.Option(
            "--plans",
            metavar="FILE",
            help="Plans file to write (default: "
            "$M3RUN_SCAN_PLANS, else $XDG_CACHE_HOME/m3run/scan_plans.json).",
        ),
    ] = None,
) -> None:
    """Tune the scan kernels' launch plans for CONFIG's shapes on this GPU (a few minutes; run it
    on an idle GPU, once per machine and m3run version)."""
    import torch

    from m3run.kernels.mamba3 import BackendUnavailableError, resolve_backend
    from m3run.runner.config import ConfigError, load_config

    try:
        cfg = load_config(config, overrides or [])
    except ConfigError as e:
        raise fail(f"m3run tune-scan: {e}", EXIT_CONFIG) from None
    if not torch.cuda.is_available():
        raise fail(
            "m3run tune-scan: no CUDA GPU here: the launch plans are timed on the GPU "
            "that trains. Fix: run it on the training machine.",
            EXIT_CONFIG,
        )
    device = torch.device("cuda", torch.cuda.current_device())
    try:
        resolve_backend("triton", device)
    except BackendUnavailableError as e:
        raise fail(
            f"m3run tune-scan: {e}. Fix: run it where the Triton scan runs "
            "(an sm_80 or newer GPU with triton installed).",
            EXIT_CONFIG,
        ) from None
    if cfg.model.scan_backend == "pytorch":
        typer.echo(
            "note: this config runs the PyTorch scan (model.scan_backend=pytorch); the "
            "plans apply to runs on the Triton scan"
        )
    _tune(cfg, device, chunks, plans)


def _tune(cfg, device, chunks: list[int] | None, plans: Path | None) -> None:
    import torch

    from m3run.kernels.mamba3 import plans as lp
    from m3run.kernels.mamba3 import triton_common as tc
    from m3run.kernels.mamba3.tools import tuning
    from m3run.runner.worker.build import scan_shape
    from m3run.runner.worker.smoke import first_line

    m = cfg.model
    chunks = chunks or list(tc.CHUNK_SIZES)
    bad = sorted(set(chunks) - set(tc.CHUNK_SIZES))
    if bad:
        raise fail(f"m3run tune-scan: --chunk takes {tc.CHUNK_SIZES}, got {bad}", EXIT_CONFIG)
    error = tc.shape_error(torch.empty(1, m.headdim), m.d_state, m.chunk_size)
    if error is not None:
        raise fail(f"m3run tune-scan: config {error}", EXIT_CONFIG)
    shape = scan_shape(cfg, device)
    free, total = torch.cuda.mem_get_info(device)
    if free < 0.9 * total:
        typer.echo(
            f"note: {(total - free) / 2**30:.1f} GiB of this GPU are in use by others: "
            "their work skews the timings; tune on an idle GPU"
        )
    name, arch = torch.cuda.get_device_name(device), lp.arch_key(device)
    typer.echo(f"tuning the scan on {name} ({arch}) at {shape.describe()}, chunks {chunks}")
    untuned = lp.untuned_plan(m.chunk_size)
    try:
        tuned, path = tuning.tune_and_store(
            shape, device, chunks=chunks, baseline=untuned, log=typer.echo, path=plans
        )
    except tuning.PlansNotStored as e:
        raise fail(f"m3run tune-scan: {tuning.summary(e.tuned)}, but {e}", 1) from None
    except torch.OutOfMemoryError:
        raise fail(
            f"m3run tune-scan: out of GPU memory at {shape.describe()}; nothing was stored. "
            "Fix: free the GPU (stop the run on it) and try again.",
            1,
        ) from None
    except Exception as e:  # a GPU error: the process's CUDA context is lost, nothing to store
        raise fail(
            f"m3run tune-scan: the tune failed ({first_line(e)}); nothing was "
            "stored, so the scan keeps the plans it had. Fix: run `m3run health`, then try again.",
            1,
        ) from None
    typer.echo(
        f"{tuning.summary(tuned)}\nstored the {arch} plan in {path}: every scan on this "
        "machine reads it from its next start (a running worker at its next restart)"
    )
