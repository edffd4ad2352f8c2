"""``open_backend``: the backend for a device name (kept apart from the protocol in backend.py,
which the backends themselves import)."""

from __future__ import annotations

import torch

from dormant.memory.backend import Backend


def open_backend(
    device: str | torch.device | Backend, *, host_capacity: int | None = None
) -> Backend:
    """The backend for ``device``: ``"cuda[:N]"``, ``"host"``/``"cpu"``, ``"auto"``, or a
    ``Backend`` (returned as it is)."""
    if not isinstance(device, str | torch.device):
        return device
    name = str(device)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "host"
    if name.startswith("cuda"):
        if host_capacity is not None:
            raise ValueError("host_capacity applies to the host backend only")
        from dormant.memory.cuda_backend import CudaBackend

        index = torch.device(name).index
        return CudaBackend(torch.cuda.current_device() if index is None else index)
    if name in ("host", "cpu"):
        from dormant.memory.host_backend import HostBackend

        return HostBackend(capacity=host_capacity)
    raise ValueError(f"unknown device {device!r}; use 'cuda', 'cuda:N', 'host' or 'auto'")
