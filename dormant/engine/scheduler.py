"""Continuous batching, with chunked prefill mixed into decode steps (vLLM V1's scheduling) or,
with ``enable_chunked_prefill`` off, steps that are either a prefill or a decode.

Sequences move between two queues, and the siblings of a request wait on its leader:

| queue     | status  | holds blocks | KV computed                                            |
|-----------|---------|--------------|--------------------------------------------------------|
| `waiting` | WAITING | no           | none (num_computed = 0)                                |
| `running` | RUNNING | yes          | positions ``0 .. num_computed_tokens-1``: all but the   |
|           |         |              | newest token (decoding), or a prompt's first chunks     |
| forks     | WAITING | no           | none: samples ``1 .. n-1`` of a request, until sample 0 |
|           |         |              | computes its prompt's last token (``engine/forks.py``) |

A step with chunked prefill, under ``max_num_batched_tokens``:
    1. every running sequence, in order: a decode computes its newest token; one still
       prefilling computes its next chunk, as long as the budget leaves one token for each
       decode after it (so a long prompt never stalls a decode). When blocks run out, the tail
       of `running` (the newest) is preempted, until the sequence fits or is itself the tail.
    2. then, unless step 1 preempted, waiting sequences in order while the budget and
       ``max_num_seqs`` allow: each starts after its prefix-cache hits with a chunk of what is
       left of the budget (a first prefill with prompt logprobs only as a whole). A leader
       counts its waiting siblings against ``max_num_seqs`` (a request's samples start
       together, ``engine/forks.py``).
Without chunked prefill a step prefills whole waiting sequences if any fits, else decodes.

A row whose chunk ends before the sequence's last token samples nothing. A step of decodes
alone, with nothing waiting, may run several steps at once (``StepPlanner``).
Every row's full blocks are published to the prefix cache once the row is final in the step
(``BlockManager.publish``), so a later row of the same step, such as another sample of the same
prompt, hits them.

Once a step's rows are final, each leader among them that computes its prompt's last token
forks its waiting siblings (``Forks.plan``): fork rows that compute nothing, sample from the
leader's logits and share its prompt's blocks. THE COPY INVARIANT: a fork's partial last block
is a new block of the sibling's, listed in the step's ``block_copies``; every rank copies it
from the leader's block after that step's forward (which wrote it) and before the next step's
(which writes the sibling's next position into it), in every KV cache the block tables index.
A step that fails before its copies ran is discarded by ``preempt_all``, forked rows included.

Invariants between calls:
    - every unfinished sequence added is in exactly one queue (or waits on its leader in
      ``Forks``); finished ones in none;
    - ``len(running) <= config.max_num_seqs``;
    - only running sequences hold blocks (see ``BlockManager``);
    - batches are in flight in order: ``schedule`` hands one out when none is, and
      ``schedule_successor`` the one after it while it is (async scheduling,
      ``engine/successor.py``: at most two); ``postprocess_steps`` takes back the oldest, and
      ``preempt_all`` discards them all (and resets the prefix cache: the blocks they
      published may never have been computed).

Preemption is by recompute: the sequence's blocks are freed (its cached blocks stay findable),
it goes back to the front of `waiting` with its output kept, and its next prefill recomputes
the KV of the tokens the prefix cache does not give back.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from collections.abc import Sequence as SequenceOf

from dormant.engine import admission
from dormant.engine.batch import ScheduledBatch, SchedulerConfig
from dormant.engine.block_manager import BlockManager
from dormant.engine.forks import Forks
from dormant.engine.sequence import FinishReason, Sequence, SequenceStatus
from dormant.engine.step_planner import StepPlanner
from dormant.engine.step_tokens import StopRules, TokenHook, append_step_tokens
from dormant.engine.successor import plan_successor
from dormant.errors import EngineError


class SchedulerError(EngineError):
    """Base class for misuse of the scheduler."""


class RequestTooLongError(SchedulerError, ValueError):
    """A request can never be served: its prompt or its KV exceeds what the engine holds."""


class DuplicateSequenceError(SchedulerError, ValueError):
    """A sequence id was added while a sequence with that id is still unfinished."""


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
        self._unfinished_by_id: dict[int, Sequence] = {}
        self._in_flight: deque[ScheduledBatch] = deque()  # oldest first
        self._forks = Forks(config, block_manager, self._waiting, self._running)
        self._planner = StepPlanner(
            config, block_manager, self._waiting, self._running, self._preempt, self._forks
        )

    @property
    def num_waiting(self) -> int:
        """Waiting sequences, siblings waiting on their leaders included."""
        return len(self._waiting) + self._forks.num_waiting

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._unfinished_by_id)

    def unfinished(self, seq_id: int) -> Sequence | None:
        """The unfinished sequence with this id, or None (unknown, or finished)."""
        return self._unfinished_by_id.get(seq_id)

    def add(self, seq: Sequence, fork_of: Sequence | None = None) -> None:
        """Queue a new WAITING sequence at the back of `waiting`, or, given ``fork_of`` (the
        unfinished sample 0 of its request, added before it, of the same prompt), to fork from
        it when it can (``Forks.can_wait``; else at the back of `waiting`).

        Raises ``RequestTooLongError`` if its prompt exceeds ``max_model_len``, it could not
        run to completion even with the whole cache, or it asks for prompt logprobs (which are
        computed in one step) of a prompt longer than ``max_num_batched_tokens``
        (``admission.py``); and
        ``DuplicateSequenceError`` if its id is in use. None of them changes any state.
        """
        if seq.status is not SequenceStatus.WAITING or seq.block_table:
            raise SchedulerError(f"only new WAITING sequences without blocks can be added: {seq!r}")
        if seq.seq_id in self._unfinished_by_id:
            raise DuplicateSequenceError(f"sequence id {seq.seq_id} is already scheduled")
        reason = admission.refusal(
            seq, self.config, self.block_manager, self._planner.may_chunk(seq)
        )
        if reason is not None:
            raise RequestTooLongError(reason)
        if (
            fork_of is not None
            and self._unfinished_by_id.get(fork_of.seq_id) is fork_of
            and self._forks.can_wait(fork_of, seq)
        ):
            self._forks.add(fork_of, seq)
        else:
            self._waiting.append(seq)
        self._unfinished_by_id[seq.seq_id] = seq

    def schedule(self) -> ScheduledBatch | None:
        """Pick the next step (see the module docstring).

        Returns ``None`` exactly when there is no unfinished sequence. Postcondition: every
        returned sequence is RUNNING and its block table covers the positions it computes.
        Precondition: the previous batch was postprocessed (else ``SchedulerError``).
        """
        if self._in_flight:
            raise SchedulerError("the previous batch is still in flight; postprocess it first")
        planner = self._planner
        if self.config.enable_chunked_prefill:
            batch = planner.plan_mixed()
        else:
            batch = planner.plan_prefill() or planner.plan_decode()
        if batch is None and self._unfinished_by_id:
            raise SchedulerError(
                f"no sequence can be scheduled: {self.num_waiting} waiting, "
                f"{self.num_running} running, {self.block_manager.num_free_blocks} free blocks"
            )
        if batch is not None:
            self._in_flight.append(batch)
        return batch

    def schedule_successor(self, batch: ScheduledBatch) -> ScheduledBatch | None:
        """The decode batch after ``batch``, planned while ``batch`` is in flight with its tokens
        unknown, where they cannot change it (``engine/successor.py``); else None, changing
        nothing. Precondition: ``batch`` is the only batch in flight (else ``SchedulerError``).
        """
        if list(self._in_flight) != [batch]:
            raise SchedulerError("a successor follows the one batch in flight")
        successor = plan_successor(
            batch, self.config, self.block_manager, self._running, self.num_waiting
        )
        if successor is not None:
            self._in_flight.append(successor)
        return successor

    def postprocess_steps(
        self,
        batch: ScheduledBatch,
        token_ids: list[list[int]],
        on_token: TokenHook | None = None,
        draft_computed: SequenceOf[int | None] | None = None,
    ) -> list[Sequence]:
        """Record the batch's KV and append ``token_ids[i]`` (``num_steps`` tokens, in order;
        ``1 .. j + 1`` for a row with ``j`` drafts) to ``batch.seqs[i]``, up to the token that
        finishes it; the rest are dropped. A row whose chunk ended before the sequence's last
        token appends nothing. ``draft_computed[i]`` (speculative decoding) is the row's new
        ``num_draft_computed_tokens``.

        Sequences finished since ``schedule`` (aborted) are skipped. As in vLLM, a sequence
        finishes at ``max_tokens`` outputs or ``max_model_len`` tokens ("length"), else, once
        it has ``min_tokens`` outputs, on an EOS token (unless ``ignore_eos``) or one of its
        ``stop_token_ids`` ("stop", with the id as ``stop_reason``), or when ``on_token``
        reports a stop string ("stop", with the string). Its blocks are freed. Returns the
        newly finished sequences, in batch order.
        A successor in flight after ``batch`` computes the KV of the tokens appended here: its
        sequences publish their full blocks now that their tokens are known.
        Precondition: ``batch`` is the oldest batch in flight (else ``SchedulerError``).
        """
        if not self._in_flight or batch is not self._in_flight[0]:
            raise SchedulerError(
                "this batch is not the oldest in flight: it was postprocessed already, or "
                "preempt_all discarded it (its sequences will recompute)"
            )
        batch.check_token_ids(token_ids)
        self._in_flight.popleft()
        stops = StopRules(self.eos_token_ids, self.config.max_model_len, on_token, self._finish)
        finished = append_step_tokens(batch, token_ids, stops, draft_computed)
        if finished:
            _drop_finished(self._running)
        for successor in self._in_flight:
            for seq in successor.seqs:
                if not seq.is_finished:
                    self.block_manager.publish(seq, seq.num_tokens)
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
            _drop_finished(self._waiting)
            _drop_finished(self._running)
        return targets

    def preempt_all(self) -> None:
        """Move every running sequence to the front of `waiting`, in order, freeing its blocks.

        Used before the KV cache is discarded (sleep in "keep" mode), or to recover from a
        failed step: the sequences keep their outputs and recompute their KV when scheduled
        again. The batches in flight are discarded, and with it the prefix cache (the blocks it
        published may never have been computed). Postcondition: no block is held.
        """
        if self._in_flight:
            self.block_manager.reset_prefix_cache()
        self._in_flight.clear()
        while self._running:
            self._preempt(self._running.pop())

    # ── sequence transitions ───────────────────────────────────────────────────────────────────

    def _preempt(self, seq: Sequence) -> None:
        """Frees ``seq`` (removed from `running` by the caller) and puts it at the front of
        `waiting`; siblings still waiting to fork from it are queued right behind it."""
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_draft_computed_tokens = 0
        self._waiting.extendleft(reversed(self._forks.release(seq)))
        self._waiting.appendleft(seq)

    def _finish(
        self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None
    ) -> None:
        seq.finish(reason, stop_reason)
        self.block_manager.free(seq)
        del self._unfinished_by_id[seq.seq_id]
        self._forks.discard(seq)  # a sibling aborted while waiting to fork
        self._waiting.extendleft(reversed(self._forks.release(seq)))  # a leader aborted


def _drop_finished(queue: deque[Sequence]) -> None:
    """Removes finished sequences in place (the planner shares the deque)."""
    kept = [seq for seq in queue if not seq.is_finished]
    queue.clear()
    queue.extend(kept)
