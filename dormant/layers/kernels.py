"""Which implementation a layer runs: Triton kernels on CUDA tensors, the torch reference
everywhere else.

The torch code in each layer is the reference: exact Hugging Face arithmetic, run on the CPU
and by the tests. On the GPU the hot layers switch to fused Triton kernels that compute the
same values, with the reference's rounding points (a decode step would otherwise launch about
60 small kernels per layer, and at batch 1 those launches cost more than reading the weights).

``DORMANT_TRITON=0`` in the environment, read once at import, keeps the reference on the GPU
too: the decode benchmark uses it to measure both side by side.
"""

from __future__ import annotations

import os

import torch

try:
    import triton  # noqa: F401

    IS_TRITON_AVAILABLE = True
except ImportError:  # CPU-only installs
    IS_TRITON_AVAILABLE = False

IS_TRITON_ENABLED = IS_TRITON_AVAILABLE and os.environ.get("DORMANT_TRITON", "1") != "0"


def use_triton(x: torch.Tensor) -> bool:
    """Whether ops on ``x`` run the Triton kernels."""
    return IS_TRITON_ENABLED and x.is_cuda


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
