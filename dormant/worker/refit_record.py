"""Which weights of one rank hold current values (DESIGN §3 invariant 8).

Every path that writes weights ends in ``CausalLM.load_weights`` (``update_weights``,
``reload_weights``, a framework's ``model.load_weights`` through vLLM's attribute path, a worker
extension, IPC or a weight-update group), and the model reports each write here, so no path is
invisible to the record::

    event                                  stale afterwards
    ─────────────────────────────────────  ────────────────────────────────────
    weights discarded (a level-2 sleep)    every weight
    a load writes names N                  stale − N
    a load fails partway                   every weight (values may be mixed)

Generating is refused while anything is stale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class RefitRecord:
    """Invariant: ``stale`` is a subset of ``names``. ``check_writable`` (the worker's "are
    the weights awake?") runs before every load, so a framework writing through
    ``model.load_weights`` while the weights sleep gets a typed error, not a segfault."""

    def __init__(
        self, names: Iterable[str], check_writable: Callable[[], None] | None = None
    ) -> None:
        self.names = frozenset(names)
        self.stale: set[str] = set()
        self.num_writes = 0
        self._check_writable = check_writable

    def before_write(self) -> None:
        if self._check_writable is not None:
            self._check_writable()

    # ``num_writes`` counts every event below: KV computed before one is stale (the prefix
    # cache's invariant, DESIGN §3 invariant 10), even where no weight is left stale.

    def discarded(self) -> None:
        self.stale = set(self.names)
        self.num_writes += 1

    def written(self, names: Iterable[str]) -> None:
        self.stale.difference_update(names)
        self.num_writes += 1

    def failed(self) -> None:
        self.stale = set(self.names)
        self.num_writes += 1
