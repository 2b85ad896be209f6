"""Scan inputs the kernel tests share."""

from __future__ import annotations


def slice_time(x: dict, lo: int, hi: int) -> dict:
    """The scan inputs of tokens [lo, hi) (per-head parameters unchanged)."""
    out = {}
    for key, val in x.items():
        if val is None or key in ("q_bias", "k_bias", "d"):
            out[key] = val
        elif key in ("adt", "dt", "trap"):
            out[key] = val[..., lo:hi]
        else:
            out[key] = val[:, lo:hi]
    return out
