"""Mamba-3-Lite: config and presets (torch-free), the mixer, the MLP and the language model.

``from m3run.model import ModelConfig`` stays torch-free so light processes (the supervisor, the
CLI's status commands) can read configs; the torch modules load on first access.
"""

from .config import PRESETS, ModelConfig

__all__ = ["PRESETS", "Mamba3LM", "ModelConfig"]


def __getattr__(name: str):
    if name == "Mamba3LM":
        from .lm import Mamba3LM

        return Mamba3LM
    raise AttributeError(f"module 'model' has no attribute {name!r}")
