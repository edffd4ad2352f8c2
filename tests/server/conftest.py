"""The server tests share the engine tests' checkpoints (a tiny Qwen3, seeds 1 and 2)."""

from tests.engine.conftest import checkpoint, other_checkpoint

__all__ = ["checkpoint", "other_checkpoint"]
