"""What a launch plan is: the chunk one scan call runs at and each kernel's launch configuration,
the defaults where no tuned plan exists, and the keys and entries the tables store plans under.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..launching import LaunchConfig
from ..triton_common import CHUNK_SIZES, Tiles

# The kernels a plan configures, by the names their launches give them.
KERNELS = ("fwd", "bwd_dstate", "bwd_chunk", "bwd_angle")

# Used where no table has an entry for the GPU architecture and shape: fits every supported
# architecture (sm_80 and newer) at every tile size, found by ptxas without spills on sm_80.
DEFAULT_CONFIGS: dict[str, LaunchConfig] = {
    "fwd": LaunchConfig(num_warps=4, num_stages=2),
    "bwd_dstate": LaunchConfig(num_warps=4, num_stages=1),
    "bwd_chunk": LaunchConfig(num_warps=4, num_stages=1),
    "bwd_angle": LaunchConfig(num_warps=4, num_stages=2),
}

# The kernels' chunk where no table has a plan: the main backward kernel is faster at 32 than
# at 64, and under the defaults it compiles for sm_80 without spills at 32 but spills at 64
# (docs/benchmarks.md has the times and the ptxas counts).
DEFAULT_CHUNK = 32

# The dot dtypes the kernels take, by the name the tables' keys give them.
DOT_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}
_DTYPE_NAMES = {dtype: name for name, dtype in DOT_DTYPES.items()}


@dataclass(frozen=True)
class Plan:
    """How one call runs: the chunk the kernels use (the result does not depend on it beyond
    rounding, so a table may pick another than the caller's) and each kernel's launch."""

    chunk: int
    configs: dict[str, LaunchConfig]


def dtype_name(dtype: torch.dtype) -> str:
    """The tables' name of a dot dtype (KeyError for one the kernels do not take)."""
    return _DTYPE_NAMES[dtype]


def shape_key(tiles: Tiles, dtype: torch.dtype) -> str:
    """The tables' key of a call: tile sizes and the dot dtype (fp32 tiles take twice the
    registers)."""
    return f"c{tiles.BT}-p{tiles.BP}-n{tiles.BN}-{dtype_name(dtype)}"


def untuned_plan(chunk_size: int) -> Plan:
    """What a call of ``chunk_size`` runs where no tuned plan exists: its chunk capped at
    DEFAULT_CHUNK, with DEFAULT_CONFIGS (the tuners time their plans against it)."""
    return Plan(min(chunk_size, DEFAULT_CHUNK), dict(DEFAULT_CONFIGS))


def entry_configs(entry: dict) -> dict[str, LaunchConfig]:
    """A table entry's configuration of every kernel, the default where it names none."""
    return {
        name: LaunchConfig(**entry[name]) if name in entry else DEFAULT_CONFIGS[name]
        for name in KERNELS
    }


def entry_plan(entry: dict) -> Plan:
    """The plan a table entry stores."""
    return Plan(int(entry["chunk"]), entry_configs(entry))


def entry_error(entry: dict) -> str | None:
    """Why a stored entry makes no plan (None: it does)."""
    if entry.get("chunk") not in CHUNK_SIZES:
        return f"chunk {entry.get('chunk')!r} is not one of {CHUNK_SIZES}"
    unknown = sorted(set(entry) - {"chunk", *KERNELS})
    if unknown:
        return f"unknown kernels {unknown}"
    try:
        entry_configs(entry)
    except (TypeError, ValueError) as e:
        return str(e)
    return None
