"""Whether a save on a stop fits in the time the stop leaves it.

A cloud's preemption notice leaves the VM a fixed time (AWS about 2 minutes, GCP about 30 s,
Azure at least 30 s); a save that needs more than SAVE_BUDGET_SHARE of it may not complete
before the VM goes. A user or container stop gives the worker supervisor.stop_grace_s from its
SIGTERM before the SIGKILL. The supervisor says at launch whether a save fits, from the write
speed and checkpoint size the smoke test measured (:func:`launch_stop_save`), and warns during
the run from the checkpoint write times the heartbeat reports (:class:`SaveBudget`); both weigh
the save through :func:`stop_save_fit`. Torch-free, and no network: the watchers live in
preemption.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from m3run.runner.protocol import Heartbeat, StopSaveFigures
from m3run.runner.supervisor.settings import SupervisorSettings

# GCP sends no deadline; its documented preemption notice is 30 s before the VM stops.
GCP_NOTICE_S = 30.0
# The time each provider's notice gives before the VM stops: AWS two minutes, GCP 30 s, Azure at
# least 30 s for a spot eviction.
NOTICE_S = {"aws": 120.0, "gcp": GCP_NOTICE_S, "azure": 30.0}
# A save on a notice that needs more than this share of the notice is warned about.
SAVE_BUDGET_SHARE = 0.75


def _figure(x: float) -> str:
    """A measured figure to the precision that matters: 4,979 or 11, but 1.6."""
    return f"{x:,.0f}" if x >= 10 else f"{x:.1f}"


def stop_save_fit(
    parts: Sequence[tuple[float, str]], provider: str | None, stop_grace_s: float | None = None
) -> tuple[bool, str]:
    """Whether a save on a stop fits, and the line that says so (with the fixes when it does
    not). ``parts``: what the save's time is made of, (seconds, in words). ``provider``: the
    cloud whose notice the save must fit in SAVE_BUDGET_SHARE of; None for a user or container
    stop, which leaves the worker ``stop_grace_s`` from its SIGTERM on."""
    need = sum(seconds for seconds, _ in parts)
    if provider is not None:
        total = NOTICE_S[provider]
        article = "an" if provider[0] in "aeiou" else "a"
        limit = SAVE_BUDGET_SHARE * total
        window = f"the {total:.0f} s {article} {provider} notice gives"
        stop, lost = "a save on a preemption notice", "a preemption may lose"
        more_time = "lower supervisor.preemption_poll_s"
    else:
        if stop_grace_s is None:
            raise ValueError("a stop without a provider's notice needs its stop_grace_s")
        total = limit = stop_grace_s
        window = f"the {stop_grace_s:g} s stop grace (supervisor.stop_grace_s)"
        stop, lost = "a save on a stop", "a stop may kill the worker mid-save and lose"
        more_time = "raise supervisor.stop_grace_s (and the container's stop timeout above it)"
    line = f"{stop} takes about {_figure(need)} s ({', '.join(what for _, what in parts)})"
    if need <= limit:
        return True, f"{line}: it fits in {window}"
    fits = "more than" if need > total else "most of"
    return False, (
        f"{line}, {fits} {window}: {lost} the steps since the last complete checkpoint. Fix: "
        f"put the run dir on faster local storage, {more_time}, or checkpoint more often "
        "(checkpoint.interval_steps) to lose fewer steps"
    )


def launch_stop_save(
    figures: StopSaveFigures, provider: str | None, poll_s: float, stop_grace_s: float
) -> tuple[bool, str]:
    """At launch: whether a save on a stop fits, from what the smoke test measured. The save
    is the notice seen within a poll (a stop signal is forwarded at once), the step under way
    (not timed before training), and the stop's own save: one full checkpoint written at the
    measured speed."""
    parts = [] if provider is None else [(poll_s, f"the notice seen within {poll_s:g} s")]
    size, speed = figures.checkpoint_bytes / 2**20, figures.write_bytes_per_s / 1e6
    parts += [
        (0.0, "a step not yet timed"),
        (
            figures.write_s,
            f"{_figure(size)} MiB at the {_figure(speed)} MB/s the smoke test measured on this "
            "run dir's disk",
        ),
    ]
    return stop_save_fit(parts, provider, stop_grace_s)


def say_stop_save(
    figures: StopSaveFigures | None,
    provider: str | None,
    s: SupervisorSettings,
    emit: Callable[..., None],
) -> None:
    """The launch's line on a save on a stop (:func:`launch_stop_save`), through ``emit(event,
    **fields)``: a warning when it does not fit. ``provider``: the cloud whose notices are
    watched, or None. Nothing without figures (no smoke test, or a skipped one whose passing
    record predates them)."""
    if figures is None:
        return
    fits, line = launch_stop_save(figures, provider, s.preemption_poll_s, s.stop_grace_s)
    emit(
        "stop_save",
        reason=line,
        level="info" if fits else "warning",
        fits=fits,
        provider=provider,
        **figures.to_dict(),
    )


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
    parts = [
        (poll_s, f"the notice seen within {poll_s:g} s"),
        (step_s, f"a step of {step_s:.1f} s"),
        (stall_s, f"{stall_s:.1f} s of stall"),
        (write_s, f"{write_s:.1f} s to write the checkpoint"),
    ]
    fits, line = stop_save_fit(parts, provider)
    return None if fits else line


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
