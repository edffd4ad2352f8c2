"""A device's current CUDA stream in one C call, for the per-bucket path of an IPC refit.

``torch.cuda.current_stream(device)`` builds a new ``torch.cuda.Stream`` in Python every call:
8.6-9.4 us of host time on the H100 and H200 hosts measured, up to 20 us inside a refit
(``benchmarks/ipc_primitives.py``, RESULTS.md, 2026-12-06). The IPC receiver asks twice per
512 MiB bucket (to wait on the sender's event, to wait for its copy), beside a 0.26-0.36 ms copy.

``current_stream`` reads the raw stream (``cudaStream_t``) in one C call and returns the
``Stream`` object it made the first time it saw that raw stream on that device. A ``Stream`` is
its raw stream: a pool stream's never changes, and an external stream's id is its raw pointer,
so a kept object waits and synchronizes exactly as a fresh one would. Under
``torch.cuda.stream(s)`` the raw stream is ``s``'s, so ``s`` is what is returned.
"""

from __future__ import annotations

import torch

_MAX_KEPT = 64  # (device, raw stream) pairs; more (external streams come and go): start over
_kept: dict[tuple[int, int], torch.cuda.Stream] = {}


def current_stream(device: torch.device | int) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(device)``, cheaply (see above). CUDA must be initialized."""
    index = _index(device)
    key = (index, torch._C._cuda_getCurrentRawStream(index))
    stream = _kept.get(key)
    if stream is None:
        if len(_kept) >= _MAX_KEPT:
            _kept.clear()
        stream = _kept[key] = torch.cuda.current_stream(index)
    return stream


def _index(device: torch.device | int) -> int:
    if isinstance(device, int):
        return device
    return device.index if device.index is not None else torch.cuda.current_device()
