"""A supervised data-parallel run that loses a rank: the group restarts and resumes exactly.

    python bench/runner/ddp_restart.py [--nproc 2] [--steps 40] [--kill-after 15]

Runs `m3run launch` twice on the same config with distributed.nproc_per_node=N: once
uninterrupted, once with one rank SIGKILLed after step --kill-after. Prints the supervisor's
restart events and compares every logged loss and the final weights of the two runs. On CPU it
uses gloo and the tiny model (a smoke run of the script).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "train":
            out[rec["step"]] = rec["loss"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--kill-after", type=int, default=15)
    a = ap.parse_args()
    import torch
    from safetensors.torch import load_file

    from m3run.runner.checkpoint.layout import latest_complete
    from m3run.runner.data.prepare import prepare_data

    gpu = torch.cuda.is_available() and torch.cuda.device_count() >= a.nproc
    work = Path(tempfile.mkdtemp(prefix="ddp-restart-"))
    prepare_data(["stdlib"], work / "data", tokenizer="bpe:512", max_bytes=400_000, progress=False)
    sets = [
        f"distributed.nproc_per_node={a.nproc}",
        f"train.total_steps={a.steps}",
        "train.warmup_steps=5",
        "train.micro_batch_size=4",
        f"train.grad_accum_steps={a.nproc}",
        "checkpoint.interval_steps=5",
        "log.interval_steps=1",
        "eval.interval_steps=0",
        "model.vocab_size=512",
        "data.seq_len=128",
        "log.heartbeat_interval_s=0.2",
        f"data.train_path={work / 'data' / 'train'}",
        f"data.val_path={work / 'data' / 'val'}",
        f"train.device={'cuda' if gpu else 'cpu'}",
        f"train.precision={'bf16' if gpu else 'fp32'}",
        "supervisor.backoff_initial_s=1",
        "supervisor.preemption_provider=none",
    ]
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
    }
    if not gpu:
        env["OMP_NUM_THREADS"] = "1"

    def launch(run_dir: Path, *extra: str) -> list[str]:
        config = REPO / "configs" / "demo_cpu.yaml"
        cmd = [
            sys.executable,
            "-m",
            "m3run.runner.cli",
            "launch",
            str(config),
            "--run-dir",
            str(run_dir),
            *extra,
        ]
        for s in sets:
            cmd += ["--set", s]
        return cmd

    ref, chaos = work / "ref", work / "chaos"
    t0 = time.time()
    r = subprocess.run(launch(ref), env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"reference run failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    print(f"reference run: exit 0 in {time.time() - t0:.0f}s")
    proc = subprocess.Popen(
        launch(chaos), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    victim = None
    while proc.poll() is None and victim is None:
        time.sleep(0.1)
        try:
            done = max(losses(chaos) or [0])
        except (FileNotFoundError, json.JSONDecodeError):
            continue
        hb = chaos / "heartbeat.local1.json"
        if done >= a.kill_after and hb.exists():
            victim = json.loads(hb.read_text())["pid"]
            os.kill(victim, signal.SIGKILL)
            print(f"SIGKILL local rank 1 (pid {victim}) after step {done}")
    out = proc.communicate(timeout=900)[0]
    print(f"chaos run: supervisor exit {proc.returncode}; last lines:")
    print("  " + "\n  ".join(out.strip().splitlines()[-4:]))
    for line in (chaos / "events.jsonl").read_text().splitlines():
        ev = json.loads(line)
        if ev.get("event") not in ("checkpoint",):
            keep = {k: ev[k] for k in ("event", "reason", "exit_code", "resume", "step") if k in ev}
            print("  event:", json.dumps(keep))
    la, lb = losses(ref), losses(chaos)
    same = [s for s in la if la[s] == lb.get(s)]
    print(
        f"logged steps: ref {len(la)}, chaos {len(lb)}; bitwise-equal losses: {len(same)}/{len(la)}"
    )
    wa = load_file(str(latest_complete(ref).path / "model.safetensors"))
    wb = load_file(str(latest_complete(chaos).path / "model.safetensors"))
    diff = max((wa[k].float() - wb[k].float()).abs().max().item() for k in wa)
    verdict = "bitwise equal" if diff == 0 else "differ"
    print(f"final weights: max |ref - chaos| = {diff:.3g} ({verdict})")


if __name__ == "__main__":
    main()
