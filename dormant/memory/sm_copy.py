"""Copies bytes with elementwise kernels instead of the copy engines (copy_path.py says when).

``sm_copy(dst, src, nbytes, device)`` views both ranges as tensors on ``device`` (dlpack.py's
``tensor_at``, no CuPy) and runs ``torch.bitwise_or(src, 0, out=dst)`` on integer views:
bit-exact for every bit pattern, and not a ``cudaMemcpy``, which ``Tensor.copy_`` between two
contiguous CUDA tensors would be. On CUDA the kernel runs on torch's current stream and reads or
writes pinned host memory through its device mapping (pass device addresses: host_mappings.py),
so a host-to-device copy crosses PCIe on the SMs' loads, not on the copy engines. On the CPU
(the host backend) it is the same code on CPU tensors.

A range is cut into at most three pieces (``plan_pieces``)::

    head   uint8            up to the first address where dst is 16-byte aligned (or word-aligned
                            when dst and src cannot both be 16-byte aligned)
    body   int32 / int16    the words in between: 4-byte words when dst - src is a multiple of 4,
                            2-byte ones when it is a multiple of 2; 16-byte alignment lets torch's
                            kernel load 16 bytes a thread
    tail   uint8            what is left after the last whole word

When dst - src is odd, the whole range is one uint8 piece. int32 is what benchmarks measured
(50 GB/s host-to-device on the H200, release_contention.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dormant.memory.dlpack import tensor_at

_VECTOR_BYTES = 16


class Piece(NamedTuple):
    """``nbytes`` at ``offset`` into both ranges, copied as ``dtype`` elements."""

    offset: int
    nbytes: int
    dtype: torch.dtype


def plan_pieces(dst: int, src: int, nbytes: int) -> list[Piece]:
    """The pieces covering ``[0, nbytes)`` in order, each aligned to its element size at both
    ``dst + offset`` and ``src + offset``. Empty for ``nbytes <= 0``."""
    if nbytes <= 0:
        return []
    distance = dst - src
    word, dtype = next((w, d) for w, d in ((4, torch.int32), (2, torch.int16), (1, None))
                       if distance % w == 0)  # fmt: skip
    if dtype is None:
        return [Piece(0, nbytes, torch.uint8)]
    align = _VECTOR_BYTES if distance % _VECTOR_BYTES == 0 else word
    head = min(nbytes, -dst % align)
    body = (nbytes - head) // word * word
    tail = nbytes - head - body
    pieces = [Piece(0, head, torch.uint8), Piece(head, body, dtype),
              Piece(head + body, tail, torch.uint8)]  # fmt: skip
    return [p for p in pieces if p.nbytes]


def sm_copy(dst: int, src: int, nbytes: int, device: torch.device) -> None:
    """Copies ``nbytes`` from ``src`` to ``dst`` (addresses valid on ``device``) with
    elementwise kernels; on CUDA, asynchronously on torch's current stream.

    Preconditions: both ranges stay valid until the kernels are done (the caller waits on the
    stream) and do not overlap.
    """
    for piece in plan_pieces(dst, src, nbytes):
        out = _view(dst + piece.offset, piece.nbytes, device, piece.dtype)
        torch.bitwise_or(_view(src + piece.offset, piece.nbytes, device, piece.dtype), 0, out=out)


def _view(address: int, nbytes: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return tensor_at(address, nbytes, device, _nothing).view(dtype)


def _nothing() -> None:
    """The memory belongs to the caller: a view's death frees nothing."""
