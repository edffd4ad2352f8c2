"""The memory manager: tagged sleepable memory on one device, and its state machine (DESIGN §2).

States and transitions, per tag (every allocation of a tag shares its tag's state)::

    request              tag awake                 tag asleep with P          tag asleep with Q≠P
    ───────────────────  ────────────────────────  ─────────────────────────  ───────────────────
    sleep(tag: KEEP)     no-op                     no-op                      no-op
    sleep(tag: P)        sleep with P              no-op (idempotent)         SleepConflictError
    wake_up(tag)         no-op (idempotent)        map, restore/poison        map, restore/poison
    allocate in tag      allocate                  TagAsleepError             TagAsleepError
    free a tensor        unmap + release + VA      VA + host copy only        VA + host copy only

A request is validated completely before anything changes: an error leaves every state as it was.
Wake is transactional (see ``transitions.wake_allocations``). Errors are typed (``errors.py``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from functools import partial

import torch

from dormant.memory.adopt import adopt_module, tensor_specs
from dormant.memory.allocation import Kind, State
from dormant.memory.arena import HostArena
from dormant.memory.audit import AuditReport, describe_undeclared, make_report
from dormant.memory.backend import Backend, open_backend
from dormant.memory.blocks import BlockTable
from dormant.memory.capture import TagPools, capture_scope, in_capture_scope, require_cuda
from dormant.memory.errors import (
    ManagerClosedError,
    ManagerExistsError,
    MemoryLayerError,
    SleepConflictError,
    StrictModeError,
    TagAsleepError,
    UnknownTagError,
)
from dormant.memory.guard import PointerGuard, TensorSource
from dormant.memory.policy import (
    BUILTIN_TAGS,
    CUDA_GRAPH,
    Policy,
    as_tag_list,
    is_discardable,
    level_policies,
    parse_policies,
)
from dormant.memory.pool import BLOCK_ALIGNMENT, Block
from dormant.memory.serial import SerialSection
from dormant.memory.status import MemoryStatus, SleepReport, WakeReport
from dormant.memory.status_report import build_status
from dormant.memory.transitions import sleep_allocations, wake_allocations

_live_devices: set[str] = set()  # one manager per device per process
_live_devices_lock = threading.Lock()

Shape = Sequence[int] | torch.Size


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
        slab_bytes: size of the per-tag slabs that small blocks are carved from.
        host_capacity: capacity of the host backend in bytes (tests use it to provoke OOM).
    """

    def __init__(
        self,
        device: str | torch.device | Backend = "auto",
        *,
        poison: bool = False,
        strict: bool = False,
        keep_arena: bool = True,
        skip_unchanged: bool = True,
        slab_bytes: int = 2 << 20,
        host_capacity: int | None = None,
        arena_chunk_bytes: int = 1 << 30,
    ) -> None:
        self.backend = open_backend(device, host_capacity=host_capacity)
        with _live_devices_lock:
            if self.backend.device_key in _live_devices:
                raise ManagerExistsError(
                    f"a MemoryManager for {self.backend.device_key} already exists in this "
                    "process; share it, or close() it before creating another"
                )
            _live_devices.add(self.backend.device_key)
        self.poison, self.strict = poison, strict
        self.keep_arena, self.skip_unchanged = keep_arena, skip_unchanged
        self.arena = HostArena(self.backend, chunk_bytes=arena_chunk_bytes)
        self._user_tags: dict[str, dict[int, Policy]] = {}
        self._table = BlockTable(self.backend, self.arena, slab_bytes)
        for tag in BUILTIN_TAGS:
            self._table.add_tag(tag)
        self._asleep: dict[str, Policy] = {}
        self._guard = PointerGuard()
        self._serial = SerialSection()
        self._tag_pools = TagPools(self.raw_alloc, self.raw_free)
        self._is_closed = False
        self.last_sleep: SleepReport | None = None
        self.last_wake: WakeReport | None = None
        self._finalizer = weakref.finalize(self, _forget_device, self.backend.device_key)

    # ── tags ──────────────────────────────────────────────────────────────────────────────────

    @property
    def tags(self) -> tuple[str, ...]:
        return tuple(self._table.pools)

    def register_tag(self, tag: str, levels: Mapping[int, Policy | str] | None = None) -> None:
        """Adds a user tag. ``levels`` maps sleep levels to policies (default: HOST at 1 and 2)."""
        with self._op():
            if tag in self._table.pools:
                raise ValueError(f"tag {tag!r} already exists; tags: {list(self.tags)}")
            per_level = {int(k): Policy.parse(v) for k, v in (levels or {}).items()}
            self._user_tags[tag] = per_level
            self._table.add_tag(tag)

    def is_sleeping(self, tag: str | None = None) -> bool:
        """Whether ``tag`` (or, with None, any tag) is asleep."""
        if tag is None:
            return bool(self._asleep)
        self._check_tags([tag])
        return tag in self._asleep

    @property
    def asleep_tags(self) -> dict[str, Policy]:
        return dict(self._asleep)

    # ── allocation frontends ──────────────────────────────────────────────────────────────────

    def empty(self, shape: Shape, dtype: torch.dtype, tag: str) -> torch.Tensor:
        """An uninitialised tensor in ``tag``; its memory returns when its last view dies."""
        return self.empty_many([(shape, dtype)], tag)[0]

    def empty_many(
        self, specs: Sequence[tuple[Shape, torch.dtype]], tag: str
    ) -> list[torch.Tensor]:
        """Tensors packed into one block of ``tag`` (one storage: freed when all of them die)."""
        return self._empty_many(specs, tag, Kind.TENSOR)

    def adopt(
        self, module: torch.nn.Module, tag: str = "weights", buffer_tag: str = "runtime"
    ) -> torch.nn.Module:
        """Moves ``module``'s parameters into ``tag`` and its buffers into ``buffer_tag``.

        Each parameter keeps its identity (``param.data`` is swapped); buffers are replaced in their
        modules. Parameters and buffers on the meta device are materialised uninitialised.
        """
        return adopt_module(module, partial(self._empty_many, kind=Kind.ADOPTED), tag, buffer_tag)

    def raw_alloc(self, nbytes: int, tag: str) -> int:
        """The address of ``nbytes`` in ``tag``, for allocator plugins; undeclared."""
        with self._op():
            return self._allocate(max(nbytes, 1), tag, Kind.RAW).address

    def raw_free(self, address: int) -> None:
        """Frees memory from ``raw_alloc``; legal while its tag sleeps, and after ``close``
        (a capture pool returns its memory when its last user dies)."""
        with self._serial.held():
            self._free_block(self._table.raw_block(address))

    def declare_backing(self, memory: torch.Tensor | int) -> None:
        """Marks the block holding ``memory`` (a tensor, or an address from ``raw_alloc``) as
        backing: memory that is meant to be discarded with its tag."""
        address = memory if isinstance(memory, int) else memory.data_ptr()
        with self._op():
            self._table.declare(address)

    # ── torch integration (CUDA) ──────────────────────────────────────────────────────────────

    @contextmanager
    def capture(self, tag: str) -> Iterator[None]:
        """Routes this thread's torch CUDA allocations in scope into ``tag`` (see capture.py).

        The memory is undeclared: the audit lists it and strict mode refuses to discard it until
        ``declare_backing``. Do not call ``sleep``/``wake_up`` inside the scope.
        """
        require_cuda(self.backend.device, "capture()")
        self._check_tags([tag])
        with capture_scope(self._tag_pools.pool(tag)):
            yield

    def graph_pool(self, tag: str = CUDA_GRAPH) -> torch.cuda.MemPool:
        """The MemPool of ``tag``, for ``torch.cuda.graph(g, pool=mm.graph_pool().id)``: the
        graph's private memory then sleeps with ``tag`` (HOST at every level by default)."""
        require_cuda(self.backend.device, "graph_pool()")
        self._check_tags([tag])
        return self._tag_pools.pool(tag)

    # ── safety tools ──────────────────────────────────────────────────────────────────────────

    def audit(self, tags: Iterable[str] | None = None) -> AuditReport:
        """The live blocks of ``tags`` (default: every discardable tag), with their call sites."""
        with self._op():
            if tags is None:
                wanted = {t for t in self.tags if is_discardable(t, self._user_tags)}
            else:
                wanted = set(self._check_tags(as_tag_list(tags)))
            return make_report(r for r in self._table.records() if r.tag in wanted)

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
        with self._op():
            if isinstance(target, str):
                for allocation in self._table.allocations(self._check_tags([target])):
                    allocation.is_dirty = True
            else:
                self._table.find(target.data_ptr()).allocation.is_dirty = True

    # ── sleep and wake ────────────────────────────────────────────────────────────────────────

    def sleep(
        self, level: int | None = None, *, tags: Mapping[str, Policy | str] | None = None
    ) -> SleepReport:
        """Puts tags to sleep: by ``level`` preset, or by an explicit ``{tag: policy}``.

        Idempotent per tag; a tag asleep with another policy raises SleepConflictError and nothing
        changes. Synchronizes the device before copying or unmapping.
        """
        if (level is None) == (tags is None):
            raise TypeError("sleep() takes exactly one of level=... or tags={tag: policy}")
        request = level_policies(level, self._user_tags) if tags is None else parse_policies(tags)
        self._check_not_capturing("sleep()")
        with self._op():
            self._check_tags(request)
            self._guard.verify()
            active = {t: p for t, p in request.items() if p is not Policy.KEEP}
            conflicts = [
                f"{t!r} is asleep with {self._asleep[t].name}, asked for {p.name}"
                for t, p in active.items()
                if self._asleep.get(t, p) is not p
            ]
            if conflicts:
                raise SleepConflictError(
                    "conflicting sleep request: " + "; ".join(conflicts) + ". Nothing was changed; "
                    "wake_up() those tags first to sleep them differently."
                )
            plan = {t: p for t, p in active.items() if t not in self._asleep}
            by_policy = {
                policy: [t for t, p in plan.items() if p is policy]
                for policy in (Policy.HOST, Policy.DISCARD)
            }
            if self.strict:
                self._check_strict(by_policy[Policy.DISCARD])
            report = sleep_allocations(
                self.backend,
                self.arena,
                list(self._table.allocations(by_policy[Policy.HOST])),
                list(self._table.allocations(by_policy[Policy.DISCARD])),
                skip_unchanged=self.skip_unchanged,
            )
            self._asleep.update(plan)
            self.last_sleep = replace(report, tags=plan)
            return self.last_sleep

    def wake_up(self, tags: str | Iterable[str] | None = None) -> WakeReport:
        """Wakes ``tags`` (default: all) at their own addresses; waking an awake tag is a no-op.

        Transactional: if mapping fails nothing changes, and WakeOutOfMemoryError says how many
        bytes were needed and how many were free.
        """
        self._check_not_capturing("wake_up()")
        with self._op():
            names = list(self._asleep) if tags is None else self._check_tags(as_tag_list(tags))
            waking = [t for t in dict.fromkeys(names) if t in self._asleep]
            self._guard.verify()
            allocations = [
                a for a in self._table.allocations(waking) if a.state is not State.MAPPED
            ]
            report = wake_allocations(self.backend, allocations, poison=self.poison)
            for tag in waking:
                del self._asleep[tag]
            if not self.keep_arena:
                self._table.drop_host_copies()
            self.last_wake = replace(report, tags=tuple(waking))
            return self.last_wake

    # ── status and lifetime ───────────────────────────────────────────────────────────────────

    def status(self) -> MemoryStatus:
        with self._op():
            return build_status(self, self._table.pools, self._asleep)

    def close(self) -> None:
        """Stops new operations and frees the device slot; live tensors stay valid until they die,
        and the arena goes with the last of them."""
        with self._serial.held():
            if self._is_closed:
                return
            self._is_closed = True
            if self._table.is_empty:
                self.arena.release()
        self._tag_pools.release()  # pools die (and free through raw_free) once unused
        self._finalizer()

    # ── internals ─────────────────────────────────────────────────────────────────────────────

    @contextmanager
    def _op(self) -> Iterator[None]:
        with self._serial.held():
            if self._is_closed:
                raise ManagerClosedError("this MemoryManager was closed; create a new one")
            yield

    def _check_not_capturing(self, what: str) -> None:
        if in_capture_scope():
            raise MemoryLayerError(
                f"{what} inside a capture scope: its own torch allocations would be captured "
                "into a tag. Leave the `with mm.capture(...)` block first."
            )

    def _check_tags(self, tags: Iterable[str]) -> list[str]:
        names = list(tags)
        unknown = [t for t in names if t not in self._table.pools]
        if unknown:
            raise UnknownTagError(
                f"unknown tag(s) {unknown}; known tags: {list(self.tags)}. "
                "Add your own with register_tag()."
            )
        return names

    def _check_strict(self, discarding: list[str]) -> None:
        for tag in discarding:
            undeclared = [r for r in self._table.records() if r.tag == tag and not r.is_declared]
            if undeclared:
                raise StrictModeError(describe_undeclared(tag, undeclared))

    def _empty_many(
        self, specs: Sequence[tuple[Shape, torch.dtype]], tag: str, kind: Kind
    ) -> list[torch.Tensor]:
        layout, nbytes = tensor_specs(specs, BLOCK_ALIGNMENT)
        with self._op():
            if nbytes == 0:
                self._check_tags([tag])
                return [torch.empty(s, dtype=d, device=self.backend.device) for s, d in specs]
            block = self._allocate(nbytes, tag, kind)
            try:
                on_free = partial(self._on_storage_freed, block)
                raw = self.backend.view(block.address, nbytes, on_free)
            except BaseException:
                self._free_block(block)
                raise
        return [
            raw[o : o + n].view(d).view(s) for (s, d), (o, n) in zip(specs, layout, strict=True)
        ]

    def _allocate(self, nbytes: int, tag: str, kind: Kind) -> Block:
        self._check_tags([tag])
        if tag in self._asleep:
            raise TagAsleepError(
                f"cannot allocate in tag {tag!r}: it is asleep ({self._asleep[tag].name}). "
                f"wake_up([{tag!r}]) first."
            )
        return self._table.allocate(nbytes, tag, kind)

    def _on_storage_freed(self, block: Block) -> None:
        """Deleter of a tensor storage; may run on any thread, even inside one of our own calls."""
        self._serial.defer(partial(self._free_block, block))

    def _free_block(self, block: Block) -> None:
        self._table.free(block)
        if self._is_closed and self._table.is_empty:
            self.arena.release()


def _forget_device(device_key: str) -> None:
    with _live_devices_lock:
        _live_devices.discard(device_key)
