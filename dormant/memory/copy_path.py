"""How a wake copies its HOST bytes back: by the copy engines, by SM kernels, or by both.

Why there is a choice (issue 17): for ~0.25 s after a large ``cuMemRelease`` the driver reclaims
the released memory with the copy engines, and pinned host-to-device copies drop from 55 to
28 GB/s, while an SM kernel that reads the pinned memory through its device mapping stays at
50 GB/s (H200, benchmarks/results/2026-12-02d-run3-release-contention.jsonl). A wake that starts
right after a sleep released 60-75 GB ran at 1.5 x the copy limit; 0.25 s later, at 1.07 x.

``CopyPathPolicy.choose`` decides once per wake, at its start, from the manager's
``ReleaseHistory``:

    mode          path taken
    AUTO          ``busy_path`` if at least ``min_release_bytes`` were released in the last
                  ``window_s`` seconds, else COPY_ENGINE
    COPY_ENGINE   COPY_ENGINE (what every wake did before)
    SM            SM
    HYBRID        HYBRID: each copy split, ``sm_fraction`` of it by SM kernels on their own
                  streams, the rest by the copy engines, concurrently

Why these defaults (the H200 runs of 2026-12-02d; to be confirmed on the GPU by
benchmarks/wake_after_release.py --copy-path all and benchmarks/release_contention.py):
- ``busy_path`` SM: the only path measured inside the reclaim (50 against 28 GB/s). Outside it
  the SM path is ~8% slower than the copy engines (50 against 55 GB/s), so a 16 GiB wake by SM
  is expected at ~1.15-1.25 x the copy limit: better than 1.5 x, short of the 1.1 x target.
  HYBRID could reach the limit if the reclaim leaves the link half idle (CE 28 + SM ~27) and the
  two share it fairly afterwards; that is unmeasured, and the benchmark decides.
- ``window_s`` 0.2: the copy engines ran at half speed for 0.25 s after a 60 GiB release. With
  SM at 50 and CE at 28 -> 55 GB/s, SM wins on a 16 GiB wake only while more than ~65 ms of the
  reclaim remain: a wake starting up to ~0.19 s after the release. (At a 0.25 s gap the copy
  engines already woke at 1.07 x.)
- ``min_release_bytes`` 32 GiB: a weights-only sleep that released 16 GiB slowed the next wake
  by only ~9 ms (1.10 against 1.07 x), less than SM's ~25-50 ms; the KV releases of 56-75 GB
  cost 80-125 ms. The threshold sits between the two.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import NamedTuple

from dormant.memory.errors import CopyPolicyError
from dormant.memory.policy import member_named
from dormant.memory.release_history import ReleaseHistory

GiB = 1 << 30
ENV_VAR = "DORMANT_WAKE_COPY_PATH"  # auto | copy_engine | sm | hybrid: forces a manager's mode


class CopyPath(enum.Enum):
    """How a batch of host<->device copies is carried out."""

    COPY_ENGINE = "copy_engine"  # cuMemcpyAsync: the DMA copy engines
    SM = "sm"  # elementwise kernels reading/writing pinned memory through its device mapping
    HYBRID = "hybrid"  # each copy split between the two, run concurrently


class CopyMode(enum.Enum):
    """What a policy is asked to do: decide (AUTO), or force one path."""

    AUTO = "auto"
    COPY_ENGINE = "copy_engine"
    SM = "sm"
    HYBRID = "hybrid"

    @classmethod
    def parse(cls, value: CopyMode | CopyPath | str) -> CopyMode:
        """A CopyMode, a CopyPath (forced) or either's value; raises CopyPolicyError otherwise."""
        if isinstance(value, CopyPath):
            return cls(value.value)
        member = member_named(cls, value)
        if member is None:
            names = ", ".join(repr(m.value) for m in cls)
            raise CopyPolicyError(f"unknown copy mode {value!r}; use one of {names}")
        return member


class CopyChoice(NamedTuple):
    """A policy's decision for one wake, with what it saw."""

    path: CopyPath
    recent_release_bytes: int  # released within the policy's window before the wake


@dataclass(frozen=True)
class CopyPathPolicy:
    """Chooses a wake's copy path (see the module's table). Frozen: replace it to change it."""

    mode: CopyMode = CopyMode.AUTO
    window_s: float = 0.2
    min_release_bytes: int = 32 * GiB
    busy_path: CopyPath = CopyPath.SM
    sm_fraction: float = 0.5  # HYBRID: the share of each copy's bytes the SM kernels take

    def __post_init__(self) -> None:
        if not isinstance(self.mode, CopyMode) or not isinstance(self.busy_path, CopyPath):
            raise CopyPolicyError(
                f"mode must be a CopyMode and busy_path a CopyPath, got {self.mode!r} and "
                f"{self.busy_path!r} (CopyMode.parse reads a name)"
            )
        if self.window_s < 0 or self.min_release_bytes < 0:
            raise CopyPolicyError(
                f"window_s and min_release_bytes must not be negative, got {self.window_s} "
                f"and {self.min_release_bytes}"
            )
        if not 0.0 < self.sm_fraction < 1.0:
            raise CopyPolicyError(f"sm_fraction must be in (0, 1), got {self.sm_fraction}")

    @classmethod
    def parse(cls, value: CopyPathPolicy | CopyMode | CopyPath | str | None) -> CopyPathPolicy:
        """A policy as given; a mode (or its name) with the default numbers; None: the mode in
        ``$DORMANT_WAKE_COPY_PATH`` if set, else AUTO."""
        if isinstance(value, CopyPathPolicy):
            return value
        if value is None:
            value = os.environ.get(ENV_VAR) or CopyMode.AUTO
        return cls(mode=CopyMode.parse(value))

    def choose(self, history: ReleaseHistory) -> CopyChoice:
        """The path for a wake starting now."""
        recent = history.recent_bytes(self.window_s)
        if self.mode is not CopyMode.AUTO:
            return CopyChoice(CopyPath(self.mode.value), recent)
        is_busy = recent > 0 and recent >= self.min_release_bytes
        return CopyChoice(self.busy_path if is_busy else CopyPath.COPY_ENGINE, recent)
