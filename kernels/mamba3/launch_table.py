"""Launch configurations of the Triton scan kernels, by GPU architecture and tile shape.

Written by ``python bench/tune_scan.py`` on each GPU (it times every kernel under each candidate
configuration in one process and keeps the fastest), checked in, and read at launch by
:func:`kernels.mamba3.triton_common.launch_config`: a worker never autotunes. A shape or
architecture missing here runs the defaults of ``triton_common.DEFAULT_CONFIGS`` (logged once).
tests/kernels/test_triton_compile.py compiles every entry for sm_80 without a GPU.
"""

TABLE: dict[str, dict[str, dict[str, dict]]] = {}
