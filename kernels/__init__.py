"""Kernels of Mamba-3-Lite: the Mamba-3 scan (references beside the fast paths), the custom
operators of the SwiGLU MLP, of the residual add + RMSNorm and of the linear products, and the
loss's cross-entropy kernel."""

# The target that is no class: the loss (model/loss.py) and its kernel (cross_entropy.py) skip it.
IGNORE_INDEX = -100
