"""Warm up, then capture: how the speculative graph sets (the verifier's, MTP's, the fused
rounds') capture their passes (GPU only).

Each pass is a padding (it makes every row a dummy row, outside any graph) and a body (what the
graph replays). Every body runs once first, on a side stream, so that its kernels are compiled
and loaded and its cuBLAS handle made outside any capture; then torch's cuBLAS workspaces are
cleared (a capture allocates its own, in the graph pool) and every pass is captured, in order,
into the manager's ``cuda_graph`` pool. The decode graphs (``cuda_graphs.py``) do the same with
their own bookkeeping of the residual.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import torch

from dormant.memory import MemoryManager
from dormant.memory.torch_usage import clear_cublas_workspaces

T = TypeVar("T")
Pass = tuple[Callable[[], object], Callable[[], T]]  # (padding, body)


def capture_passes(
    mm: MemoryManager, passes: Sequence[Pass[T]], label: str
) -> list[tuple[torch.cuda.CUDAGraph, T]]:
    """Warms every pass up, then captures each (see the module); returns (graph, the body's
    output) per pass, in order. ``label`` names the phase in the residual's rows."""
    stream = torch.cuda.Stream()
    captured: list[tuple[torch.cuda.CUDAGraph, T]] = []
    with torch.inference_mode():
        for pad, body in passes:
            pad()
            stream.wait_stream(torch.cuda.current_stream())  # after the padding's writes
            with torch.cuda.stream(stream):
                body()
            torch.cuda.current_stream().wait_stream(stream)
        clear_cublas_workspaces()
        pool = cast(Any, mm.graph_pool().id)  # torch types the handle loosely
        for pad, body in passes:
            pad()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                output = body()
            captured.append((graph, output))
    torch.cuda.synchronize()
    clear_cublas_workspaces()  # the warm-up stream's: nothing outlives capture untagged
    mm.residual.mark(label)
    return captured
