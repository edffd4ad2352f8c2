"""Which device tensors an object keeps outside a manager's tags: the census behind the rule
"every tensor the engine keeps beyond a step lives in a tag" (issue 17; DESIGN §2.2).

A tensor kept outside every tag can never be freed by a sleep: on the GPU it is residual (torch's
allocator holds it), and it is invisible to the audit. ``untagged_tensors`` walks an object graph
(attributes, slots, dicts, lists, tuples, sets; modules, classes and functions are not entered)
and lists every non-empty tensor on the manager's device whose first byte is no memory of the
manager, with the path it was reached by.

On the host backend the device *is* the CPU, so host-side staging buffers (pinned host memory on
a GPU) look like device tensors; their allocation sites declare them with ``host_staging`` and
the census leaves them out. A new buffer kept without a tag, or a staging buffer not declared,
is listed: the census fails where the rule is broken.
"""

from __future__ import annotations

import types
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import torch

_host_staging: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_OPAQUE = (str, bytes, bytearray, int, float, complex, bool, type(None), range, memoryview)
_NOT_ENTERED = (
    types.ModuleType,
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
)


class _Manager(Protocol):
    @property
    def backend(self) -> Any: ...
    def tag_of(self, memory: torch.Tensor | int) -> str | None: ...


def host_staging(tensor: torch.Tensor) -> torch.Tensor:
    """Declares ``tensor`` a host-side staging buffer (host memory by design, pinned on a GPU);
    returns it. The census leaves it out."""
    _host_staging[id(tensor)] = tensor
    return tensor


def is_host_staging(tensor: torch.Tensor) -> bool:
    return _host_staging.get(id(tensor)) is tensor


def untagged_tensors(
    root: object, mm: _Manager, *, skip: Iterable[object] = (), max_objects: int = 1_000_000
) -> list[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor reachable from ``root`` that lives on ``mm``'s device
    outside its tags. ``skip``: objects not to enter (the manager itself always is one)."""
    device = mm.backend.device
    found: list[tuple[str, torch.Tensor]] = []
    for path, tensor in _tensors(root, {id(mm), *(id(o) for o in skip)}, max_objects):
        if (
            tensor.device == device
            and tensor.numel() > 0
            and not is_host_staging(tensor)
            and mm.tag_of(tensor) is None
        ):
            found.append((path, tensor))
    return found


def _tensors(root: object, skip: set[int], max_objects: int) -> Iterator[tuple[str, torch.Tensor]]:
    seen = set(skip)
    queue: deque[tuple[str, object]] = deque([("root", root)])
    while queue and len(seen) < max_objects:
        path, obj = queue.popleft()
        if id(obj) in seen or isinstance(obj, _OPAQUE + _NOT_ENTERED):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            yield path, obj
            continue
        queue.extend(_children(path, obj))


def _children(path: str, obj: object) -> Iterator[tuple[str, object]]:
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield f"{path}[{key!r}]", value
        return
    if isinstance(obj, list | tuple | set | frozenset | deque):
        for index, value in enumerate(obj):
            yield f"{path}[{index}]", value
        return
    attributes = getattr(obj, "__dict__", None)
    if isinstance(attributes, dict):
        for name, value in attributes.items():
            yield f"{path}.{name}", value
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if isinstance(name, str) and name not in ("__dict__", "__weakref__"):
                value = getattr(obj, name, None)
                if value is not None:
                    yield f"{path}.{name}", value
