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

Why these defaults (measured on the H200, results/2026-12-02e-run3-wake-copy-path.jsonl and
-release-contention.jsonl: a 16 GiB level-1 wake of the 8B-like mix after a sleep that released
56 GiB of KV, against the pinned-copy limit):

    path          no recent release      right after the release    0.05 s after   0.25 s after
    COPY_ENGINE   1.00-1.10 x            1.51 x                     1.34 x         1.10 x
    SM            1.08-1.16 x            1.08 x                     1.26 x         1.16 x
    HYBRID        1.07-1.13 x            1.52 x                     1.35 x         1.14 x

- ``busy_path`` SM: inside the reclaim it is at 1.08-1.26 x where the copy engines are at
  1.34-1.51 x (the probe: SM reads at 49.6 GB/s through it, copy engines 27.3 GB/s, HYBRID
  36 GB/s, worse than SM alone; with no release SM 49.9, HYBRID 51.8, copy engines 55).
- ``window_s`` 0.5: a false positive costs SM's 4-8 % over the copy engines, a miss costs 35-50 %.
  With a 0.2 s window, a wake right after a sleep that copied 15 GB while it released 75 GB
  (most of it at the sleep's start, 0.28 s before the wake) took the copy engines and ran at
  1.46 x (both repeats), against 1.08 x by SM. The same case with the copy engines forced ran
  at 1.00 x; what differed was the case before it (its wake had gone by SM). Not understood;
  0.5 s covers it. At 0.25 s after a sleep that copied nothing the copy engines were at 1.10 x.
- ``min_release_bytes`` 48 GiB: the reclaim ran at about 240 GB/s (60 GiB in 0.25 s), so what
  it costs a wake grows with the bytes released. A weights-only sleep that released 16 GiB left
  the next wake at 1.09 x by the copy engines against 1.08 x by SM: nothing to gain. Releases of
  56-83 GB (the 8B-like engine's level-1 sleep, the probe's KV) cost 35-50 %. In between nothing
  was measured; 48 GiB keeps an 8B-like sleep of 32 GiB of KV plus 8 GiB of weights
  (``benchmarks/sleep_wake.py``'s shape, reclaimed in ~0.18 s, before its wake 0.25 s later) on
  the copy engines. A model of the reclaim's backlog (bytes released less 240 GB/s times the
  time since) would decide this from the bytes and the time together; not built.
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
    window_s: float = 0.5
    min_release_bytes: int = 48 * GiB
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
