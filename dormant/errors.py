"""The root of the engine's errors, below every layer that raises them (models, core, worker,
engine), so that each can derive from it without importing upward. ``dormant.memory`` has its
own root, ``MemoryLayerError``: the memory layer never imports the engine."""

from __future__ import annotations


class EngineError(RuntimeError):
    """Base class of every error the engine raises (not of the memory layer's)."""
