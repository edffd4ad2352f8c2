"""Where a rank's memory lives: the memory manager's device for ``EngineConfig.device``."""

from __future__ import annotations

import torch


def memory_device(device: str, local_rank: int) -> str:
    """``"auto"``: the rank's GPU where CUDA is available, else the host backend; ``"cpu"``: the
    host backend; ``"cuda"``: the rank's GPU; anything else (``"cuda:1"``, ``"host"``) as is."""
    if device == "auto":
        return f"cuda:{local_rank}" if torch.cuda.is_available() else "host"
    if device == "cpu":
        return "host"
    if device == "cuda":
        return f"cuda:{local_rank}"
    return device
