"""The engine's step: schedule a batch, launch its call, read it back, apply its tokens.

Without async scheduling each call is read back as soon as it is launched. With it
(``EngineConfig.async_scheduling``) a step queues the next decode call before it reads the one
in flight (``engine/successor.py``), so the device computes while the host applies tokens; a
step then ends with a call still running. Every command to the workers first completes the
calls in flight (THE DRAIN RULE, ``engine/calls_in_flight.py``); what those calls finished is
kept here and returned by the next ``step`` (or ``pop_drained``).

A call that fails discards every call in flight, and the scheduler redoes each running
sequence from recomputed KV (``Scheduler.preempt_all``).
"""

from __future__ import annotations

from collections.abc import Callable

from dormant.engine.batch import ScheduledBatch
from dormant.engine.calls_in_flight import CallsInFlight
from dormant.engine.output_processor import OutputProcessor
from dormant.engine.outputs import RequestOutput
from dormant.engine.scheduler import Scheduler
from dormant.engine.spec_stats import SpecDecodeStats
from dormant.engine.speculation import record_step
from dormant.executors import Executor


class StepPipeline:
    """The calls in flight between the scheduler and the executor, and what they finished.

    ``scheduler`` and ``spec_decode_stats`` are read at each step (benchmarks and tests swap
    the engine's; None: no speculative decoding); ``prepare`` runs before each batch is
    scheduled from scratch (the engine's checks that it can generate, and its prefix-cache
    epoch)."""

    def __init__(
        self,
        executor: Executor,
        overlaps: bool,
        scheduler: Callable[[], Scheduler],
        outputs: OutputProcessor,
        eos_token_ids: frozenset[int],
        spec_decode_stats: Callable[[], SpecDecodeStats | None],
        prepare: Callable[[], None],
    ) -> None:
        self._calls = CallsInFlight(executor, overlaps)
        self._scheduler, self._outputs, self._prepare = scheduler, outputs, prepare
        self._eos_token_ids = eos_token_ids
        self._spec_decode_stats = spec_decode_stats
        self._drained: list[RequestOutput] = []  # finished by calls a command drained

    def __len__(self) -> int:
        """The calls in flight."""
        return len(self._calls)

    @property
    def has_work(self) -> bool:
        """A call in flight to read back, or requests a drained call finished to return."""
        return bool(self._calls) or bool(self._drained)

    @property
    def overlaps(self) -> bool:
        return self._calls.overlaps

    @overlaps.setter
    def overlaps(self, value: bool) -> None:
        if value and self._spec_decode_stats() is not None:
            raise ValueError("speculative decoding's steps cannot be launched ahead")
        self._calls.overlaps = value

    def step(self) -> list[RequestOutput]:
        """Reads back the call in flight (launching one first if none is) and, before applying
        its tokens, queues the call after it where its plan cannot depend on them
        (``Scheduler.schedule_successor``); returns the requests finished since the last step."""
        finished = self.pop_drained()
        calls, scheduler = self._calls, self._scheduler()
        if not len(calls):
            if not scheduler.has_unfinished:
                return finished
            self._prepare()
            batch = scheduler.schedule()
            assert batch is not None
            self._launch(batch)
        batch, _ = calls.oldest()
        if calls.overlaps and len(calls) == 1:
            successor = scheduler.schedule_successor(batch)
            if successor is not None:
                self._launch(successor)
        return finished + self._complete_oldest()

    def drain(self) -> None:
        """Completes every call in flight (THE DRAIN RULE); keeps what they finished."""
        while len(self._calls):
            self._drained += self._complete_oldest()

    def pop_drained(self) -> list[RequestOutput]:
        """The requests finished by drained calls, once."""
        drained, self._drained = self._drained, []
        return drained

    def _launch(self, batch: ScheduledBatch) -> None:
        try:
            self._calls.launch(batch, batch.step_input(self._eos_token_ids))
        except BaseException:
            self._discard_calls()
            raise

    def _complete_oldest(self) -> list[RequestOutput]:
        """Reads the oldest call back and applies it; returns the requests it finished."""
        batch, pending = self._calls.pop_oldest()
        try:
            output = pending.result()
        except BaseException:
            self._discard_calls()
            raise
        num_before = [seq.num_output_tokens for seq in batch.seqs]
        tokens = [list(seq.token_ids) for seq in output.seqs]
        spec_stats = self._spec_decode_stats()
        if spec_stats is not None:
            record_step(batch.seqs, batch.num_draft_tokens, output, spec_stats)
        draft_computed = [seq.num_draft_computed_tokens for seq in output.seqs]
        outputs = self._outputs
        finished = self._scheduler().postprocess_steps(
            batch, tokens, outputs.on_token, draft_computed
        )
        outputs.record_step(batch.seqs, output.seqs, num_before)
        return outputs.pop_finished(finished)

    def _discard_calls(self) -> None:
        """After a failed call: every running sequence is redone from recomputed KV."""
        self._calls.clear()
        self._scheduler().preempt_all()
