"""How each tag's blocks share physical handles: one ``SlabRule`` per tag (``pool.py`` applies it).

A sleep pays per physical handle (~45 µs of unmap + release from Python on the H200, the same
again for create + map at the wake, and more per handle in the driver), so a tag's blocks are
carved from shared slabs. How far that goes depends on what lives in the tag::

    rule          blocks carved from slabs   a new slab is at most   a slab's free tail
    ────────────  ─────────────────────────  ──────────────────────  ─────────────────────────
    default       < max_slab_bytes / 16      1/8 of the tag's slabs  kept
    (512 MiB)     (32 MiB)                   (SLAB_GROWTH)
    LONG_LIVED    < max_slab_bytes           1/2 of the tag's slabs  trimmed once asleep: its
    (2 GiB)       (every block below 2 GiB)                          physical memory is not
                                                                     created again at the wake

The default suits tags whose blocks come and go (graph pools, capture scopes, workspaces): a slab
returns its memory only once all of its blocks are gone, so large blocks keep their own handles.
``LONG_LIVED`` suits tags that are filled once and kept, with large blocks (the ``weights`` tag:
an 8B model's ~130 matrices of 40-56 MiB would otherwise be ~130 handles; under it 8 GiB is 7).
Its price: a block freed in a slab returns its memory only with the slab's last block, and until
the first sleep the last slab's unused tail (at most half of what the tag holds, and at most
``max_slab_bytes``) is physical memory nobody uses; ``TagStatus.block_bytes`` shows it. From the
first sleep on, the tail is trimmed to the allocation granularity: its VA stays reserved, no new
block goes there, and the wake creates only what is left.

What changes with coarser slabs: unchanged detection and ``mark_dirty`` work per allocation, so
one tensor changed in a slab makes the next sleep copy the whole slab (a refit changes them all).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dormant.memory.errors import MemoryLayerError
from dormant.memory.policy import WEIGHTS

DEFAULT_COALESCE_FRACTION = 16


class InvalidSlabRuleError(MemoryLayerError, ValueError):
    """A slab rule whose sizes or fractions are not positive."""


@dataclass(frozen=True)
class SlabRule:
    """One tag's slab sizing (see the module docstring).

    ``max_slab_bytes`` (rounded up to the granularity) is the largest slab; blocks below
    ``max_slab_bytes / coalesce_fraction`` are carved from slabs; a new slab holds at most
    ``1/growth`` of the bytes the tag's slabs hold already (None: ``pool.SLAB_GROWTH``, read at
    each allocation); ``trims`` gives back a slab's unused tail once it sleeps.
    """

    max_slab_bytes: int = 512 << 20
    growth: int | None = None
    coalesce_fraction: int = DEFAULT_COALESCE_FRACTION
    trims: bool = False

    def __post_init__(self) -> None:
        numbers = {
            "max_slab_bytes": self.max_slab_bytes,
            "coalesce_fraction": self.coalesce_fraction,
        }
        if self.growth is not None:
            numbers["growth"] = self.growth
        bad = {name: value for name, value in numbers.items() if value < 1}
        if bad:
            raise InvalidSlabRuleError(
                f"a SlabRule needs positive sizes and fractions, got {bad}; e.g. "
                "SlabRule(max_slab_bytes=2 << 30, growth=2, coalesce_fraction=1, trims=True)"
            )


LONG_LIVED = SlabRule(max_slab_bytes=2 << 30, growth=2, coalesce_fraction=1, trims=True)

# The built-in tags with a rule of their own; every other tag gets the manager's default rule.
BUILTIN_SLAB_RULES: Mapping[str, SlabRule] = {WEIGHTS: LONG_LIVED}


def tag_slab_rules(overrides: Mapping[str, SlabRule] | None) -> dict[str, SlabRule]:
    """The tags with a rule of their own: the built-in ones when ``overrides`` is None, else
    exactly ``overrides`` (``{}``: every tag gets the manager's default rule)."""
    if overrides is None:
        return dict(BUILTIN_SLAB_RULES)
    for tag, rule in overrides.items():
        if not isinstance(rule, SlabRule):
            raise InvalidSlabRuleError(f"slab_rules[{tag!r}] must be a SlabRule, got {rule!r}")
    return dict(overrides)
