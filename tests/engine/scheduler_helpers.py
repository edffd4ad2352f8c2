"""Scheduler test helpers."""

from __future__ import annotations

from dormant.engine.batch import ScheduledBatch
from dormant.engine.scheduler import Scheduler
from dormant.engine.sequence import Sequence


def postprocess(
    scheduler: Scheduler, batch: ScheduledBatch, token_ids: list[int]
) -> list[Sequence]:
    """``postprocess_steps`` for a one-step batch: ``token_ids[i]`` is for ``seqs[i]``."""
    return scheduler.postprocess_steps(batch, [[token_id] for token_id in token_ids])
