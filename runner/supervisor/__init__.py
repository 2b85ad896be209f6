"""The supervisor side (torch-free): `launch` takes the run dir and starts `supervisor.Supervisor`,
the loop composed of small parts (worker, hang, checkpoints, restarts, stops, preflight, state,
events, mirror_sync), with the checkpoint mirror (mirror) and cloud preemption notices
(preemption). It never imports the worker side: the two meet in runner.protocol and the run
directory."""
