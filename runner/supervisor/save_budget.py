"""Whether a save on a preemption notice fits in the time the notice gives.

Each provider's notice leaves the VM a fixed time (AWS about 2 minutes, GCP about 30 s, Azure at
least 30 s); a save that needs more than SAVE_BUDGET_SHARE of it may not complete before the VM
goes. The supervisor checks it during the run from the checkpoint write times the heartbeat
reports (:class:`SaveBudget`). Torch-free, and no network: the watchers live in preemption.py.
"""

from __future__ import annotations

from m3run.runner.protocol import Heartbeat

# GCP sends no deadline; its documented preemption notice is 30 s before the VM stops.
GCP_NOTICE_S = 30.0
# The time each provider's notice gives before the VM stops: AWS two minutes, GCP 30 s, Azure at
# least 30 s for a spot eviction.
NOTICE_S = {"aws": 120.0, "gcp": GCP_NOTICE_S, "azure": 30.0}
# A save on a notice that needs more than this share of the notice is warned about.
SAVE_BUDGET_SHARE = 0.75


def save_budget_warning(
    provider: str, poll_s: float, step_s: float | None, stall_s: float | None, write_s: float | None
) -> str | None:
    """Why a preemption notice from ``provider`` would leave this run too little time to save,
    or None while a save fits in SAVE_BUDGET_SHARE of it (or no checkpoint was written yet). On
    a notice the worker learns of it up to one poll later, finishes its step, stalls to snapshot
    its state (``stall_s``) and writes the checkpoint (``write_s``), as its last one took."""
    if write_s is None or provider not in NOTICE_S:
        return None
    step_s, stall_s = step_s or 0.0, stall_s or 0.0
    need = poll_s + step_s + stall_s + write_s
    notice = NOTICE_S[provider]
    if need <= SAVE_BUDGET_SHARE * notice:
        return None
    fits = "more than" if need > notice else "most of"
    return (
        f"a save on a preemption notice takes about {need:.0f} s (the notice seen within "
        f"{poll_s:g} s, a step of {step_s:.1f} s, {stall_s:.1f} s of stall, {write_s:.1f} s to "
        f"write the checkpoint), {fits} the {notice:.0f} s a {provider} notice gives: a "
        "preemption may lose the steps since the last complete checkpoint. Fix: put the run dir "
        "on faster local storage, lower supervisor.preemption_poll_s, or checkpoint more often "
        "(checkpoint.interval_steps) to lose fewer steps"
    )


class SaveBudget:
    """The supervisor's check, once a run, that a notice leaves the worker time to save: each
    heartbeat that reports a checkpoint's write time goes through :func:`save_budget_warning`
    until one does not fit; :meth:`check` returns that warning once, then None."""

    def __init__(self, provider: str, poll_s: float) -> None:
        self.provider, self.poll_s = provider, poll_s
        self.warned = False

    def check(self, hb: Heartbeat | None) -> str | None:
        if self.warned or hb is None or hb.checkpoint_write_s is None:
            return None
        why = save_budget_warning(
            self.provider, self.poll_s, hb.step_time_s, hb.checkpoint_time_s, hb.checkpoint_write_s
        )
        self.warned = why is not None
        return why
