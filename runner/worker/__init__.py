"""The training worker: the torch side of a run.

`main` is the entry (`python -m m3run.runner.train`), `trainer` the loop it runs; the loop delegates
to `checkpointing` (sync and background saves, restore), `telemetry` (heartbeat, metrics,
console, tracker), `build` (device, precision, model, optimizer), `dist` (torchrun), `schedule`
(the learning rate) and `faults` (the test-only M3RUN_FAULT hook). `smoke` is the preflight
smoke test and its child entry, `rank` torchrun's per-rank entry. Nothing here imports the
supervisor: the two sides meet in runner.protocol and the run directory.
"""
