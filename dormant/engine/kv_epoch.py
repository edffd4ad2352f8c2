"""The prefix cache is never stale (DESIGN §3 invariant 10), and the engine alone keeps it so:
every rank reports how often its weights were written and its KV discarded (``RankSleepState``,
counted on the worker whatever path did it), and before each schedule the engine drops the
cache if any count moved since the cache was last known good (``CachedKVEpoch``).
``LLMEngine.reset_prefix_cache()`` is for vLLM's callers; correctness never depends on it.
"""

from __future__ import annotations

from collections.abc import Callable

from dormant.engine.sleep_control import SleepControl


class CachedKVEpoch:
    """The epoch the cached KV was computed under, and the drop when the ranks' epoch moves.

    ``drop_cache`` resets the prefix cache of the engine's current scheduler.
    """

    def __init__(self, sleep_control: SleepControl, drop_cache: Callable[[], None]) -> None:
        self._sleep_control, self._drop_cache = sleep_control, drop_cache
        self._epoch = sleep_control.kv_epoch  # what the cached KV was computed under

    def invalidate_if_stale(self) -> None:
        """DESIGN §3 invariant 10, where it holds: cached KV was computed with the weights and
        in the KV memory of the recorded epoch; once any rank reports another epoch (a weight
        written by any path, or KV backing memory discarded, since), every cached block is
        dropped before anything can hit it. The engine runs this before every schedule, the
        only place that looks blocks up. Every path that writes weights or discards KV on a
        rank is seen: in the engine's process the ranks are asked afresh before each step
        (``LLMEngine.check_can_generate``), and commands to other processes report the ranks'
        state after they ran."""
        epoch = self._sleep_control.kv_epoch
        if epoch != self._epoch:
            self._drop_cache()
            self._epoch = epoch
