"""Torch integration (CUDA): capture scopes and sleepable CUDA-graph pools (DESIGN §2.4).

``mm.capture(tag)`` routes every torch allocation made in scope, on this thread, into a
``torch.cuda.MemPool`` whose allocator is this manager: one pool per (tag, device), backed by a
pluggable allocator whose malloc/free are ctypes callbacks into ``raw_alloc``/``raw_free``.
``mm.graph_pool(tag)`` is the same pool, for ``torch.cuda.graph(g, pool=mm.graph_pool().id)``,
so a graph's private memory sleeps with its tag.

Capture is dangerous by nature: everything allocated in scope inherits the tag, metadata
included. That is the bug class of DESIGN §2.5, so capture allocations are *undeclared*: the
audit lists them with their call sites, and strict mode refuses to discard them until
``declare_backing`` says they are meant to be. Prefer the explicit API (``mm.empty``).

PyTorch pitfalls handled here:
- pools and allocators are kept alive for the manager's lifetime (pytorch#146431);
- ``expandable_segments`` is switched off inside a scope (pytorch#147851: expandable segments
  do not go through a pool's allocator; recent torch skips them for such pools itself, and the
  switch keeps versions without that check correct). Tested under
  ``expandable_segments:True``: the scope routes into its tag, the setting is back on outside;
- freed capture memory stays cached in the tag's pool, sleeps with it and is reused by the next
  capture; ``torch.cuda.empty_cache()`` did not return it on torch 2.11 (pytorch#145168).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from dormant.memory.backend import Backend
from dormant.memory.errors import MemoryLayerError

_ALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
_FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)

_scope = threading.local()
_live_tag_pools: weakref.WeakSet[TagPools] = weakref.WeakSet()
_exiting: list[bool] = []  # a container: callbacks bind it, it survives module teardown


@atexit.register
def _keep_pools_past_exit() -> None:
    _exiting.append(True)
    for tag_pools in list(_live_tag_pools):
        for pool in tag_pools._pools.values():
            _make_immortal(pool)


def in_capture_scope() -> bool:
    """Whether this thread is inside ``mm.capture``: torch allocations would come back to us."""
    return getattr(_scope, "depth", 0) > 0


def check_not_capturing(what: str) -> None:
    """Raises MemoryLayerError inside a capture scope (``what`` is the refused call)."""
    if in_capture_scope():
        raise MemoryLayerError(
            f"{what} inside a capture scope: its own torch allocations would be captured "
            "into a tag. Leave the `with mm.capture(...)` block first."
        )


class TagPools:
    """One MemPool per tag, allocating through ``alloc(nbytes, tag)`` / ``free(address)``; only on
    the cuda backend, only for tags ``check_tags`` knows (it raises for others).

    The callbacks and allocators live as long as the process (a pool may outlive this object
    while a graph still uses it). The pools themselves are dropped by ``release`` when the manager
    closes, so their cached memory comes back; any still alive at exit are kept alive instead, so
    that interpreter teardown never destroys one and calls back into Python.
    """

    def __init__(
        self,
        alloc: Callable[[int, str], int],
        free: Callable[[int], None],
        backend: Backend,
        check_tags: Callable[[list[str]], object],
    ) -> None:
        self._alloc, self._free = alloc, free
        self._device, self._check_tags = backend.device, check_tags
        self._pools: dict[str, torch.cuda.MemPool] = {}
        _live_tag_pools.add(self)

    def pool(self, tag: str, what: str = "graph_pool()") -> torch.cuda.MemPool:
        """The pool of ``tag``. Raises MemoryLayerError off the cuda backend (``what`` names the
        refused call), and what ``check_tags`` raises for an unknown tag."""
        require_cuda(self._device, what)
        self._check_tags([tag])
        if tag not in self._pools:
            self._pools[tag] = self._make_pool(tag)
        return self._pools[tag]

    @contextmanager
    def capture(self, tag: str) -> Iterator[None]:
        """``capture_scope`` into the pool of ``tag`` (its checks first)."""
        with capture_scope(self.pool(tag, "capture()")):
            yield

    def _make_pool(self, tag: str) -> torch.cuda.MemPool:
        exiting = _exiting

        def on_alloc(nbytes: int, device: int, stream: int) -> int:
            if exiting:
                return 0
            try:
                return self._alloc(nbytes, tag)
            except Exception as error:  # a NULL return makes torch raise its OOM error
                _report(f"dormant: capture allocation of {nbytes} bytes in {tag!r} failed", error)
                return 0

        def on_free(address: int, nbytes: int, device: int, stream: int) -> None:
            if exiting:  # the process is ending: its memory goes with it
                return
            try:
                self._free(address)
            except Exception as error:
                _report(f"dormant: capture free of {address:#x} in {tag!r} failed", error)

        alloc_cb, free_cb = _ALLOC(on_alloc), _FREE(on_free)
        alloc_ptr = ctypes.cast(alloc_cb, ctypes.c_void_p).value
        free_ptr = ctypes.cast(free_cb, ctypes.c_void_p).value
        assert alloc_ptr is not None and free_ptr is not None, "a ctypes callback has an address"
        allocator = torch._C._cuda_customAllocator(alloc_ptr, free_ptr)
        for obj in (alloc_cb, free_cb, allocator):
            _make_immortal(obj)
        return torch.cuda.MemPool(allocator)

    def release(self) -> None:
        """Drops the pools: each is destroyed (returning its cached memory through ``free``) as
        soon as no graph or tensor uses it any more."""
        self._pools.clear()
        _live_tag_pools.discard(self)


@contextmanager
def capture_scope(pool: torch.cuda.MemPool) -> Iterator[None]:
    """Routes this thread's torch allocations into ``pool`` (nestable; exception-safe)."""
    _scope.depth = getattr(_scope, "depth", 0) + 1
    try:
        with _expandable_segments_off(), torch.cuda.use_mem_pool(pool):
            yield
    finally:
        _scope.depth -= 1


@contextmanager
def _expandable_segments_off() -> Iterator[None]:
    if "expandable_segments:True" not in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        yield
        return
    torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    try:
        yield
    finally:
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")


def require_cuda(device: torch.device, what: str) -> None:
    if device.type != "cuda":
        raise MemoryLayerError(
            f"{what} routes torch's CUDA allocations and needs the cuda backend; on the host "
            "backend use the explicit API (mm.empty / mm.raw_alloc)"
        )


def _make_immortal(obj: Any) -> None:
    """Keeps ``obj`` alive until the process ends: allocators and callbacks must outlive every
    pool, tensor and graph using them (pytorch#146431), and a pool destroyed during interpreter
    teardown would call back into Python after it is gone (a segfault at exit was seen on the
    H200 with pools left to teardown; that this is its cause is inferred, not proven)."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def _report(message: str, error: BaseException) -> None:
    import sys
    import traceback

    print(message + ": " + "".join(traceback.format_exception_only(error)).strip(), file=sys.stderr)
