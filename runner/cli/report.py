"""What `m3run status` and `m3run list` print: runner.runstate's reading of a run dir, plus what
only the supervisor's and health's code can tell (the checkpoint mirror's lag from mirror.json,
the GPU probe), laid out for a person or as JSON.

The additions live here, on the CLI side, so that runstate stays a reader of run dirs over the
shared torch-free modules (`m3run stop` and the liveness check use it too) and importing it loads
nothing of the supervisor's or health's.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from m3run.runner.formatting import format_duration
from m3run.runner.protocol import SmokeProgress, SupervisorPhase
from m3run.runner.runstate import collect_status, runs_root_dir


def full_status(run_dir: Path, gpu: bool = False) -> dict:
    """Everything `m3run status` shows, as one JSON-ready dict."""
    from m3run.runner.supervisor.mirror import read_lag

    status = collect_status(run_dir)
    status["mirror"] = read_lag(run_dir)  # None without a checkpoint mirror
    if gpu:
        status["gpu"] = _gpu_snapshot()
    return status


def _gpu_snapshot() -> list[dict] | dict | None:
    """Util/memory/temperature per GPU (runner.health's probe child), None without a GPU."""
    from dataclasses import asdict

    from m3run.runner.health.checks import gpu_snapshot
    from m3run.runner.health.probe import ProbeError

    try:
        snap = gpu_snapshot(timeout_s=5.0)
    except ProbeError as e:  # a sick GPU must not break `m3run status`
        return {"error": f"GPU probe failed: {e}"}
    return [asdict(d) for d in snap] or None


def format_runs(rows: list[dict]) -> str:
    if not rows:
        return f"no runs under {runs_root_dir()}/"
    table = [("RUN", "PHASE", "STEP", "LOSS", "UPDATED")]
    for r in rows:
        step = f"{r['step']}/{r['total_steps']}" if r["step"] is not None else "-"
        updated = (
            time.strftime("%Y-%m-%d %H:%M", time.localtime(r["updated_at"]))
            if r["updated_at"]
            else "-"
        )
        table.append(
            (
                Path(r["run_dir"]).name,
                str(r["phase"] or "-"),
                step,
                _fmt_num(r["loss"], ".4f"),
                updated,
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(4)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths, strict=True)) + "  " + row[4]
        for row in table
    )


def _fmt_num(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def _fmt_bytes(n: Any) -> str:
    return f"{n / 2**30:.1f} GiB" if isinstance(n, (int, float)) else "-"


def format_status(st: dict) -> str:
    """Human-readable status block. Rows with nothing to say (VRAM and MFU on CPU, the ETA of
    a run that is not training) are left out."""
    step = st["step"] if st["step"] is not None else "-"
    total = st["total_steps"] if st["total_steps"] is not None else "-"
    eta = f"   ETA {format_duration(st['eta_s'])}" if st.get("eta_s") is not None else ""
    speed = f"speed      {_fmt_num(st['tokens_per_s'], ',.0f')} tok/s"
    if isinstance(st.get("mfu"), (int, float)):
        speed += f"   MFU {st['mfu']:.1%}"
        if isinstance(st.get("mfu_peak_flops"), (int, float)):
            speed += f" of {st['mfu_peak_flops'] / 1e12:.0f} TFLOP/s"
    lines = [
        f"run        {st['run_dir']}",
        f"phase      {st['phase'] or st.get('state_problem') or 'never launched'}"
        + (f"  ({st['reason']})" if st.get("reason") else ""),
    ]
    # Before its first worker a run has a preflight to show, and no heartbeat (nor, at a first
    # launch, a step) yet.
    preflight = st["phase"] == SupervisorPhase.PREFLIGHT
    if preflight:
        lines.append(f"preflight  {_fmt_preflight(st.get('preflight_check'))}")
    if not preflight or st["step"] is not None:
        lines += [
            f"step       {step}/{total}{eta}",
            f"loss       {_fmt_num(st['loss'], '.4f')}   ppl {_fmt_num(st['ppl'], '.2f')}   "
            f"lr {_fmt_num(st['lr'], '.3g')}   grad_norm {_fmt_num(st['grad_norm'], '.3g')}",
            speed,
        ]
    if not preflight:
        lines.append(
            f"heartbeat  {_fmt_num(st['heartbeat_age_s'], '.1f')}s ago "
            f"(worker phase {st['worker_phase'] or '-'}, allowance "
            f"{_fmt_num(st['heartbeat_timeout_s'], '.0f')}s)"
        )
    if st.get("vram_bytes") is not None or st.get("peak_vram_bytes") is not None:
        lines.append(
            f"vram       {_fmt_bytes(st['vram_bytes'])} (peak {_fmt_bytes(st['peak_vram_bytes'])})"
        )
    last = st["last_checkpoint_step"]
    lines += [
        f"checkpoint last complete step {last if last is not None else '-'}",
        f"pids       supervisor {st['supervisor_pid'] or '-'}"
        f"{'' if st['supervisor_alive'] else ' (not running)'}, worker {st['worker_pid'] or '-'}"
        f"{'' if st['worker_alive'] else ' (not running)'}",
    ]
    if st.get("error"):
        lines.append("error      " + "\n           ".join(st["error"]))
    if st.get("mirror"):
        from m3run.runner.supervisor.mirror import format_lag

        lines.append(f"mirror     {format_lag(st['mirror'])}")
    gpu = st.get("gpu")
    if gpu:
        for g in gpu if isinstance(gpu, list) else [gpu]:
            index = g.get("index", "") if isinstance(g, dict) else ""
            lines.append(f"gpu {index!s:<6} {_fmt_gpu(g)}")
    restarts = st.get("restarts") or []
    lines.append(f"restarts   {len(restarts)}")
    for r in restarts[-10:]:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.get("time", 0)))
        lines.append(
            f"  {when}  exit {r.get('exit_code')}  resume {r.get('resume_step')}  {r.get('reason')}"
        )
    return "\n".join(lines)


def _fmt_preflight(check: dict | None) -> str:
    """The smoke check under way, e.g. `smoke test check 3/8: model forward/backward (running
    12s)`; before one runs, what the preflight does."""
    progress = SmokeProgress.from_dict(check)
    if progress is None:
        return "GPU health gate and smoke test (no smoke check running)"
    running = format_duration(time.time() - progress.started)
    return (
        f"smoke test check {progress.number}/{progress.total}: {progress.name} (running {running})"
    )


def _fmt_gpu(g: Any) -> str:
    if not isinstance(g, dict) or "error" in g:
        return str(g.get("error") if isinstance(g, dict) else g)
    mem = (
        f"{g.get('mem_used_mib')}/{g.get('mem_total_mib')} MiB"
        if g.get("mem_total_mib") is not None
        else "memory -"
    )
    util = f"{g['util_gpu_pct']}%" if g.get("util_gpu_pct") is not None else "-"
    temp = f"{g['temp_c']} °C" if g.get("temp_c") is not None else "-"
    return f"{g.get('name') or ''}  util {util}  {mem}  {temp}"
