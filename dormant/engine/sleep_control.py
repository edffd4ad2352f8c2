"""The one owner of the engine's sleep state on the driver: what was asked (level, pause), what
every rank reports (its ``RankSleepState``), and whether a step may run.

The rules, each decided here and nowhere else::

    request               engine state                          result
    ────────────────────  ────────────────────────────────────  ─────────────────────────────────
    sleep(0)              any                                   pause scheduling; no memory change
    sleep(L), L ≥ 1       every tag awake, or paused            sleep every rank at L
    sleep(L), L ≥ 1       some tags asleep                      per tag: asleep with the same
                                                                policy → no-op; with another
                                                                policy (weights offloaded by
                                                                sleep(1), discarded by sleep(2))
                                                                → SleepLevelConflictError,
                                                                nothing changes
    release(tags)         as sleep(1), for the named tags only  (a KV-only release, then sleep(2),
                                                                is legal: KV is discarded both ways)
    wake_up(tags)         any                                   wake the tags and their groups
                                                                (WAKE_GROUPS); the pause ends once
                                                                nothing is asleep
    step / generate       paused, a tag asleep, stale weights   EngineAsleepError /
                                                                WeightsNotLoadedError
    sleep(L, release_     L = 0, or tensor parallel, or NCCL    ValueError / Communicator-
      context=True)       groups, or no driver support          ActiveError / Checkpoint-
                                                                UnsupportedError, nothing
                                                                changes (check_release_context)

A tag's state is the rank's own report (derived there from its allocations); ranks must agree,
and a disagreement raises ``RankStateMismatchError`` naming the ranks, instead of trusting
rank 0. Stale weights are recorded by the workers, whichever path refit them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from dormant.core.errors import (
    EngineAsleepError,
    RankStateMismatchError,
    SleepLevelConflictError,
    WeightsNotLoadedError,
)
from dormant.core.sleep_state import RankSleepState
from dormant.memory import (
    CUDA_GRAPH,
    KV_CACHE,
    LEVELS,
    RUNTIME,
    WEIGHTS,
    WORKSPACE,
    CommunicatorActiveError,
    Policy,
    TagState,
    UnknownTagError,
)
from dormant.worker.refit_record import RefitReport

SLEEP_MODES = ("abort", "wait", "keep")
# What waking one of vLLM's tags also wakes: a refit writes weights and checkpoint k/v scales
# (runtime buffers); generating needs the KV cache, the runtime state, graph pools and scratch.
WAKE_GROUPS: dict[str, tuple[str, ...]] = {
    WEIGHTS: (WEIGHTS, RUNTIME),
    KV_CACHE: (KV_CACHE, RUNTIME, CUDA_GRAPH, WORKSPACE),
}
# A tag asleep in this state cannot be put to sleep with that policy without waking it first.
_CONFLICTS = {(TagState.OFFLOADED, Policy.DISCARD), (TagState.DISCARDED, Policy.HOST)}


class SleepControl:
    """Invariant: ``ranks`` holds the latest report of every rank, in rank order."""

    def __init__(self, ranks: Sequence[RankSleepState]) -> None:
        self.ranks: tuple[RankSleepState, ...] = ()
        self.level: int | None = None  # the deepest level asked since the engine was awake
        self.is_paused = False
        self.update(ranks)

    # ── what the ranks say ────────────────────────────────────────────────────────────────────

    def update(self, ranks: Sequence[RankSleepState]) -> None:
        """Records every rank's report; raises RankStateMismatchError if they differ (the
        reports are recorded first, so the engine's view stays truthful)."""
        self.ranks = tuple(ranks)
        if self.is_fully_awake:
            self.level = None
        self._check_ranks_agree()

    def refitted(self, reports: Sequence[RefitReport]) -> None:
        """Records what a refit that succeeded on every rank reports: each rank's weight record
        after it. A refit changes nothing else a rank reports (its tags' states, its KV
        discards), so the rest of each rank's last report stands, and so does ``level``;
        raises as ``update``."""
        self.ranks = tuple(
            RankSleepState(
                tags=state.tags,
                stale_weights=report.stale_weights,
                num_weights=state.num_weights,
                num_weight_writes=report.num_weight_writes,
                num_kv_discards=state.num_kv_discards,
            )
            for state, report in zip(self.ranks, reports, strict=True)
        )
        self._check_ranks_agree()

    def _check_ranks_agree(self) -> None:
        differ = [rank for rank, state in enumerate(self.ranks) if state != self.ranks[0]]
        if differ:
            raise RankStateMismatchError(
                f"ranks {differ} report a different sleep state than rank 0: "
                + "; ".join(f"rank {r}: {_describe(s)}" for r, s in enumerate(self.ranks))
                + ". wake_up() every tag, then sleep again."
            )

    @property
    def asleep_tags(self) -> tuple[str, ...]:
        """Tags asleep (or in between) on any rank."""
        return tuple(dict.fromkeys(t for state in self.ranks for t in state.asleep_tags))

    @property
    def stale_weights(self) -> frozenset[str]:
        return frozenset().union(*(state.stale_weights for state in self.ranks))

    @property
    def kv_epoch(self) -> tuple[tuple[int, int], ...]:
        """Per rank, its weight writes and KV discards so far: KV computed under one epoch is
        stale under any other (DESIGN §3 invariant 10)."""
        return tuple((state.num_weight_writes, state.num_kv_discards) for state in self.ranks)

    @property
    def is_fully_awake(self) -> bool:
        return not self.asleep_tags

    @property
    def is_sleeping(self) -> bool:
        return self.is_paused or not self.is_fully_awake

    # ── checks ────────────────────────────────────────────────────────────────────────────────

    def check_can_generate(self) -> None:
        """Raises EngineAsleepError / WeightsNotLoadedError if a step cannot run now."""
        if self.is_paused:
            raise EngineAsleepError(
                "scheduling is paused by sleep(level=0); call wake_up() to resume"
            )
        if self.asleep_tags:
            raise EngineAsleepError(
                f"the engine is asleep (level {self.level}); tags still asleep: "
                f"{list(self.asleep_tags)}. Call wake_up() (or wake_up([...]) for each) first."
            )
        stale = self.stale_weights
        if stale:
            some = ", ".join(sorted(stale)[:3])
            raise WeightsNotLoadedError(
                f"{len(stale)} of {self.ranks[0].num_weights} weights hold no current values "
                f"(discarded by sleep(level=2), or a refit failed partway), e.g. {some}. Call "
                "reload_weights() or update_weights(...) with all of them before generating."
            )

    def check_sleep(self, level: int, tags: Iterable[str] | None = None) -> None:
        """Validates ``sleep(level)`` (or a release of ``tags`` with the level's policies)
        against every rank's state; changes nothing."""
        if level not in LEVELS:
            raise ValueError(f"sleep level must be one of {sorted(LEVELS)}, got {level!r}")
        policies = LEVELS[level]
        names = list(policies) if tags is None else self.known_tags(tags)
        conflicts = [
            f"{tag!r} is {state.value} on rank {rank}; this sleep would {policies[tag].value} it"
            for tag in names
            if tag in policies
            for rank, ranked in enumerate(self.ranks)
            if (state := ranked.state(tag), policies[tag]) in _CONFLICTS
        ]
        if conflicts:
            raise SleepLevelConflictError(
                f"the engine is asleep at level {self.level}; sleep(level={level}) conflicts: "
                + "; ".join(conflicts)
                + ". Nothing was changed: wake_up() those tags first to sleep them differently."
            )

    def known_tags(self, tags: Iterable[str]) -> list[str]:
        """``tags`` as a list (a lone string is one tag); UnknownTagError names unknown ones."""
        names = [tags] if isinstance(tags, str) else list(tags)
        known = [tag for tag, _ in self.ranks[0].tags]
        unknown = [t for t in names if t not in known]
        if unknown:
            raise UnknownTagError(f"unknown tag(s) {unknown}; known tags: {known}")
        return names

    def wake_tags(self, tags: Iterable[str] | None) -> list[str] | None:
        """The tags a ``wake_up(tags)`` wakes: each with its group (None: every tag)."""
        if tags is None:
            return None
        named = self.known_tags(tags)
        return list(dict.fromkeys(t for tag in named for t in WAKE_GROUPS.get(tag, (tag,))))

    # ── what was asked ────────────────────────────────────────────────────────────────────────

    def woke(self) -> None:
        """Records a successful ``wake_up``: a pause ends once nothing is asleep."""
        if self.is_fully_awake:
            self.is_paused = False

    def asked(self, level: int) -> None:
        """Records a successful ``sleep(level)`` (level 0: a pause). A sleep that left nothing
        asleep (a release of no tags) records no level."""
        if level == 0:
            self.is_paused = True
        elif not self.is_fully_awake:
            self.level = max(self.level or 0, level)


def _describe(state: RankSleepState) -> str:
    asleep = {tag: s.value for tag, s in state.tags if s is not TagState.AWAKE}
    return f"asleep {asleep or 'nothing'}, {len(state.stale_weights)} stale weights"


def check_release_context(level: int, tensor_parallel_size: int) -> None:
    """``sleep(level, release_context=True)``'s own rules, checked on the driver before anything
    changes (each rank then checks its process: NCCL groups, the driver's support)."""
    if level < 1:
        raise ValueError(
            "release_context=True needs sleep(level=1) or sleep(level=2): level 0 only pauses "
            "scheduling and releases no memory"
        )
    if tensor_parallel_size > 1:
        raise CommunicatorActiveError(
            f"tensor_parallel_size={tensor_parallel_size}: the ranks' NCCL communicators cannot "
            "be checkpointed by the driver; release_context is for a one-GPU engine"
        )
