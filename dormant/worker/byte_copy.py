"""Copies a contiguous byte range between two tensors, on the copy engines or on the SMs.

``Tensor.copy_`` between two contiguous uint8 CUDA tensors is a ``cudaMemcpyAsync``. With
``SM_COPIES`` set, ``copy_bytes`` runs ``torch.bitwise_or(src, 0, out=dst)`` on the widest integer
view both ranges allow instead (what the memory layer's ``sm_copy`` does on raw addresses): one
elementwise kernel, bit-exact for every bit pattern. The IPC refit copies each 512 MiB bucket
with it (``copy_plan._Run``); ``benchmarks/ipc_stages.py --sm-copies`` measures both ways.
"""

from __future__ import annotations

import torch
from torch import Tensor

SM_COPIES = False
_WORDS = ((4, torch.int32), (2, torch.int16))  # int32: what the memory layer's copies measured


def copy_bytes(dst: Tensor, src: Tensor) -> None:
    """``dst.copy_(src)`` for two 1-D contiguous uint8 tensors of one length: on the SMs when
    ``SM_COPIES`` is set, both are on one CUDA device and ``word_dtype`` finds a word."""
    word = word_dtype(dst, src) if SM_COPIES and dst.is_cuda and dst.device == src.device else None
    if word is None:
        dst.copy_(src)
    else:
        torch.bitwise_or(src.view(word), 0, out=dst.view(word))


def word_dtype(dst: Tensor, src: Tensor) -> torch.dtype | None:
    """The widest integer both byte ranges can be viewed as (int32, int16), each word aligned;
    None when neither fits (an odd length or address)."""
    for size, dtype in _WORDS:
        if _fits(dst, size) and _fits(src, size):
            return dtype
    return None


def _fits(tensor: Tensor, size: int) -> bool:
    """Whether ``tensor`` can be viewed as ``size``-byte words, each one aligned."""
    return (
        tensor.numel() % size == 0
        and tensor.storage_offset() % size == 0
        and tensor.data_ptr() % size == 0
    )
