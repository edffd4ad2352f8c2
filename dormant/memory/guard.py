"""The pointer guard (DESIGN §2.5): addresses that captured graphs depend on must never change.

``guard_addresses(name, tensors)`` records data pointers; every sleep and wake verifies them. Pass a
callable instead of tensors to guard *bindings*: the callable is re-evaluated at each check, so an
attribute rebound to a newly allocated tensor (vLLM's failed ``post_kv_cache_wake_up`` fix) is
caught even though the old tensor object still holds its old address.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dormant.memory.errors import PointerGuardError

TensorSource = Sequence[torch.Tensor] | Callable[[], Sequence[torch.Tensor]]


@dataclass(frozen=True)
class _Entry:
    source: TensorSource
    addresses: tuple[int, ...]


def _resolve(source: TensorSource) -> tuple[torch.Tensor, ...]:
    return tuple(source() if callable(source) else source)


class PointerGuard:
    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def add(self, name: str, source: TensorSource) -> None:
        """Records the current addresses of ``source``'s tensors under ``name`` (replacing any)."""
        tensors = _resolve(source)
        self._entries[name] = _Entry(source, tuple(t.data_ptr() for t in tensors))

    def remove(self, name: str) -> None:
        if self._entries.pop(name, None) is None:
            raise KeyError(f"no pointer guard named {name!r}; guards: {sorted(self._entries)}")

    def clear(self) -> None:
        """Forgets every guard, and with them what their sources hold (a closed manager's)."""
        self._entries.clear()

    def verify(self) -> None:
        """Raises PointerGuardError naming every tensor whose address changed."""
        problems = []
        for name, entry in self._entries.items():
            now = tuple(t.data_ptr() for t in _resolve(entry.source))
            if len(now) != len(entry.addresses):
                problems.append(f"{name}: {len(entry.addresses)} tensors guarded, now {len(now)}")
                continue
            for i, (old, new) in enumerate(zip(entry.addresses, now, strict=True)):
                if old != new:
                    problems.append(f"{name}[{i}]: address {old:#x} is now {new:#x}")
        if problems:
            raise PointerGuardError(
                "guarded addresses changed; CUDA graphs captured over them would read stale or "
                "freed memory:\n  " + "\n  ".join(problems) + "\nKeep graph-visible tensors "
                "allocated once and never replace them (write into them in place instead)."
            )
