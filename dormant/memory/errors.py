"""Typed errors of the memory layer.

Every error says what was wrong, what state the memory is in, and what to do instead.
A call that raises one of these (except :class:`DriverError` and its subclasses) has changed no
state. After a ``DriverError`` every step that landed is recorded: ``status()`` tells the truth.
"""

from __future__ import annotations

from collections.abc import Mapping

from dormant.memory.states import TagState


class MemoryLayerError(RuntimeError):
    """Base class of every error raised by ``dormant.memory``."""


class UnknownTagError(MemoryLayerError, KeyError):
    """A tag that was never registered with the manager."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class UnknownPolicyError(MemoryLayerError, ValueError):
    """A policy that is not one of KEEP, HOST, DISCARD."""


class UnknownDiscardOrderError(MemoryLayerError, ValueError):
    """A discard order that is not one of ``DiscardOrder``'s (offload.py)."""


class CopyPolicyError(MemoryLayerError, ValueError):
    """A wake copy policy (copy_path.py) with an unknown mode or path, or an invalid number."""


class SleepConflictError(MemoryLayerError):
    """A sleep request conflicts with how a tag is already asleep (a different policy)."""


class TagAsleepError(MemoryLayerError):
    """Allocating in, or touching, a tag whose memory is not mapped."""


class OutOfMemoryError(MemoryLayerError):
    """The backend could not create physical memory.

    Attributes:
        bytes_requested: bytes the failing operation asked for in total.
        bytes_free: bytes the backend reported free when it failed.
    """

    def __init__(self, message: str, bytes_requested: int, bytes_free: int) -> None:
        super().__init__(message)
        self.bytes_requested = bytes_requested
        self.bytes_free = bytes_free

    def __reduce__(self) -> tuple[type, tuple[str, int, int]]:
        # Travels back from a tensor-parallel worker as itself.
        return type(self), (str(self), self.bytes_requested, self.bytes_free)


class WakeOutOfMemoryError(OutOfMemoryError):
    """Wake could not map everything; it rolled back and the states are unchanged."""


class HostArenaError(MemoryLayerError):
    """The host arena could not be grown or pinned."""


class StrictModeError(MemoryLayerError):
    """Strict mode found undeclared allocations in a tag about to be discarded."""


class PointerGuardError(MemoryLayerError):
    """A guarded tensor no longer has the address it had when it was guarded."""


class ManagerClosedError(MemoryLayerError):
    """The manager was closed."""


class ManagerExistsError(MemoryLayerError):
    """A second live manager was created for a device that already has one."""


class DriverError(MemoryLayerError):
    """A CUDA driver call failed. The message names the call and the CUDA error string."""


class TransitionFailedError(DriverError):
    """A driver call failed in the middle of a sleep or a wake.

    The message names the failed call and says what every involved tag now is. Every step that
    landed before the failure is recorded and nothing is leaked: ``status()`` tells the truth,
    ``wake_up()`` maps back everything not mapped, and a sleep with the same policies completes.

    Attributes:
        tag_states: each involved tag's state after the failure.
    """

    def __init__(self, message: str, tag_states: Mapping[str, TagState]) -> None:
        super().__init__(message)
        self.tag_states = dict(tag_states)

    def __reduce__(self) -> tuple[type, tuple[str, dict[str, TagState]]]:
        return type(self), (str(self), self.tag_states)


class SleepFailedError(TransitionFailedError):
    """A sleep stopped at a failed driver call; what had been released stays released."""


class WakeFailedError(TransitionFailedError):
    """A wake stopped at a failed driver call; it rolled back, so every state is as it was."""


class FreeFailedError(DriverError):
    """A driver call failed while the memory of dead blocks was being freed.

    The allocation is kept, described as the failed call left it (its handle, mapping and VA
    reservation still held, never released twice), and listed by ``status()`` as unfreed. The
    manager retries the free at its next call and at ``close()``; this error is raised by the
    call whose retry fails again, or by a ``raw_free`` whose own free failed.
    """
