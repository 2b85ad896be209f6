"""Kernels of Mamba-3-Lite: the Mamba-3 scan (references beside the fast paths) and the SwiGLU
MLP's custom operator."""
