"""The memory manager (DESIGN §2), a facade: the tag state machine and its table are in
``tag_machine.py``, sleep and wake behind their preconditions in ``sleep_wake.py``, the bytes
move in ``offload.py`` and ``transitions.py``. It stores no sleep state: a tag's state
is derived from its allocations' states, the one store of truth. Errors are typed (errors.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial

import torch

from dormant.memory import device_slots
from dormant.memory.adopt import Shape, adopt_module
from dormant.memory.allocation import Kind
from dormant.memory.arena import ArenaPreparation, HostArena
from dormant.memory.audit import AuditReport
from dormant.memory.backend import Backend
from dormant.memory.backends import open_backend
from dormant.memory.blocks import BlockTable
from dormant.memory.capture import TagPools
from dormant.memory.context_release import ContextRelease
from dormant.memory.copy_path import CopyMode, CopyPathPolicy
from dormant.memory.frontends import Frontends
from dormant.memory.guard import PointerGuard, TensorSource
from dormant.memory.offload import DiscardOrder
from dormant.memory.parsed_setting import ParsedSetting
from dormant.memory.policy import BUILTIN_TAGS, CUDA_GRAPH, Policy, sleep_request
from dormant.memory.residual import ResidualLedger
from dormant.memory.serial import SerialSection
from dormant.memory.slab_rules import SlabRule, tag_slab_rules
from dormant.memory.sleep_wake import SleepWake
from dormant.memory.states import State, TagState
from dormant.memory.status import MemoryStatus, SleepReport, WakeReport
from dormant.memory.status_report import status_of
from dormant.memory.tag_machine import asleep_policy, tag_states


class MemoryManager:
    """Sleepable, tagged memory on one device.

    Args:
        device: ``"cuda"``, ``"cuda:N"``, ``"host"``/``"cpu"``, ``"auto"`` (CUDA when available),
            or a ``Backend``.
        poison: fill every DISCARD remap with 0xFF (NaN for floats) so misplaced state fails loudly.
        strict: refuse to discard a tag holding allocations nobody declared as backing.
        keep_arena: keep the pinned host arena across cycles (default); False releases it after
            each wake that leaves nothing offloaded.
        skip_unchanged: do not copy HOST memory whose content hash matches its arena copy.
        discard_order: when a sleep releases DISCARD memory against its HOST copies (offload.py;
            a ``DiscardOrder`` or its value; settable later, as ``mm.discard_order``).
        slab_bytes: the smallest slab that small blocks are carved from (see pool.py).
        max_slab_bytes: the largest slab; blocks below 1/16 of it share slabs, so that many
            small allocations (graph pools, capture scopes) sleep and wake as few handles.
        slab_rules: tags whose blocks are sized by a ``SlabRule`` of their own, not by the two
            above (None: the built-in ones, ``weights`` coalescing into slabs of up to 2 GiB;
            see slab_rules.py).
        host_capacity: capacity of the host backend in bytes (tests use it to provoke OOM).
        arena_chunk_bytes: the size the host arena grows by (a region larger than it gets its own).
        copy_policy: how a wake copies HOST bytes back (copy_path.py): a ``CopyPathPolicy`` or a
            mode; None: ``$DORMANT_WAKE_COPY_PATH``, else "auto". Settable, as ``mm.copy_policy``.
    """

    # Assigning parses: an unknown value raises its typed error and the old value stays.
    discard_order: ParsedSetting[DiscardOrder] = ParsedSetting(DiscardOrder.parse)
    copy_policy: ParsedSetting[CopyPathPolicy] = ParsedSetting(CopyPathPolicy.parse)

    def __init__(
        self,
        device: str | torch.device | Backend = "auto",
        *,
        poison: bool = False,
        strict: bool = False,
        keep_arena: bool = True,
        skip_unchanged: bool = True,
        discard_order: DiscardOrder | str = DiscardOrder.UNDER_COPIES,
        slab_bytes: int = 2 << 20,
        max_slab_bytes: int = 512 << 20,
        slab_rules: Mapping[str, SlabRule] | None = None,
        host_capacity: int | None = None,
        arena_chunk_bytes: int = 1 << 30,
        copy_policy: CopyPathPolicy | CopyMode | str | None = None,
    ) -> None:
        self.copy_policy, self.discard_order = copy_policy, discard_order  # parsed, first
        self.backend = open_backend(device, host_capacity=host_capacity)
        device_slots.claim(self.backend.device_key)
        self.poison, self.strict = poison, strict
        self.keep_arena, self.skip_unchanged = keep_arena, skip_unchanged
        self.arena = HostArena(self.backend, chunk_bytes=arena_chunk_bytes)
        rules = tag_slab_rules(slab_rules)
        self._table = BlockTable(self.backend, self.arena, slab_bytes, max_slab_bytes, rules)
        self.release_history = self._table.releases  # every release (what copy_policy reads)
        for tag in BUILTIN_TAGS:
            self._table.add_tag(tag)
        self._guard = PointerGuard()
        self._serial = SerialSection()
        self.residual = ResidualLedger(self._table, self._serial)  # the residual, by owner
        self.context = ContextRelease(self._serial, self.backend, self.residual)
        self._front = Frontends(self._table, self._serial, self.context)
        self._user_tags = self._front.user_tags
        self._check_tags = self._front.check_tags
        self._tag_pools = TagPools(self.raw_alloc, self.raw_free, self.backend, self._check_tags)
        self._sleep_wake = SleepWake(self._table, self._front, self._guard, self.context)
        self._finalizer = weakref.finalize(self, device_slots.give_back, self.backend.device_key)

    # ── tags ──────────────────────────────────────────────────────────────────────────────────
    @property
    def tags(self) -> tuple[str, ...]:
        return tuple(self._table.pools)

    def register_tag(
        self,
        tag: str,
        levels: Mapping[int, Policy | str] | None = None,
        slab_rule: SlabRule | None = None,
    ) -> None:
        """Adds a user tag. ``levels`` maps sleep levels to policies (default: HOST at 1 and 2);
        ``slab_rule`` sizes its slabs (default: the manager's, or its entry in ``slab_rules``)."""
        self._front.register_tag(tag, levels, slab_rule)

    def tag_states(self) -> dict[str, TagState]:
        """Every tag's state, derived from its allocations (an empty tag is AWAKE); also after
        ``close``, as ``is_sleeping`` and ``asleep_tags``."""
        with self._serial.held():
            return tag_states(self._table.pools)

    def is_sleeping(self, tag: str | None = None) -> bool:
        """Whether ``tag`` (or, with None, any tag) is not AWAKE. Lock-free, cheap enough for
        every refit bucket: a sleep on another thread meanwhile may not be seen, as after a lock."""
        pools = self._table.pools
        names = list(pools) if tag is None else self._check_tags([tag])
        return any(a.state is not State.MAPPED for t in names for a in pools[t].allocations)

    @property
    def asleep_tags(self) -> dict[str, Policy]:
        """Tag → policy for the tags that are wholly asleep: HOST for OFFLOADED, DISCARD for
        DISCARDED. PARTIAL tags are not listed (``tag_states`` shows them)."""
        states = self.tag_states().items()
        return {t: p for t, s in states if (p := asleep_policy(s)) is not None}

    # ── allocation frontends ──────────────────────────────────────────────────────────────────
    def empty(self, shape: Shape, dtype: torch.dtype, tag: str) -> torch.Tensor:
        """An uninitialised tensor in ``tag``; its memory returns when its last view dies."""
        return self.empty_many([(shape, dtype)], tag)[0]

    def empty_many(
        self, specs: Sequence[tuple[Shape, torch.dtype]], tag: str
    ) -> list[torch.Tensor]:
        """Tensors packed into one block of ``tag`` (one storage: freed when all of them die)."""
        return self._front.empty_many(specs, tag, Kind.TENSOR)

    def adopt(
        self, module: torch.nn.Module, tag: str = "weights", buffer_tag: str = "runtime"
    ) -> torch.nn.Module:
        """Moves ``module``'s parameters into ``tag`` and its buffers into ``buffer_tag``.

        Each parameter keeps its identity (``param.data`` is swapped); buffers are replaced in their
        modules. Parameters and buffers on the meta device are materialised uninitialised.
        """
        return adopt_module(
            module, partial(self._front.empty_many, kind=Kind.ADOPTED), tag, buffer_tag
        )

    def raw_alloc(self, nbytes: int, tag: str) -> int:
        """The address of ``nbytes`` in ``tag``, for allocator plugins; undeclared."""
        return self._front.raw_alloc(nbytes, tag)

    def raw_free(self, address: int) -> None:
        """Frees memory from ``raw_alloc``; legal while its tag sleeps, and after ``close``
        (a capture pool returns its memory when its last user dies)."""
        self._front.raw_free(address)

    def declare_backing(self, memory: torch.Tensor | int) -> None:
        """Marks the block holding ``memory`` (a tensor, or an address from ``raw_alloc``) as
        backing: memory that is meant to be discarded with its tag."""
        self._front.declare_backing(memory)

    # ── torch integration (CUDA) ──────────────────────────────────────────────────────────────
    @contextmanager
    def capture(self, tag: str) -> Iterator[None]:
        """Routes this thread's torch CUDA allocations in scope into ``tag`` (see capture.py).

        The memory is undeclared: the audit lists it and strict mode refuses to discard it until
        ``declare_backing``. Do not call ``sleep``/``wake_up`` inside the scope.
        """
        with self._tag_pools.capture(tag):
            yield

    def graph_pool(self, tag: str = CUDA_GRAPH) -> torch.cuda.MemPool:
        """The MemPool of ``tag``, for ``torch.cuda.graph(g, pool=mm.graph_pool().id)``: the
        graph's private memory then sleeps with ``tag`` (HOST at every level by default)."""
        return self._tag_pools.pool(tag, "graph_pool()")

    # ── safety tools ──────────────────────────────────────────────────────────────────────────
    def audit(self, tags: Iterable[str] | None = None) -> AuditReport:
        """The live blocks of ``tags`` (default: every discardable tag), with their call sites."""
        return self._front.audit(tags)

    def guard_addresses(self, name: str, tensors: TensorSource) -> None:
        """Records the addresses of ``tensors`` (or of what a callable returns, re-evaluated at
        each check); every sleep and wake verifies them."""
        self._guard.add(name, tensors)

    def unguard(self, name: str) -> None:
        self._guard.remove(name)

    def verify_guards(self) -> None:
        """Raises PointerGuardError if any guarded address changed."""
        self._guard.verify()

    def mark_dirty(self, target: torch.Tensor | str) -> None:
        """Forces the next sleep to copy ``target`` (a tensor's allocation, or a whole tag).

        Hints can only add copies: unchanged detection never skips a dirty allocation.
        """
        self._front.mark_dirty(target)

    # ── sleep and wake ────────────────────────────────────────────────────────────────────────
    def sleep(
        self, level: int | None = None, *, tags: Mapping[str, Policy | str] | None = None
    ) -> SleepReport:
        """Puts tags to sleep: by ``level`` preset, or by an explicit ``{tag: policy}``.

        Idempotent per tag; a tag asleep with another policy raises SleepConflictError and nothing
        changes (see tag_machine.py). Synchronizes the device before copying or unmapping. A
        failed driver call raises SleepFailedError; repeating the sleep completes it.
        """
        request = sleep_request(level, tags, self._user_tags)
        return self._sleep_wake.sleep(
            request,
            strict=self.strict,
            skip_unchanged=self.skip_unchanged,
            discard_order=self.discard_order,
        )

    def wake_up(self, tags: str | Iterable[str] | None = None) -> WakeReport:
        """Wakes ``tags`` (default: all) at their own addresses; waking an AWAKE tag is a no-op.
        Everything in them that is not mapped is mapped: PARTIAL tags come back whole.

        Transactional: if mapping fails nothing changes, and WakeOutOfMemoryError says how many
        bytes were needed and how many were free (another driver failure: WakeFailedError).
        ``WakeReport.lost`` lists contents that could not be restored (see WakeReport), and
        ``WakeReport.copy_path`` how the copies ran (``copy_policy`` chose it).
        """
        return self._sleep_wake.wake(
            tags, poison=self.poison, keep_arena=self.keep_arena, copy_policy=self.copy_policy
        )

    def prepare_arena(
        self,
        level: int | None = None,
        *,
        tags: Mapping[str, Policy | str] | None = None,
        num_threads: int = 0,
    ) -> ArenaPreparation:
        """Starts pinning host memory, in background threads, for what ``sleep`` with the same
        ``level`` (or ``tags``) would offload now, so that the first such sleep only copies;
        returns at once. A sleep that comes first waits for it. Call it once the sleepable
        memory exists (an engine: after loading the model and capturing its graphs). A failed
        preparation changes nothing: ``wait()`` on it raises, and the next sleep grows the arena.
        """
        return self._sleep_wake.prepare(sleep_request(level, tags, self._user_tags), num_threads)

    # ── status and lifetime ───────────────────────────────────────────────────────────────────
    @property
    def last_sleep(self) -> SleepReport | None:
        """The report of the last sleep that completed; None before one."""
        return self._sleep_wake.last_sleep

    @property
    def last_wake(self) -> WakeReport | None:
        """The report of the last wake that completed; None before one."""
        return self._sleep_wake.last_wake

    def status(self) -> MemoryStatus:
        """Tags, the last reports and the residual by owner (residual.py); while the CUDA
        context is released, from NVML alone, read by the checkpoint helper."""
        with self._serial.held():
            self._front.check_open()
            reports = (self.last_sleep, self.last_wake)
            return status_of(self._table, *reports, self.residual, self.context)

    def tag_of(self, memory: torch.Tensor | int) -> str | None:
        """The tag whose memory holds ``memory`` (a tensor's first byte, or an address); None
        when it is no memory of this manager."""
        with self._serial.held():
            return self._table.tag_of(memory if isinstance(memory, int) else memory.data_ptr())

    def close(self) -> None:
        """Stops new operations and frees the device slot; live tensors stay valid until they die,
        and the arena goes with the last of them. Frees that failed earlier are retried: one that
        fails again raises FreeFailedError once the manager is closed (each later free retries)."""
        self.context.restore()  # frees need the device back
        with self._serial.held():
            if self._front.is_closed:
                return
            self._guard.clear()  # their sources hold the engine's tensors (its model, its KV)
            unfreed = self._front.close()
        self._tag_pools.release()  # pools die (and free through raw_free) once unused
        self.context.close()
        self._finalizer()
        if unfreed is not None:
            raise unfreed
