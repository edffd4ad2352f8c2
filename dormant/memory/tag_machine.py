"""The tag state machine: what sleep and wake decide per tag (DESIGN §2.3).

A tag's state is derived from its allocations' states, never stored (``states.TagState``): an
empty tag is AWAKE, since it has nothing to sleep. Per tag, with ``P`` the requested policy::

    request           AWAKE              asleep with P        asleep with Q ≠ P    PARTIAL
    ────────────────  ─────────────────  ───────────────────  ───────────────────  ──────────────
    sleep(tag: KEEP)  no-op              no-op                no-op                no-op
    sleep(tag: P)     sleep with P       no-op (idempotent)   SleepConflictError   per allocation
    wake_up(tag)      no-op              map, restore/poison  map, restore/poison  map the rest
    allocate in tag   allocate           TagAsleepError       TagAsleepError       TagAsleepError
    free a tensor     unmap+release+VA   VA + host copy       VA + host copy       what it holds

PARTIAL is what a failed driver call leaves (an ``unmap`` that fails leaves its allocation
MAPPED; a ``release`` that fails leaves it UNMAPPED, handle kept), so some allocations are MAPPED,
some OFFLOADED or DISCARDED, some UNMAPPED. Each allocation then answers for itself::

    allocation state          sleep(tag: P)                         wake_up(tag)
    ────────────────────────  ────────────────────────────────────  ───────────────────────────
    MAPPED                    sleep it with P                       nothing
    UNMAPPED, on its way to P retry the release                     map its own handle again
    UNMAPPED, on its way to Q SleepConflictError (nothing changes)  map its own handle again
    OFFLOADED / DISCARDED     no-op if that is P, else conflict     create, map, restore / fill

A request is validated completely before anything changes: a conflict in any tag changes nothing
in every tag. A failed wake is rolled back whole, so it never leaves a tag PARTIAL.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from dormant.memory.allocation import Allocation
from dormant.memory.errors import (
    SleepConflictError,
    TagAsleepError,
    TransitionFailedError,
    UnknownTagError,
)
from dormant.memory.policy import Policy
from dormant.memory.pool import TagPool
from dormant.memory.states import State, TagState, describe

_UNIFORM = {State.MAPPED: TagState.AWAKE, State.OFFLOADED: TagState.OFFLOADED}
_UNIFORM[State.DISCARDED] = TagState.DISCARDED
_ASLEEP_POLICY = {TagState.OFFLOADED: Policy.HOST, TagState.DISCARDED: Policy.DISCARD}


def tag_state(allocations: Iterable[Allocation]) -> TagState:
    """AWAKE when every allocation is MAPPED (or there is none), OFFLOADED or DISCARDED when
    every one is, PARTIAL otherwise."""
    each = iter(allocations)
    first = next(each, None)
    if first is None:
        return TagState.AWAKE
    state = first.state
    if any(a.state is not state for a in each):  # by identity: an Enum hashes in Python
        return TagState.PARTIAL
    return _UNIFORM.get(state, TagState.PARTIAL)


def tag_states(pools: Mapping[str, TagPool]) -> dict[str, TagState]:
    return {tag: tag_state(pool.allocations) for tag, pool in pools.items()}


def asleep_policy(state: TagState) -> Policy | None:
    """The policy a tag in ``state`` is asleep with: only OFFLOADED and DISCARDED tags have one."""
    return _ASLEEP_POLICY.get(state)


def count_states(allocations: Iterable[Allocation]) -> dict[State, int]:
    """How many of ``allocations`` are in each state (every state is a key)."""
    counts = dict.fromkeys(State, 0)
    for allocation in allocations:
        counts[allocation.state] += 1
    return counts


@dataclass(frozen=True)
class SleepPlan:
    """What a sleep will do: ``tags`` with work, and the allocations to offload or discard."""

    tags: dict[str, Policy] = field(default_factory=dict)
    host: list[Allocation] = field(default_factory=list)
    discard: list[Allocation] = field(default_factory=list)


def plan_sleep(pools: Mapping[str, TagPool], request: Mapping[str, Policy]) -> SleepPlan:
    """The plan for ``request`` (known tags). Raises SleepConflictError, changing nothing, if an
    allocation is asleep, or on its way to sleep, with another policy than its tag's request."""
    plan = SleepPlan()
    conflicts = []
    for tag, policy in request.items():
        if policy is Policy.KEEP:
            continue
        allocations = pools[tag].allocations
        others = {a.policy for a in allocations} - {None, policy}
        if others:
            names = "/".join(sorted(p.name for p in others if p is not None))
            state = tag_state(allocations).value
            conflicts.append(f"{tag!r} is asleep with {names} ({state}), asked for {policy.name}")
            continue
        todo = [a for a in allocations if a.state in (State.MAPPED, State.UNMAPPED)]
        if todo:
            plan.tags[tag] = policy
            (plan.host if policy is Policy.HOST else plan.discard).extend(todo)
    if conflicts:
        raise SleepConflictError(
            "conflicting sleep request: " + "; ".join(conflicts) + ". Nothing was changed; "
            "wake_up() those tags first to sleep them differently."
        )
    return plan


def plan_wake(
    pools: Mapping[str, TagPool], tags: Iterable[str]
) -> tuple[list[str], list[Allocation]]:
    """The tags among ``tags`` that are not AWAKE, and their allocations that are not MAPPED."""
    waking = [
        t for t in dict.fromkeys(tags) if tag_state(pools[t].allocations) is not TagState.AWAKE
    ]
    allocations = [a for t in waking for a in pools[t].allocations if a.state is not State.MAPPED]
    return waking, allocations


def check_known(pools: Mapping[str, TagPool], tags: Iterable[str]) -> list[str]:
    """``tags`` as a list; raises UnknownTagError naming every tag that is not in ``pools``."""
    names = list(tags)
    unknown = [t for t in names if t not in pools]
    if unknown:
        raise UnknownTagError(
            f"unknown tag(s) {unknown}; known tags: {list(pools)}. "
            "Add your own with register_tag()."
        )
    return names


def check_can_allocate(pool: TagPool) -> None:
    """Raises TagAsleepError unless ``pool``'s tag is AWAKE."""
    state = tag_state(pool.allocations)
    if state is not TagState.AWAKE:
        raise TagAsleepError(
            f"cannot allocate in tag {pool.tag!r}: it is {describe_pool(pool)}. "
            f"wake_up([{pool.tag!r}]) first."
        )


def describe_pool(pool: TagPool) -> str:
    return describe(tag_state(pool.allocations), count_states(pool.allocations))


def failure(
    error_type: type[TransitionFailedError],
    cause: BaseException,
    pools: Mapping[str, TagPool],
    tags: Iterable[str],
    outcome: str,
) -> TransitionFailedError:
    """The error for a sleep or wake stopped by ``cause``: names the failed call, says
    ``outcome``, and what each of ``tags`` now is."""
    names = list(dict.fromkeys(tags))
    now = "; ".join(f"{t} {describe_pool(pools[t])}" for t in names)
    return error_type(
        f"{cause}. {outcome} Nothing leaked; tags now: {now}.",
        {t: tag_state(pools[t].allocations) for t in names},
    )
