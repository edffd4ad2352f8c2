"""Typed errors of the refit transports (IPC handles, weight-update groups)."""

from __future__ import annotations

from dormant.errors import EngineError


class WeightTransferError(EngineError):
    """Weights sent by another process could not be received or rebuilt: a stale or corrupted
    handle, a sender that died, a broadcast that failed or timed out.

    The message says whether anything was written. If it was, the rank's refit record marks
    every weight stale, so the engine refuses to generate until a complete refit.
    """


class UpdateGroupError(EngineError, ValueError):
    """A weight-update group call that cannot be honoured as asked (an unknown or duplicate
    group name, a rank outside the group, an unknown backend); nothing was changed, unless it is
    an ``UpdateGroupDestroyedError``."""


class UpdateGroupDestroyedError(UpdateGroupError):
    """An ``update_weights_from_distributed`` request whose lists or format do not say what the
    trainer broadcasts beside it (lists of different lengths, an unknown dtype, a shape that is
    not a list of non-negative ints, an unknown ``load_format``): nothing was received or
    written, and the group was destroyed, so that the trainer's broadcast fails instead of
    waiting for a receiver. Both sides must create the group again."""
