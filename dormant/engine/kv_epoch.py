"""The prefix cache is never stale (DESIGN §3 invariant 10), and the engine alone keeps it so:
every rank reports how often its weights were written and its KV discarded (``RankSleepState``,
counted on the worker whatever path did it), and before each schedule the engine drops the
cache if any count moved since the cache was last known good (``CachedKVEpoch``).
``LLMEngine.reset_prefix_cache()`` is for vLLM's callers; correctness never depends on it.

A KV discard the engine did not make itself (the caller's code through ``collective_rpc``,
sleeping a worker directly) also takes the running sequences' KV: before the next schedule
they are preempted, and recompute it (``recompute_if_discarded``). The engine's own sleeps settle
their running sequences first (abort, or preempt in "keep" mode), so this finds none.
"""

from __future__ import annotations

from collections.abc import Callable

from dormant.engine.scheduler import Scheduler
from dormant.engine.sleep_control import SleepControl


class CachedKVEpoch:
    """The epoch the cached KV was computed under, and the drop when the ranks' epoch moves.

    ``scheduler`` gives the engine's current scheduler: its prefix cache is what is dropped,
    its running sequences what is preempted.
    """

    def __init__(self, sleep_control: SleepControl, scheduler: Callable[[], Scheduler]) -> None:
        self._sleep_control, self._scheduler = sleep_control, scheduler
        self._epoch = sleep_control.kv_epoch  # what the cached KV was computed under
        self._discards = _discards(self._epoch)  # what the running sequences' KV was made in

    def recompute_if_discarded(self) -> None:
        """Before a schedule (no call in flight): running sequences whose KV memory was
        discarded since are preempted, so they recompute it rather than decode over zeros."""
        discards = _discards(self._sleep_control.kv_epoch)
        if discards != self._discards:
            self._scheduler().preempt_all()
            self._discards = discards

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
            self._scheduler().block_manager.reset_prefix_cache()
            self._epoch = epoch


def _discards(epoch: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    return tuple(num_kv_discards for _, num_kv_discards in epoch)
