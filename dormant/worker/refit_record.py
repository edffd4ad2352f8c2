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

Generating is refused while anything is stale. A refit command sent once per bucket
(``update_weights_from_tensor``) answers a ``RefitReport``: the names and the record after the
write, what the driver would otherwise ask the rank for in a second round trip.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RefitReport:
    """A rank's answer to a refit that succeeded: the names it wrote (sorted), and its record
    right after (``RankSleepState``'s ``stale_weights`` and ``num_weight_writes``). A refit
    changes nothing else a rank reports: its tags' states and its KV discards stay as they were."""

    names: tuple[str, ...]
    stale_weights: frozenset[str]
    num_weight_writes: int


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

    def report(self, names: tuple[str, ...]) -> RefitReport:
        """``names`` (a refit's, written) with the record as it stands now."""
        return RefitReport(names, frozenset(self.stale), self.num_writes)
