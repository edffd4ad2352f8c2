"""Requests into the engine and out of it early: each is tokenized and validated before anything
is queued (``request_input.py``: a refused request changes nothing), then queued as its
``params.n`` sequences; an abort finishes them with finish_reason "abort"."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable

from dormant.core.sampling_params import SamplingParams
from dormant.engine.output_processor import OutputProcessor
from dormant.engine.outputs import RequestOutput
from dormant.engine.request_input import Prompt, RequestInput, RequestLimits, make_request_input
from dormant.engine.scheduler import Scheduler
from dormant.engine.sequence import SequenceFactory
from dormant.engine.tokenizer import Tokenizer


class RequestIntake:
    def __init__(
        self,
        tokenizer: Tokenizer | None,
        limits: RequestLimits,
        seed: int,
        scheduler: Callable[[], Scheduler],
        outputs: OutputProcessor,
    ) -> None:
        self._tokenizer, self._limits = tokenizer, limits
        self._sequences = SequenceFactory(random.Random(seed))
        self._scheduler, self._outputs = scheduler, outputs

    def make(self, prompt: Prompt, params: SamplingParams) -> RequestInput:
        return make_request_input(prompt, params, self._tokenizer, self._limits)

    def add(self, request: RequestInput) -> int:
        """Queues ``params.n`` sequences; the first add raises (queuing nothing) if the prompt
        cannot fit. With prefix caching the first computes the prompt's KV and the others fork
        from it (``engine/forks.py``: they compute none of the prompt), or, where they cannot,
        hit its full blocks."""
        params, token_ids = request.params, request.prompt_token_ids
        seqs = [self._sequences.create(token_ids, params, index) for index in range(params.n)]
        first, scheduler = seqs[0], self._scheduler()
        for seq in seqs:
            scheduler.add(seq, fork_of=None if seq is first else first)
        self._outputs.add(first.seq_id, request.prompt, token_ids, params, seqs)
        return first.seq_id

    def abort(self, request_ids: Iterable[int] | None) -> list[RequestOutput]:
        """Unknown or finished ids are ignored; None aborts every request."""
        ids = None if request_ids is None else list(request_ids)
        aborted = self._scheduler().abort(self._outputs.seq_ids(ids))
        return self._outputs.pop_finished(aborted)
