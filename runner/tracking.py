"""Which experiment tracker a run reports to, and whether it can start. Torch-free: `launch`
checks it before the first worker starts, so a missing extra or a missing login is one clear
error at launch rather than a worker that exits 78 behind a container's halt latch.

`log.tracker` is none (the default), wandb or tensorboard. The environment overrides it:
M3RUN_TRACKER names one outright, and WANDB_PROJECT set with no tracker configured means wandb
(the project is that variable's value). TensorBoard event files go to RUN_DIR/tensorboard/,
beside metrics.jsonl.

Both trackers get the same tags (`tracker_values`), grouped by prefix: train/ (loss, perplexity,
learning rate, gradient norm, tokens seen), eval/ (validation loss and perplexity) and system/
(throughput, MFU, step time, GPU memory); each tracker shows a prefix as a section of its own.
"""

from __future__ import annotations

import importlib.util
import netrc
import os
from collections.abc import Mapping

TRACKERS = ("none", "wandb", "tensorboard")
TRACKER_ENV = "M3RUN_TRACKER"
TENSORBOARD_DIR = "tensorboard"

# The tag of each tracked number, by metrics.jsonl record kind; a field without one (the record's
# step and time, the MFU's constant denominator) is not tracked.
TRACKER_TAGS: dict[str, dict[str, str]] = {
    "train": {
        "loss": "train/loss",
        "ppl": "train/ppl",
        "lr": "train/lr",
        "grad_norm": "train/grad_norm",
        "tokens_seen": "train/tokens_seen",
        "tokens_per_s": "system/tokens_per_s",
        "mfu": "system/mfu",
        "step_time_s": "system/step_time_s",
        "vram_bytes": "system/vram_bytes",
    },
    "eval": {"eval_loss": "eval/loss", "ppl": "eval/ppl"},
}


def tracker_values(record: Mapping[str, object]) -> dict[str, float]:
    """The numbers of a metrics record (its `kind` picks the tags) under their tracker tags."""
    tags = TRACKER_TAGS.get(str(record.get("kind")), {})
    return {
        tags[k]: v
        for k, v in record.items()
        if k in tags and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def resolve_tracker(configured: str, env: Mapping[str, str] = os.environ) -> str:
    chosen = env.get(TRACKER_ENV) or configured
    if chosen == "none" and env.get("WANDB_PROJECT"):
        return "wandb"
    return chosen


def why_chosen(configured: str, env: Mapping[str, str] = os.environ) -> str:
    """What selected the tracker, for messages: the variable or the config key."""
    if env.get(TRACKER_ENV):
        return f"{TRACKER_ENV}={env[TRACKER_ENV]}"
    if configured == "none" and env.get("WANDB_PROJECT"):
        return f"WANDB_PROJECT={env['WANDB_PROJECT']} is set"
    return f"log.tracker is {configured}"


def _wandb_logged_in(env: Mapping[str, str]) -> bool:
    if env.get("WANDB_API_KEY") or env.get("WANDB_MODE") in ("offline", "disabled"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def tracker_problem(
    configured: str, env: Mapping[str, str] = os.environ, *, check_login: bool = True
) -> str | None:
    """Why the chosen tracker cannot start here (naming the fix), or None. `check_login`: also
    require a wandb login (launch does; the worker lets wandb itself say what is wrong)."""
    kind = resolve_tracker(configured, env)
    why = why_chosen(configured, env)
    if kind not in TRACKERS:
        return f"{why}, which is not a tracker: use one of {', '.join(TRACKERS)}"
    if kind == "wandb" and importlib.util.find_spec("wandb") is None:
        return (
            f"{why} but wandb is not installed. Fix: pip install 'm3run[wandb]' (the image "
            "has it), or unset WANDB_PROJECT / set log.tracker: none"
        )
    if kind == "wandb" and check_login and not _wandb_logged_in(env):
        return (
            f"{why} but wandb has no login here. Fix: `wandb login`, or set WANDB_API_KEY "
            "(or WANDB_MODE=offline to log locally)"
        )
    if kind == "tensorboard" and importlib.util.find_spec("tensorboard") is None:
        return (
            f"{why} but tensorboard is not installed. Fix: pip install 'm3run[tensorboard]' "
            "(the image has it), or set log.tracker: none"
        )
    return None
