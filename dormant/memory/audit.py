"""The scope audit (DESIGN §2.5): who put what into which tag.

Every block is recorded with its size and the first call site outside torch and the memory layer.
A block is *declared* when its owner said it is meant to be there: the explicit API and ``adopt``
declare implicitly; raw allocations (capture scopes, allocator plugins) are undeclared until
``declare_backing``. Strict mode refuses to discard a tag that holds undeclared blocks: that is
the bug class where block tables were allocated inside the KV-cache pool and silently discarded.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from types import FrameType

import torch

from dormant.memory.errors import StrictModeError

_SKIPPED_DIRS = (
    os.path.dirname(torch.__file__) + os.sep,
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
    os.path.dirname(os.__file__) + os.sep + "contextlib.py",
)


def call_site() -> str:
    """``file:line in function`` of the first frame outside torch, dormant.memory and contextlib."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_SKIPPED_DIRS) and not filename.startswith("<"):
            return f"{filename}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "<unknown>"


@dataclass(frozen=True)
class AuditRecord:
    tag: str
    address: int
    nbytes: int
    kind: str
    site: str
    is_declared: bool

    def contains(self, address: int) -> bool:
        return self.address <= address < self.address + self.nbytes


@dataclass(frozen=True)
class AuditReport:
    """The live blocks of the audited tags, largest first."""

    records: tuple[AuditRecord, ...]

    @property
    def undeclared(self) -> tuple[AuditRecord, ...]:
        return tuple(r for r in self.records if not r.is_declared)

    def by_tag(self, tag: str) -> tuple[AuditRecord, ...]:
        return tuple(r for r in self.records if r.tag == tag)

    def __str__(self) -> str:
        if not self.records:
            return "audit: no allocations in discardable tags"
        lines = [f"{'tag':<12} {'bytes':>14} {'kind':<8} {'declared':<8} site"]
        for r in self.records:
            declared = "yes" if r.is_declared else "NO"
            lines.append(f"{r.tag:<12} {r.nbytes:>14,} {r.kind:<8} {declared:<8} {r.site}")
        return "\n".join(lines)


def make_report(records: Iterable[AuditRecord]) -> AuditReport:
    return AuditReport(tuple(sorted(records, key=lambda r: (r.tag, -r.nbytes, r.address))))


def describe_undeclared(tag: str, records: Iterable[AuditRecord]) -> str:
    lines = [
        f"strict mode: tag {tag!r} is about to be discarded but holds allocations nobody declared "
        "as backing; their contents would be lost at sleep:"
    ]
    lines += [f"  {r.nbytes:,} bytes at {r.address:#x}, allocated at {r.site}" for r in records]
    lines.append(
        "Allocate persistent state (block tables, layouts, scales, graph inputs) in 'runtime', or "
        "call mm.declare_backing(tensor) if the memory really is discardable backing."
    )
    return "\n".join(lines)


def check_strict(records: Iterable[AuditRecord], discarding: Iterable[str]) -> None:
    """Raises StrictModeError if a tag in ``discarding`` holds an undeclared block."""
    undeclared = [r for r in records if not r.is_declared]
    for tag in discarding:
        found = [r for r in undeclared if r.tag == tag]
        if found:
            raise StrictModeError(describe_undeclared(tag, found))
