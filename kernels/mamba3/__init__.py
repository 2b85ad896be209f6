"""Mamba-3 SISO scan: recurrent and chunked PyTorch references behind one contract."""

from .api import (
    BACKENDS,
    BackendUnavailableError,
    mamba3_siso,
    mamba3_siso_recurrent,
    mamba3_siso_step,
    resolve_backend,
    triton_unavailable_reason,
    uses_triton_kernels,
)
from .naive import State, zero_state

__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "State",
    "mamba3_siso",
    "mamba3_siso_recurrent",
    "mamba3_siso_step",
    "resolve_backend",
    "triton_unavailable_reason",
    "uses_triton_kernels",
    "zero_state",
]
