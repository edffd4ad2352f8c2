"""Sleep and wake over a manager's tags: plan (``tag_machine``), check strict mode, move the bytes
(``transitions``), and turn a failed driver call into an error that says what each tag now is.

Preconditions (the manager's): the caller holds the manager's lock, every tag is known, and the
pointer guard was verified.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from dormant.memory.arena import ArenaPreparation
from dormant.memory.audit import check_strict
from dormant.memory.blocks import BlockTable
from dormant.memory.errors import DriverError, SleepFailedError, WakeFailedError
from dormant.memory.offload import DiscardOrder, sleep_allocations
from dormant.memory.policy import Policy
from dormant.memory.status import SleepReport, WakeReport
from dormant.memory.tag_machine import failure, plan_sleep, plan_wake
from dormant.memory.transitions import wake_allocations


def sleep_tags(
    table: BlockTable,
    request: Mapping[str, Policy],
    *,
    strict: bool,
    skip_unchanged: bool,
    discard_order: DiscardOrder = DiscardOrder.UNDER_COPIES,
) -> SleepReport:
    """Puts ``request``'s tags to sleep. A conflict or a strict-mode refusal changes nothing; a
    failed driver call raises SleepFailedError, with every landed step recorded."""
    plan = plan_sleep(table.pools, request)
    if strict:
        check_strict(table.records(), [t for t, p in plan.tags.items() if p is Policy.DISCARD])
    try:
        report = sleep_allocations(
            table.backend,
            table.arena,
            plan.host,
            plan.discard,
            skip_unchanged=skip_unchanged,
            discard_order=discard_order,
        )
    except DriverError as error:
        outcome = "The sleep stopped there; what was released before it stays released."
        raise failure(SleepFailedError, error, table.pools, plan.tags, outcome) from error
    for tag in plan.tags:  # asleep now: trimming slab rules give back their slabs' free tails
        table.pools[tag].trim()
    return replace(report, tags=plan.tags)


def wake_tags(
    table: BlockTable, tags: Iterable[str], *, poison: bool, keep_arena: bool
) -> WakeReport:
    """Maps back everything in ``tags`` that is not mapped; all or nothing. Out of memory raises
    WakeOutOfMemoryError, another failed driver call WakeFailedError; neither changes a state."""
    waking, allocations = plan_wake(table.pools, tags)
    try:
        report = wake_allocations(table.backend, allocations, poison=poison)
    except DriverError as error:
        outcome = "The wake was rolled back: every state is as it was."
        raise failure(WakeFailedError, error, table.pools, waking, outcome) from error
    if not keep_arena:
        table.drop_host_copies()
    return replace(report, tags=tuple(waking))


def prepare_host_copies(
    table: BlockTable, request: Mapping[str, Policy], num_threads: int
) -> ArenaPreparation:
    """Starts growing the arena (in the background) for the allocations of ``request``'s HOST
    tags that have no arena region yet."""
    sizes = [
        a.size
        for tag, policy in request.items()
        if policy is Policy.HOST
        for a in table.pools[tag].allocations
        if a.region is None
    ]
    return table.arena.prepare(sizes, num_threads)
