"""Kernels of Mamba-3-Lite: the Mamba-3 scan (references beside the fast paths) and the SwiGLU
MLP's custom operator."""

# The target that is no class: the loss (model/loss.py) and its kernel (cross_entropy.py) skip it.
IGNORE_INDEX = -100
