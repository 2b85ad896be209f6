"""A stand-in worker that follows the worker protocol (heartbeat.json, checkpoints/, exit codes,
SIGTERM → save → 75) and misbehaves on cue, so the supervisor can be tested without torch.

Run as `python standin_worker.py RUN_DIR RESUME LR_SCALE`. Attempt n follows plan.json[n] (the
last entry repeats). Plan keys: steps, step_time, ckpt_every, exit, hang_at (stop heartbeating
at that step), ignore_term, no_heartbeat, vram, torn_at (write a checkpoint with a bad hash),
hang_on_exit (report phase "finished", then never exit), write_s (once it has saved, its
heartbeats say its checkpoints take that long to write). Every attempt appends a line to
attempts.jsonl (pid, resume, lr_scale, the fault env).
"""

import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path


def main() -> None:
    run_dir, resume, lr_scale = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    plan = json.loads((run_dir / "plan.json").read_text())
    log = run_dir / "attempts.jsonl"
    n = len(log.read_text().splitlines()) if log.exists() else 0
    with open(log, "a") as f:
        f.write(
            json.dumps(
                {
                    "pid": os.getpid(),
                    "resume": resume,
                    "lr_scale": lr_scale,
                    "fault": os.environ.get("M3RUN_FAULT"),
                }
            )
            + "\n"
        )
    spec = plan[min(n, len(plan) - 1)]
    stop = []
    if spec.get("ignore_term"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda s, f: stop.append(s))

    def heartbeat(phase, step, **kw):
        hb = {
            "pid": os.getpid(),
            "phase": phase,
            "step": step,
            "total_steps": 1000,
            "loss": 5.0 - step / 100,
            "lr": 1e-3 * lr_scale,
            "ts": time.time(),
            **kw,
        }
        tmp = run_dir / f".hb.{os.getpid()}"
        tmp.write_text(json.dumps(hb))
        os.replace(tmp, run_dir / "heartbeat.json")

    def save(step, torn=False):
        root = run_dir / "checkpoints"
        root.mkdir(exist_ok=True)
        tmp = root / f".tmp-step_{step:08d}-{os.getpid()}"
        tmp.mkdir()
        files = {}
        for name in ("model.safetensors", "optim.pt"):
            data = os.urandom(256)
            (tmp / name).write_bytes(data)
            digest = hashlib.sha256(data).hexdigest()
            files[name] = {"sha256": "0" * 64 if torn else digest, "bytes": len(data)}
        (tmp / "meta.json").write_text(
            json.dumps(
                {
                    "format_version": 1,
                    "step": step,
                    "files": files,
                    "saved_at": time.time(),
                    "lr_scale": scale,
                }
            )
        )
        final = root / f"step_{step:08d}"
        if final.exists():
            os.rename(final, root / f".del-{final.name}-{os.getpid()}")
        os.rename(tmp, final)

    if resume.isdigit():
        step = int(resume)
    elif resume == "latest" and (run_dir / "checkpoints").is_dir():
        steps = [int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step_*")]
        step = max(steps, default=0)
    else:
        step = 0
    # Like the real worker: the scale it trains at is its checkpoint's times --lr-scale.
    meta = run_dir / "checkpoints" / f"step_{step:08d}" / "meta.json"
    stored = json.loads(meta.read_text()).get("lr_scale", 1.0) if meta.exists() else 1.0
    scale = lr_scale * stored
    if spec.get("no_heartbeat"):
        time.sleep(1e9)
    heartbeat("startup", step)
    print(f"stand-in worker attempt {n} resume={resume} lr_scale={lr_scale}", flush=True)
    step_time = spec.get("step_time", 0.02)
    saved: dict = {}  # what its heartbeats say of its last checkpoint, once it has one
    for _ in range(spec.get("steps", 5)):
        if spec.get("hang_at") == step:
            print(f"hanging at step {step}", flush=True)
            time.sleep(1e9)
        time.sleep(step_time)
        step += 1
        heartbeat("training", step, step_time_s=step_time, vram_bytes=spec.get("vram"), **saved)
        print(f"step {step}", flush=True)
        if spec.get("torn_at") == step:
            save(step, torn=True)
        elif spec.get("ckpt_every") and step % spec["ckpt_every"] == 0:
            heartbeat("checkpointing", step, step_time_s=step_time)
            save(step)
            if "write_s" in spec:
                saved = {"checkpoint_time_s": 0.5, "checkpoint_write_s": spec["write_s"]}
        if stop:
            heartbeat("stopping", step)
            save(step)
            print(f"saved step {step} on SIGTERM", flush=True)
            sys.exit(75)
    if spec.get("hang_on_exit"):
        heartbeat("finished", step)
        time.sleep(1e9)
    sys.exit(spec.get("exit", 0))


if __name__ == "__main__":
    main()
