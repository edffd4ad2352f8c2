"""What the manager reports: per-tag state, the last sleep and wake, and the residual."""

from __future__ import annotations

from dataclasses import dataclass, field

from dormant.memory.copy_path import CopyPath
from dormant.memory.policy import Policy
from dormant.memory.states import State, TagState, describe

GiB = float(1 << 30)


def gbps(nbytes: int, seconds: float) -> float:
    """Decimal GB/s, the unit copy bandwidths are quoted in."""
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


@dataclass(frozen=True)
class TagStatus:
    """One tag, derived from its allocations when ``status()`` was called.

    ``num_by_state`` counts the tag's allocations in each ``State`` (every state is a key), so
    after a failed driver call it says exactly how many are mapped, offloaded, discarded, or in
    between (UNMAPPED: unmapped with the handle kept).
    """

    tag: str
    state: TagState
    num_by_state: dict[State, int]
    reserved_bytes: int  # the bytes of its allocations (mapped or not; trimmed slabs as trimmed)
    mapped_bytes: int
    held_bytes: int  # physical memory held: mapped, plus unmapped with the handle kept
    host_bytes: int  # arena bytes held for this tag's allocations
    block_bytes: int = 0  # bytes in live blocks; reserved_bytes less this is slab slack

    @property
    def num_allocations(self) -> int:
        return sum(self.num_by_state.values())

    @property
    def asleep_policy(self) -> Policy | None:
        """HOST when every allocation is offloaded, DISCARD when every one is discarded."""
        return {TagState.OFFLOADED: Policy.HOST, TagState.DISCARDED: Policy.DISCARD}.get(self.state)

    def describe(self) -> str:
        """``state`` and, when the tag is PARTIAL, how many allocations are in which state."""
        return describe(self.state, self.num_by_state)


@dataclass(frozen=True)
class SleepReport:
    """One sleep. ``tags`` are the tags it put to sleep (empty for a no-op)."""

    tags: dict[str, Policy] = field(default_factory=dict)
    total_s: float = 0.0
    sync_s: float = 0.0
    arena_s: float = 0.0  # growing (populating + pinning) the host arena
    hash_s: float = 0.0  # hashing, less the releases made while later groups still hashed
    copy_s: float = 0.0  # copies, with the unmaps and releases overlapped under them
    release_s: float = 0.0  # inside the HOST allocations' unmap and release calls, in all
    discard_s: float = 0.0  # inside the DISCARD allocations' (under the copies if they hide it)
    bytes_copied: int = 0
    bytes_skipped: int = 0  # HOST bytes unchanged since their last offload: not copied again
    bytes_released: int = 0  # physical memory given back

    @property
    def copy_gbps(self) -> float:
        return gbps(self.bytes_copied, self.copy_s)


@dataclass(frozen=True)
class WakeReport:
    """One wake. ``tags`` are the tags it woke (empty for a no-op).

    ``lost`` lists (tag, bytes) whose contents could not be restored: OFFLOADED allocations whose
    host copy had never completed. They come back zeroed (poisoned in poison mode). With the sleep
    order of DESIGN §2.3 this cannot happen; if it ever does, it is reported here, never silent.

    ``copy_path`` is how the copies ran (copy_path.py; None when the wake copied nothing), with
    the bytes each path carried; ``recent_release_bytes`` what the policy saw released within its
    window just before the wake.
    """

    tags: tuple[str, ...] = ()
    total_s: float = 0.0
    map_s: float = 0.0  # mapping, with the copies already running under it
    copy_s: float = 0.0  # poison fill, then what is left of the copies
    bytes_mapped: int = 0
    bytes_copied: int = 0
    lost: tuple[tuple[str, int], ...] = ()
    copy_path: CopyPath | None = None
    bytes_copy_engine: int = 0
    bytes_sm: int = 0
    recent_release_bytes: int = 0

    @property
    def bytes_lost(self) -> int:
        return sum(n for _, n in self.lost)

    @property
    def copy_gbps(self) -> float:
        """Copy bandwidth over the whole wake (the copies run under the mapping)."""
        return gbps(self.bytes_copied, self.total_s)


@dataclass(frozen=True)
class ResidualItem:
    owner: str
    nbytes: int


@dataclass(frozen=True)
class ContextReport:
    """The process's CUDA state released to the driver (``release_context``) and restored.

    Process figures are NVML's accounting of this process on the device (None: unknown).
    """

    is_released: bool
    checkpoint_s: float  # lock + checkpoint
    restore_s: float | None = None  # restore + unlock (None while released)
    process_bytes_before: int | None = None  # just before the checkpoint
    process_bytes_released: int | None = None  # right after it: what the GPU still shows for us
    process_bytes_restored: int | None = None  # right after the restore

    def describe(self) -> str:
        def mib(n: int | None) -> str:
            return "unknown" if n is None else f"{n / 2**20:.1f} MiB"

        text = (
            f"CUDA context {'released' if self.is_released else 'restored'}: checkpoint "
            f"{self.checkpoint_s * 1e3:.0f} ms (process {mib(self.process_bytes_before)} -> "
            f"{mib(self.process_bytes_released)})"
        )
        if self.restore_s is not None:
            text += f", restore {self.restore_s * 1e3:.0f} ms ({mib(self.process_bytes_restored)})"
        return text


@dataclass(frozen=True)
class MemoryStatus:
    backend: str
    device: str
    tags: tuple[TagStatus, ...]
    device_used_bytes: int
    device_total_bytes: int
    arena_capacity_bytes: int
    arena_used_bytes: int
    last_sleep: SleepReport | None
    last_wake: WakeReport | None
    residual: tuple[ResidualItem, ...]  # device memory in use now, by owner (residual.py)
    released: tuple[ResidualItem, ...] = ()  # what the last sleep gave back beyond the tags
    context: ContextReport | None = None  # the last release of the CUDA context, if any
    unfreed_bytes: int = 0  # held by dead blocks whose free failed; retried at the next call

    def tag(self, name: str) -> TagStatus:
        for status in self.tags:
            if status.tag == name:
                return status
        raise KeyError(name)

    def table(self) -> str:
        """A human-readable report."""
        lines = [f"dormant memory on {self.device} ({self.backend} backend)"]
        lines.append(
            f"  {'tag':<12} {'state':<10} {'allocs':>6} {'mapped MiB':>11} {'host MiB':>9}"
        )
        for t in self.tags:
            lines.append(
                f"  {t.tag:<12} {t.state.value:<10} {t.num_allocations:>6} "
                f"{t.mapped_bytes / 2**20:>11.1f} {t.host_bytes / 2**20:>9.1f}"
            )
            if t.state is TagState.PARTIAL:
                lines.append(f"    in between: {t.describe()}")
        lines.append(
            f"  device in use {self.device_used_bytes / GiB:.3f} of "
            f"{self.device_total_bytes / GiB:.1f} GiB; host arena "
            f"{self.arena_used_bytes / GiB:.3f} of {self.arena_capacity_bytes / GiB:.3f} GiB"
        )
        if self.unfreed_bytes:
            lines.append(
                f"  UNFREED {self.unfreed_bytes:,} bytes: a free failed; the next call retries it"
            )
        lines.append("  device memory in use, by owner:")
        lines += [f"    {r.owner:<52} {r.nbytes / 2**20:>10.1f} MiB" for r in self.residual]
        if self.context is not None:
            lines.append(f"  {self.context.describe()}")
        if self.released:
            lines.append("  given back beyond the tags:")
            lines += [f"    {r.owner:<52} {r.nbytes / 2**20:>10.1f} MiB" for r in self.released]
        if self.last_sleep is not None:
            s = self.last_sleep
            lines.append(
                f"  last sleep {s.total_s * 1e3:.1f} ms: copied {s.bytes_copied / GiB:.3f} GiB "
                f"at {s.copy_gbps:.1f} GB/s, skipped {s.bytes_skipped / GiB:.3f} GiB unchanged, "
                f"released {s.bytes_released / GiB:.3f} GiB"
            )
        if self.last_wake is not None:
            w = self.last_wake
            lines.append(
                f"  last wake {w.total_s * 1e3:.1f} ms: mapped {w.bytes_mapped / GiB:.3f} GiB, "
                f"copied {w.bytes_copied / GiB:.3f} GiB at {w.copy_gbps:.1f} GB/s"
                + ("" if w.copy_path is None else f" ({w.copy_path.value})")
            )
            lines += [f"  LOST on that wake: {tag} {n:,} bytes (no host copy)" for tag, n in w.lost]
        return "\n".join(lines)
