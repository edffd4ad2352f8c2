"""dormant: a sleep-mode LLM inference engine.

``dormant.memory`` is the tagged, sleepable memory layer (usable by any PyTorch engine);
``dormant.engine`` is the vLLM-style engine on top of it. ``LLM``, ``AsyncLLM`` and
``SamplingParams`` are importable from here.
"""

from typing import Any

__all__ = ["LLM", "AsyncLLM", "SamplingParams"]


def __getattr__(name: str) -> Any:  # the engine is imported only when asked for
    if name in __all__:
        from dormant import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'dormant' has no attribute {name!r}")
