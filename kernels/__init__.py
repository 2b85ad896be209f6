"""Sequence-mixing kernels for Mamba-3-Lite: references beside the fast paths."""
