"""Tools around the Triton scan's launch plans: the tuner (``tuning.py``), the compile ahead of
the first launch (``precompile.py``) and the resource report compiled without a GPU
(``report.py``). The kernels never import them; the model's ``precompile_scan``, the smoke test,
`m3run tune-scan` and the benchmarks do."""
