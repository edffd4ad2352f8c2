"""Sleep and wake over a manager's tags: plan (``tag_machine``), check strict mode, move the bytes
(``transitions``), and turn a failed driver call into an error that says what each tag now is.

Preconditions of the functions: the caller holds the manager's lock, every tag is known, and the
pointer guard was verified. ``SleepWake`` is how the manager calls them: it checks those first
(and that no capture scope is open), and keeps the last report of each.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from dormant.memory.arena import ArenaPreparation
from dormant.memory.audit import check_strict
from dormant.memory.blocks import BlockTable
from dormant.memory.capture import check_not_capturing
from dormant.memory.context_release import ContextRelease
from dormant.memory.copy_path import CopyPathPolicy
from dormant.memory.errors import DriverError, SleepFailedError, WakeFailedError
from dormant.memory.frontends import Frontends
from dormant.memory.guard import PointerGuard
from dormant.memory.offload import DiscardOrder, sleep_allocations
from dormant.memory.policy import Policy, as_tag_list
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
            releases=table.releases,
        )
    except DriverError as error:
        outcome = "The sleep stopped there; what was released before it stays released."
        raise failure(SleepFailedError, error, table.pools, plan.tags, outcome) from error
    for tag in plan.tags:  # asleep now: trimming slab rules give back their slabs' free tails
        table.pools[tag].trim()
    return replace(report, tags=plan.tags)


def wake_tags(
    table: BlockTable,
    tags: Iterable[str],
    *,
    poison: bool,
    keep_arena: bool,
    copy_policy: CopyPathPolicy | None = None,
) -> WakeReport:
    """Maps back everything in ``tags`` that is not mapped; all or nothing. Out of memory raises
    WakeOutOfMemoryError, another failed driver call WakeFailedError; neither changes a state.
    The copies go by the path ``copy_policy`` chooses from the table's recent releases."""
    waking, allocations = plan_wake(table.pools, tags)
    policy = CopyPathPolicy() if copy_policy is None else copy_policy
    choice = policy.choose(table.releases)
    try:
        report = wake_allocations(
            table.backend,
            allocations,
            poison=poison,
            copy_path=choice.path,
            sm_fraction=policy.sm_fraction,
        )
    except DriverError as error:
        outcome = "The wake was rolled back: every state is as it was."
        raise failure(WakeFailedError, error, table.pools, waking, outcome) from error
    if not keep_arena:
        table.drop_host_copies()
    return replace(report, tags=tuple(waking), recent_release_bytes=choice.recent_release_bytes)


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


class SleepWake:
    """The manager's sleep, wake and arena preparation, each behind its preconditions: no capture
    scope open, the manager's gate (``Frontends.op``: its lock, open, the CUDA context usable;
    a wake restores a released context first), every tag known and, for sleep and wake, the
    pointer guard verified. ``last_sleep`` / ``last_wake``: the report of the last one that
    completed (None before it), recorded under the lock."""

    def __init__(
        self, table: BlockTable, front: Frontends, guard: PointerGuard, context: ContextRelease
    ) -> None:
        self._table, self._front, self._guard, self._context = table, front, guard, context
        self.last_sleep: SleepReport | None = None
        self.last_wake: WakeReport | None = None

    def sleep(
        self,
        request: Mapping[str, Policy],
        *,
        strict: bool,
        skip_unchanged: bool,
        discard_order: DiscardOrder,
    ) -> SleepReport:
        check_not_capturing("sleep()")
        with self._front.op():
            self._front.check_tags(request)
            self._guard.verify()
            self.last_sleep = sleep_tags(
                self._table,
                request,
                strict=strict,
                skip_unchanged=skip_unchanged,
                discard_order=discard_order,
            )
            return self.last_sleep

    def wake(
        self,
        tags: str | Iterable[str] | None,
        *,
        poison: bool,
        keep_arena: bool,
        copy_policy: CopyPathPolicy | None = None,
    ) -> WakeReport:
        """Wakes ``tags`` (None: every tag), copying by the path ``copy_policy`` chooses."""
        check_not_capturing("wake_up()")
        self._context.restore()  # a released CUDA context comes back first
        with self._front.op():
            pools = self._table.pools
            names = list(pools) if tags is None else self._front.check_tags(as_tag_list(tags))
            self._guard.verify()
            self.last_wake = wake_tags(
                self._table, names, poison=poison, keep_arena=keep_arena, copy_policy=copy_policy
            )
            return self.last_wake

    def prepare(self, request: Mapping[str, Policy], num_threads: int) -> ArenaPreparation:
        with self._front.op():
            self._front.check_tags(request)
            return prepare_host_copies(self._table, request, num_threads)
