"""The states of one allocation and of one tag (DESIGN §2.3). Plain enums, importing nothing.

An allocation's ``State`` is the one store of truth; a tag's ``TagState`` is derived from the states
of its allocations (``tag_machine.tag_state``) and never stored.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping


class State(enum.Enum):
    """Where one allocation's contents are, and whether its physical memory exists.

    ==========  ======================  ========================  ==============================
    state       physical memory         VA range                  contents
    ==========  ======================  ========================  ==============================
    MAPPED      held (``handle``)       mapped to the handle      live, at the VA
    UNMAPPED    held (``handle``)       reserved, inaccessible    intact, in the handle
    OFFLOADED   none                    reserved, inaccessible    in the arena (if copy valid)
    DISCARDED   none                    reserved, inaccessible    gone
    ==========  ======================  ========================  ==============================

    UNMAPPED is the in-between state of a sleep whose ``release`` failed after its ``unmap``
    succeeded: the handle (the ownership record) is kept, so nothing leaks and a wake can map it
    back with its contents, or a later sleep can retry the release.
    """

    MAPPED = "mapped"
    UNMAPPED = "unmapped"
    OFFLOADED = "offloaded"
    DISCARDED = "discarded"


class TagState(enum.StrEnum):
    """A tag's state, derived from its allocations' states.

    ==========  =====================================================================
    AWAKE       every allocation is MAPPED, or the tag has none (nothing to sleep)
    OFFLOADED   every allocation is OFFLOADED
    DISCARDED   every allocation is DISCARDED
    PARTIAL     anything else: a sleep or wake stopped at a failed driver call, or
                an allocation is UNMAPPED. ``wake_up`` maps it all back; a sleep with
                the same policy completes it.
    ==========  =====================================================================

    A ``StrEnum``, so a member also compares equal to its value (``"offloaded"``), which is what
    ``TagStatus.state`` used to be.
    """

    AWAKE = "awake"
    OFFLOADED = "offloaded"
    DISCARDED = "discarded"
    PARTIAL = "partial"


def describe(state: TagState, num_by_state: Mapping[State, int]) -> str:
    """``"offloaded"``, or for a PARTIAL tag ``"partial (2 mapped, 1 unmapped, 3 offloaded)"``."""
    if state is not TagState.PARTIAL:
        return state.value
    counts = ", ".join(f"{n} {s.value}" for s, n in num_by_state.items() if n)
    return f"{state.value} ({counts})"
