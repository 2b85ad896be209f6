"""Launch plans of the Triton scan kernels, by GPU architecture and shape key.

Written by ``python bench/tune_scan.py`` on each GPU (one process: every kernel timed alone
under each candidate configuration, at each candidate chunk, the fastest kept), checked in, and
read at launch by :func:`m3run.kernels.mamba3.plans.plan_for`: a worker never autotunes. The
key is the caller's chunk, the tiles and the dot dtype; ``chunk`` is the chunk the kernels run
at (the result does not depend on it beyond rounding). A plan `m3run tune-scan` stored on the
machine (``plans/local.py``) comes first; a shape or architecture missing from both runs the
caller's chunk with ``plans.DEFAULT_CONFIGS`` (a warning, once, names the command).
tests/kernels/test_triton_cpu.py compiles every entry for sm_80 and sm_90 without a GPU.
"""

TABLE: dict[str, dict[str, dict[str, dict]]] = {
    "sm90": {
        "c16-p64-n64-bf16": {
            "bwd_angle": {"bv": 0, "hb": 8, "maxnreg": None, "num_stages": 1, "num_warps": 1},
            "bwd_chunk": {"bv": 0, "maxnreg": None, "num_stages": 1, "num_warps": 2},
            "bwd_dstate": {"bv": 0, "maxnreg": 128, "num_stages": 2, "num_warps": 4},
            "chunk": 32,
            "fwd": {"bv": 0, "maxnreg": None, "num_stages": 3, "num_warps": 4, "wg": 1},
        },
        "c32-p64-n64-bf16": {
            "bwd_angle": {"bv": 0, "hb": 8, "maxnreg": None, "num_stages": 1, "num_warps": 1},
            "bwd_chunk": {"bv": 0, "maxnreg": None, "num_stages": 1, "num_warps": 2},
            "bwd_dstate": {"bv": 0, "maxnreg": 128, "num_stages": 2, "num_warps": 4},
            "chunk": 32,
            "fwd": {"bv": 0, "maxnreg": None, "num_stages": 3, "num_warps": 4, "wg": 1},
        },
        "c64-p64-n64-bf16": {
            "bwd_angle": {"bv": 0, "hb": 8, "maxnreg": None, "num_stages": 1, "num_warps": 1},
            "bwd_chunk": {"bv": 0, "maxnreg": None, "num_stages": 1, "num_warps": 2},
            "bwd_dstate": {"bv": 0, "maxnreg": 128, "num_stages": 2, "num_warps": 4},
            "chunk": 32,
            "fwd": {"bv": 0, "maxnreg": None, "num_stages": 3, "num_warps": 4, "wg": 1},
        },
    },
}
