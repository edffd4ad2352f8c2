"""The sleep state one rank reports to the driver: typed, frozen, derived from its memory manager.

Workers answer every sleep, wake and refit command with a ``RankSleepState``; the driver's
``SleepControl`` keeps the latest one of every rank and decides from them alone, so there is no
second copy of the memory state that could disagree with the memory layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dormant.memory import TagState


@dataclass(frozen=True, slots=True)
class RankSleepState:
    """What one rank's memory holds now, and which weights hold stale values.

    ``tags`` maps every tag of the rank's memory manager to its derived state, in tag order.
    ``stale_weights`` are the checkpoint names whose contents were discarded (a level-2 sleep)
    or left half-written (a refit that failed) and not written since; ``num_weights`` counts
    all of them. ``num_weight_writes`` counts every write of weights (by any path), failed
    write and discard since the rank started, and ``num_kv_discards`` every sleep of the KV
    cache: when either moves, KV computed before is stale (the driver's prefix cache).
    """

    tags: tuple[tuple[str, TagState], ...]
    stale_weights: frozenset[str]
    num_weights: int
    # Counts, not state: ranks may write their shards in different numbers of calls.
    num_weight_writes: int = field(default=0, compare=False)
    num_kv_discards: int = field(default=0, compare=False)

    def state(self, tag: str) -> TagState:
        return dict(self.tags)[tag]

    @property
    def asleep_tags(self) -> tuple[str, ...]:
        """Tags with any memory not mapped (asleep, or in between after a failed call)."""
        return tuple(tag for tag, state in self.tags if state is not TagState.AWAKE)
