"""dormant: a sleep-mode LLM inference engine.

``dormant.memory`` is the tagged, sleepable memory layer (usable by any PyTorch engine);
``dormant.engine`` is the vLLM-style engine on top of it. ``LLM``, ``AsyncLLM`` and
``SamplingParams`` are importable from here, and ``install_as_vllm()`` registers dormant under
vLLM's module names for frameworks that ``import vllm``.
"""

from typing import Any

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "install_as_vllm"]


def install_as_vllm() -> Any:
    """Registers dormant as ``vllm`` (see ``dormant.vllm_compat``); returns that module."""
    from dormant.vllm_compat import install_as_vllm as install

    return install()


def __getattr__(name: str) -> Any:  # the engine is imported only when asked for
    if name in __all__:
        from dormant import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'dormant' has no attribute {name!r}")
