"""Logprobs on the device, and the step's one event-guarded device-to-host copy.

Every step packs what the host needs (the sampled tokens, and the logprobs where asked) into
one int32 device tensor, copies it with ``non_blocking=True`` into a reusable host buffer
(pinned on CUDA), and records an event; the host waits on that event only when it reads the
values (``HostCopy.wait``). float32 values travel as their bits. The host reads the packed
rows back with ``core/packed_logprobs.py`` (``unpack_logprobs``, ``PackedLogprobs``).

A packed logprobs row for ``k`` top tokens, ``3 + 2k`` int32 (``gather_logprobs``):

| columns          | what                                                            |
|------------------|-----------------------------------------------------------------|
| 0                | the token (sampled, or the actual next prompt token)            |
| 1                | its rank: 1 + the number of tokens with a strictly greater value |
| 2                | its value (float32 bits)                                         |
| 3 .. 3+k         | the top-k token ids, best first                                  |
| 3+k .. 3+2k      | their values (float32 bits)                                      |
"""

from __future__ import annotations

import numpy as np
import torch

from dormant.core.config import LogprobsMode
from dormant.core.packed_logprobs import NUM_FIXED_COLUMNS as _NUM_FIXED_COLUMNS
from dormant.core.packed_logprobs import unpack_logprobs as unpack_logprobs  # the host side
from dormant.layers.kernels import use_triton
from dormant.memory.census import host_staging

_MAX_FUSED_TOP = 32  # dormant.layers.triton_logprobs.MAX_FUSED_TOP (that module needs Triton)


def packed_width(num_top: int) -> int:
    """int32 columns of a packed row with ``num_top`` top tokens."""
    return _NUM_FIXED_COLUMNS + 2 * num_top


def gather_logprobs(values: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> torch.Tensor:
    """Packs, per row of ``values`` (float32 [n, V]: logprobs or logits), the value and rank of
    ``token_ids`` (int [n]) and the ``num_top`` best tokens: int32 [n, 3 + 2 * num_top]."""
    tokens = token_ids.long().unsqueeze(-1)
    token_values = values.gather(-1, tokens)
    ranks = (values > token_values).sum(dim=-1, keepdim=True).add_(1)
    columns = [tokens.int(), ranks.int(), token_values.view(torch.int32)]
    if num_top > 0:
        top_values, top_ids = values.topk(num_top, dim=-1)
        columns += [top_ids.int(), top_values.view(torch.int32)]
    return torch.cat(columns, dim=-1)


def trim_top(packed: torch.Tensor, num_top: int) -> torch.Tensor:
    """Packed rows (int32 [..., 3 + 2K]) cut to their first ``num_top <= K`` top tokens."""
    carried = (packed.shape[-1] - _NUM_FIXED_COLUMNS) // 2
    ids_end = _NUM_FIXED_COLUMNS + num_top
    values = packed[..., _NUM_FIXED_COLUMNS + carried :][..., :num_top]
    return torch.cat([packed[..., :ids_end], values], dim=-1)


def packed_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    num_top: int,
    mode: LogprobsMode,
    live_top: torch.Tensor | None = None,
) -> torch.Tensor:
    """``gather_logprobs`` of what the logprobs report for ``logits`` (float32 [n, V]): their
    log-softmax, or (``*_logits`` modes) the logits themselves. ``logits`` is not modified.

    On CUDA with Triton (and at most 32 top tokens) the log-softmax is never materialised: one
    fused read of the logits gives each row's log-normaliser, the token's logprob and rank, and
    the top-k (``dormant.layers.triton_logprobs``). There, ``live_top`` (a device int32 [1],
    at most ``num_top``; a graph's, set per replay) limits the top tokens computed: columns past
    it are undefined. Elsewhere all ``num_top`` are computed.
    """
    if mode.endswith("_logits"):
        return gather_logprobs(logits, token_ids, num_top)
    if not (use_triton(logits) and logits.stride(-1) == 1 and num_top <= _MAX_FUSED_TOP):
        return gather_logprobs(logits.log_softmax(dim=-1), token_ids, num_top)
    from dormant.layers.triton_logprobs import fused_logprobs

    packed = torch.empty(
        (logits.shape[0], packed_width(num_top)), dtype=torch.int32, device=logits.device
    )
    fused_logprobs(logits, token_ids, num_top, packed, live_top=live_top)
    return packed


class HostCopy:
    """The step's one device-to-host copy: a reusable host buffer and the event that guards it.

    ``start`` concatenates int32 device tensors, copies them without blocking and records the
    event; ``wait`` blocks on the event and returns the host values (a view of the buffer,
    valid until the next ``start``).
    """

    def __init__(self, device: torch.device, capacity: int = 1 << 14) -> None:
        self.device = device
        self._is_cuda = device.type == "cuda"
        self._host = self._allocate(capacity)
        self._event = torch.cuda.Event() if self._is_cuda else None
        self._num_values = 0

    def start(self, parts: list[torch.Tensor]) -> None:
        flat = torch.cat([p.reshape(-1).to(torch.int32) for p in parts])
        self._num_values = flat.numel()
        if self._num_values > self._host.numel():
            self._host = self._allocate(max(self._num_values, 2 * self._host.numel()))
        self._host[: self._num_values].copy_(flat, non_blocking=self._is_cuda)
        if self._event is not None:
            self._event.record()

    def wait(self) -> np.ndarray:
        if self._event is not None:
            self._event.synchronize()
        return self._host[: self._num_values].numpy()

    def _allocate(self, capacity: int) -> torch.Tensor:
        return host_staging(torch.empty(capacity, dtype=torch.int32, pin_memory=self._is_cuda))
