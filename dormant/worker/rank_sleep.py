"""One rank's sleep and wake, and the sleep state it reports (``RankSleepState``).

A sleep puts the rank's memory to sleep by level or by tag, gives torch's cached memory and the
CUDA context's local-memory reservation back to the driver (``memory/local_memory.py``),
releases the tensor-parallel communicator when the whole engine sleeps (``comm_sleep``) and, if
asked, checkpoints the CUDA context; a wake restores them in the reverse order. Only memory is
touched: no model-runner state is rebuilt (DESIGN §3 invariant 2).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from dormant.core.config import EngineConfig
from dormant.core.sleep_state import RankSleepState
from dormant.distributed.comm_sleep import CommunicatorSleep
from dormant.memory import KV_CACHE, LEVELS, WEIGHTS, MemoryManager, Policy, TagState
from dormant.memory.process_checkpoint import CommunicatorActiveError
from dormant.worker.refit_record import RefitRecord


class RankSleep:
    """Sleep and wake of one rank's memory manager. ``refits`` returns the rank's current
    ``RefitRecord`` (the worker replaces it once the model is built)."""

    def __init__(
        self,
        mm: MemoryManager,
        comm_sleep: CommunicatorSleep,
        refits: Callable[[], RefitRecord],
        rank: int,
        world_size: int,
    ) -> None:
        self.mm, self.comm_sleep, self._refits = mm, comm_sleep, refits
        self.rank, self.world_size = rank, world_size
        self.num_kv_discards = 0  # sleeps of the KV cache: its contents are gone after each

    def sleep(
        self, level: int, tags: Sequence[str] | None = None, release_context: bool = False
    ) -> RankSleepState:
        """Puts this rank's memory to sleep with ``level``'s policies: every tag, or only
        ``tags``. Discarding the weights marks every weight stale, even if the sleep fails
        after discarding some of them. Then torch's cuBLAS workspaces and cache go back to the
        driver, and with ``release_context`` the driver checkpoints the rest of the process's
        device state, its CUDA context included (``check_release_context`` says when it
        cannot, before anything changes); ``wake_up`` restores it. Returns the state after."""
        policies = dict(LEVELS[level])
        if tags is not None:
            policies = {tag: policies[tag] for tag in tags}
        if self.mm.context.is_released:
            return self._sleep_while_released(policies)
        if release_context:
            self.check_release_context()
        was_awake = self.mm.tag_states()[WEIGHTS] is TagState.AWAKE
        if KV_CACHE in policies:  # counted first: a sleep that fails may have discarded some
            self.num_kv_discards += 1
        try:
            self.mm.sleep(tags=policies)
        finally:
            discards = policies.get(WEIGHTS) is Policy.DISCARD
            if discards and was_awake and self.mm.tag_states()[WEIGHTS] is not TagState.AWAKE:
                self._refits().discarded()
        self.mm.residual.release_torch_memory()  # back to the driver, and to a trainer
        self.mm.residual.release_local_memory()  # the thread stacks' reservation too
        if tags is None and not self.comm_sleep.released:  # the whole engine sleeps
            self.comm_sleep.release()  # its communicator's memory goes too
        if release_context:
            self.mm.context.release()
        return self.state()

    def check_release_context(self) -> None:
        """Raises, changing nothing, if this rank cannot release its process's CUDA context:
        NCCL communicators (a tensor-parallel rank, a weight-update group over NCCL:
        CommunicatorActiveError), a driver without the checkpoint API or a process that is an
        MPS client (CheckpointUnsupportedError)."""
        if self.world_size > 1:
            raise CommunicatorActiveError(
                f"rank {self.rank} of {self.world_size}: a tensor-parallel engine's NCCL "
                "communicator cannot be checkpointed; release_context is for one GPU"
            )
        self.mm.context.check()

    def _sleep_while_released(self, policies: dict[str, Policy]) -> RankSleepState:
        """A sleep that would change nothing is a no-op while the CUDA state is checkpointed
        (callers sleep defensively); any other needs the device and raises."""
        tags = {t.tag: t for t in self.mm.status().tags}
        if any(tags[tag].num_allocations and tags[tag].asleep_policy is not p
               for tag, p in policies.items() if p is not Policy.KEEP):  # fmt: skip
            self.mm.context.check_usable(f"sleep with {policies}")
        return self.state()

    def wake_up(self, tags: Sequence[str] | None = None) -> RankSleepState:
        """Wakes ``tags`` (all when None); returns the state after the wake."""
        self.comm_sleep.restore()  # first: waking may run collectives
        self.mm.wake_up(tags)  # restores a released CUDA context first
        self.mm.residual.restore_local_memory()  # the stack limit the graphs were captured with
        return self.state()

    def state(self) -> RankSleepState:
        """This rank's memory state per tag and its stale weights, derived now."""
        refits = self._refits()
        return RankSleepState(
            tags=tuple(self.mm.tag_states().items()),
            stale_weights=frozenset(refits.stale),
            num_weights=len(refits.names),
            num_weight_writes=refits.num_writes,
            num_kv_discards=self.num_kv_discards,
        )


def captures_collectives(device: torch.device, config: EngineConfig, world_size: int) -> bool:
    """Whether the decode graphs will capture the TP group's collectives."""
    on_gpu = torch.device(device).type == "cuda"
    return on_gpu and not config.enforce_eager and world_size > 1
