"""Continuous batching: each step is either a prefill of waiting sequences or a decode.

Sequences move between three queues:

| queue     | status  | holds blocks | KV computed               |
|-----------|---------|--------------|---------------------------|
| `pending` | WAITING | no           | none: a fork waiting for its source's first prefill |
| `waiting` | WAITING | no           | none (num_computed = 0)   |
| `running` | RUNNING | yes          | all but the newest token  |

The ``n`` samples of a request are one source sequence and ``n - 1`` forks of it. A fork stays
`pending` until its source's prefill step was postprocessed, then goes to the front of
`waiting`; when it is prefilled it shares its source's full prompt blocks (see
``BlockManager``) and computes only the rest of its prompt. Were the source no longer running
by then, the fork computes its whole prompt itself.

Invariants between calls:
    - every unfinished sequence added is in exactly one queue; finished ones in none;
    - ``len(running) <= config.max_num_seqs``;
    - only running sequences hold blocks (see ``BlockManager``);
    - at most one batch is in flight: ``schedule`` hands it out, ``postprocess`` takes it
      back, and ``preempt_all`` discards it.

Preemption is by recompute: the sequence's blocks are freed, it goes back to the front of
`waiting` with its output kept, and its next prefill recomputes the KV of all its tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from dormant.engine.batch import ScheduledBatch, SchedulerConfig
from dormant.engine.block_manager import BlockManager
from dormant.engine.sequence import FinishReason, Sequence, SequenceStatus
from dormant.errors import EngineError


class SchedulerError(EngineError):
    """Base class for misuse of the scheduler."""


class RequestTooLongError(SchedulerError, ValueError):
    """A request can never be served: its prompt or its KV exceeds what the engine holds."""


class DuplicateSequenceError(SchedulerError, ValueError):
    """A sequence id was added while a sequence with that id is still unfinished."""


# Called for each token appended, after the token-level stop checks: (sequence, token id,
# whether the token itself stops the sequence) -> the stop string the text now ends with, or
# None. The engine's output processor detokenizes there.
TokenHook = Callable[[Sequence, int, bool], str | None]


class Scheduler:
    """Decides which sequences run each step, and applies the sampled tokens."""

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        eos_token_ids: frozenset[int],
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self._waiting: deque[Sequence] = deque()
        self._running: deque[Sequence] = deque()
        self._pending_forks: dict[int, list[Sequence]] = {}  # by source seq_id, in order
        self._unfinished_by_id: dict[int, Sequence] = {}
        self._batch_in_flight: ScheduledBatch | None = None

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._unfinished_by_id)

    def unfinished(self, seq_id: int) -> Sequence | None:
        """The unfinished sequence with this id, or None (unknown, or finished)."""
        return self._unfinished_by_id.get(seq_id)

    def add(self, seq: Sequence) -> None:
        """Queue a new WAITING sequence at the back of `waiting`, or, for a fork whose source
        has not been prefilled yet, in `pending`.

        Raises ``RequestTooLongError`` if its prompt exceeds ``max_model_len`` or it could not
        run to completion even with the whole cache, and ``DuplicateSequenceError`` if its id
        is in use. Neither changes any state.
        """
        if seq.status is not SequenceStatus.WAITING or seq.block_table:
            raise SchedulerError(f"only new WAITING sequences without blocks can be added: {seq!r}")
        if seq.seq_id in self._unfinished_by_id:
            raise DuplicateSequenceError(f"sequence id {seq.seq_id} is already scheduled")
        max_model_len = self.config.max_model_len
        if seq.num_tokens > max_model_len:
            raise RequestTooLongError(
                f"sequence {seq.seq_id} has {seq.num_tokens} prompt tokens, more than "
                f"max_model_len={max_model_len}; shorten the prompt"
            )
        num_blocks = self.block_manager.num_blocks_for(self._max_num_kv_tokens(seq))
        if num_blocks > self.block_manager.num_blocks:
            raise RequestTooLongError(
                f"sequence {seq.seq_id} may need {num_blocks} KV blocks (prompt "
                f"{seq.num_prompt_tokens} + max_tokens {seq.params.max_tokens}, capped by "
                f"max_model_len={max_model_len}) but the cache has only "
                f"{self.block_manager.num_blocks}; lower max_tokens or grow the KV cache"
            )
        source = seq.fork_source
        if source is not None and source.seq_id not in self._unfinished_by_id:
            raise SchedulerError(f"the fork source of {seq!r} is not scheduled: add it first")
        if source is not None and source.num_output_tokens == 0:
            self._pending_forks.setdefault(source.seq_id, []).append(seq)
        else:
            self._waiting.append(seq)
        self._unfinished_by_id[seq.seq_id] = seq

    def schedule(self) -> ScheduledBatch | None:
        """Pick the next step: a prefill if any waiting sequence fits, else a decode.

        Returns ``None`` exactly when there is no unfinished sequence. Postcondition: every
        returned sequence is RUNNING and its block table covers all of its tokens.
        Precondition: the previous batch was postprocessed (else ``SchedulerError``).
        """
        if self._batch_in_flight is not None:
            raise SchedulerError("the previous batch is still in flight; postprocess it first")
        batch = self._schedule_prefill() or self._schedule_decode()
        if batch is None and self._unfinished_by_id:
            raise SchedulerError(
                f"no sequence can be scheduled: {self.num_waiting} waiting, "
                f"{self.num_running} running, {self.block_manager.num_free_blocks} free blocks"
            )
        self._batch_in_flight = batch
        return batch

    def postprocess_steps(
        self,
        batch: ScheduledBatch,
        token_ids: list[list[int]],
        on_token: TokenHook | None = None,
    ) -> list[Sequence]:
        """Record the batch's KV and append ``token_ids[i]`` (``num_steps`` tokens, in order)
        to ``batch.seqs[i]``, up to the token that finishes it; the rest are dropped.

        Sequences finished since ``schedule`` (aborted) are skipped. As in vLLM, a sequence
        finishes at ``max_tokens`` outputs or ``max_model_len`` tokens ("length"), else, once
        it has ``min_tokens`` outputs, on an EOS token (unless ``ignore_eos``) or one of its
        ``stop_token_ids`` ("stop", with the id as ``stop_reason``), or when ``on_token``
        reports a stop string ("stop", with the string). Its blocks are freed. Returns the
        newly finished sequences, in batch order; the forks of the batch's prefilled sources
        become schedulable.
        Precondition: ``batch`` is the batch in flight (else ``SchedulerError``).
        """
        if batch is not self._batch_in_flight:
            raise SchedulerError(
                "this batch is not in flight: it was postprocessed already, or preempt_all "
                "discarded it (its sequences will recompute)"
            )
        shape = (len(token_ids), {len(tokens) for tokens in token_ids})
        if shape[0] != batch.num_seqs or shape[1] - {batch.num_steps}:
            raise ValueError(
                f"got token ids for {shape[0]} sequences with {sorted(shape[1])} steps, for a "
                f"batch of {batch.num_seqs} sequences of {batch.num_steps} steps"
            )
        self._batch_in_flight = None
        finished: list[Sequence] = []
        for seq, tokens in zip(batch.seqs, token_ids, strict=True):
            for token_id in tokens:
                if seq.is_finished:
                    break
                seq.num_computed_tokens = seq.num_tokens
                seq.append_token(token_id)
                reason, stop_token_id = self._finish_reason(seq, token_id)
                stop_reason: int | str | None = stop_token_id
                if on_token is not None:
                    stop_string = on_token(seq, token_id, reason is FinishReason.STOP)
                    if stop_string is not None:
                        reason, stop_reason = FinishReason.STOP, stop_string
                if reason is not None:
                    self._finish(seq, reason, stop_reason)
                    finished.append(seq)
        if finished:
            self._running = deque(seq for seq in self._running if not seq.is_finished)
        if batch.is_prefill:
            self._release_forks(batch.seqs)
        return finished

    def abort(self, seq_ids: Iterable[int] | None = None) -> list[Sequence]:
        """Finish the given unfinished sequences (all when ``None``) with reason ABORT.

        Ids that are unknown or already finished are ignored: a request may finish just
        before its abort arrives. Returns the aborted sequences; their blocks are freed.
        """
        if seq_ids is None:
            targets = list(self._unfinished_by_id.values())
        else:
            targets = [self._unfinished_by_id[i] for i in seq_ids if i in self._unfinished_by_id]
        for seq in targets:
            self._finish(seq, FinishReason.ABORT)
        if targets:
            self._waiting = deque(seq for seq in self._waiting if not seq.is_finished)
            self._running = deque(seq for seq in self._running if not seq.is_finished)
            for source_id, forks in list(self._pending_forks.items()):
                forks[:] = [seq for seq in forks if not seq.is_finished]
                if not forks:
                    del self._pending_forks[source_id]
            self._release_forks(targets)  # forks of an aborted source compute their own KV
        return targets

    def preempt_all(self) -> None:
        """Move every running sequence to the front of `waiting`, in order, freeing its blocks.

        Used before the KV cache is discarded (sleep in "keep" mode), or to recover from a
        failed step: the sequences keep their outputs and recompute their KV when scheduled
        again. A batch in flight is discarded. Postcondition: no block is held.
        """
        self._batch_in_flight = None
        while self._running:
            self._preempt(self._running.pop())

    def _release_forks(self, sources: Iterable[Sequence]) -> None:
        """Moves the pending forks of ``sources`` to the front of `waiting`, in order."""
        released = [f for s in sources for f in self._pending_forks.pop(s.seq_id, ())]
        self._waiting.extendleft(reversed(released))

    def _shared_prefix(self, seq: Sequence) -> tuple[Sequence | None, int]:
        """The source and number of blocks ``seq`` shares when prefilled now: its fork
        source's full prompt blocks, if the source is running with its prompt computed (so not
        in the batch being built), and this is ``seq``'s first prefill."""
        source = seq.fork_source
        if source is None or source.status is not SequenceStatus.RUNNING or seq.num_output_tokens:
            return None, 0
        if source.num_computed_tokens < source.num_prompt_tokens:
            return None, 0
        num_blocks = min(self.block_manager.num_shareable_blocks(seq), len(source.block_table))
        return (source, num_blocks) if num_blocks else (None, 0)

    def _schedule_prefill(self) -> ScheduledBatch | None:
        scheduled: list[Sequence] = []
        num_batched_tokens = 0
        config, block_size = self.config, self.block_manager.block_size
        while self._waiting and len(self._running) < config.max_num_seqs:
            seq = self._waiting[0]
            source, num_shared = self._shared_prefix(seq)
            num_new_tokens = seq.num_tokens - num_shared * block_size
            is_over_budget = num_batched_tokens + num_new_tokens > config.max_num_batched_tokens
            if is_over_budget or not self.block_manager.can_allocate(seq, num_shared):
                break
            self.block_manager.allocate(seq, source, num_shared)
            seq.num_computed_tokens = num_shared * block_size
            seq.fork_source = None  # used: a later recompute (preemption) computes everything
            num_batched_tokens += num_new_tokens
            seq.status = SequenceStatus.RUNNING
            self._waiting.popleft()
            self._running.append(seq)
            scheduled.append(seq)
        return ScheduledBatch(tuple(scheduled), True, num_batched_tokens) if scheduled else None

    def _schedule_decode(self) -> ScheduledBatch | None:
        scheduled: list[Sequence] = []
        while self._running:
            seq = self._running.popleft()
            while not self.block_manager.can_append(seq):
                if self._running:
                    self._preempt(self._running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                self.block_manager.append_block_if_needed(seq)
                scheduled.append(seq)
        self._running.extend(scheduled)
        if not scheduled:
            return None
        num_steps = self._num_decode_steps(scheduled)
        return ScheduledBatch(tuple(scheduled), False, len(scheduled) * num_steps, num_steps)

    def _num_decode_steps(self, seqs: list[Sequence]) -> int:
        """Runs ``num_decode_steps`` steps at once when nothing waits to be prefilled, every
        sequence is greedy and has that many tokens left to make, and the blocks of the extra
        positions are free (they are taken here); else one step. A sequence that stops on a
        token before the last step drops the tokens after it."""
        num_steps, config = self.config.num_decode_steps, self.config
        if num_steps == 1 or self._waiting or len(seqs) > config.max_multi_step_seqs:
            return 1
        for seq in seqs:
            if not seq.params.is_greedy or seq.num_tokens + num_steps - 1 > config.max_model_len:
                return 1
            if self._max_tokens(seq) - seq.num_output_tokens < num_steps:
                return 1
        lookahead = num_steps - 1
        missing = sum(self.block_manager.num_missing_blocks(seq, lookahead) for seq in seqs)
        if missing > self.block_manager.num_free_blocks:
            return 1
        for seq in seqs:
            self.block_manager.append_block_if_needed(seq, lookahead)
        return num_steps

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        self._waiting.appendleft(seq)

    def _finish(
        self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None
    ) -> None:
        seq.finish(reason, stop_reason)
        self.block_manager.free(seq)
        del self._unfinished_by_id[seq.seq_id]

    def _max_tokens(self, seq: Sequence) -> int:
        """``max_tokens``, where None (vLLM's "up to max_model_len") is what fits."""
        max_tokens = seq.params.max_tokens
        return self.config.max_model_len if max_tokens is None else max_tokens

    def _finish_reason(
        self, seq: Sequence, token_id: int
    ) -> tuple[FinishReason | None, int | None]:
        """Why ``seq`` finishes on its newest token ``token_id``, with vLLM's precedence:
        length first, then (past ``min_tokens``) EOS, then a stop token (its ``stop_reason``)."""
        params = seq.params
        if seq.num_output_tokens >= self._max_tokens(seq):
            return FinishReason.LENGTH, None
        if seq.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH, None
        if seq.num_output_tokens < params.min_tokens:
            return None, None
        if token_id in self.eos_token_ids and not params.ignore_eos:
            return FinishReason.STOP, None
        if params.stop_token_ids and token_id in params.stop_token_ids:
            return FinishReason.STOP, token_id
        return None, None

    def _max_num_kv_tokens(self, seq: Sequence) -> int:
        """The most tokens whose KV ``seq`` may ever need at once.

        The last token a sequence gets is sampled but never computed, so it needs KV for
        at most ``max_total - 1`` tokens, and at least its prompt.
        """
        max_model_len = self.config.max_model_len
        max_total = min(seq.num_prompt_tokens + self._max_tokens(seq), max_model_len)
        return max(seq.num_prompt_tokens, max_total - 1)
