"""The ``n`` samples of a request fork from one prefill (vLLM V0's sequence-group fork, on the
block manager's reference counts).

Sample 0 of a request is its *leader*; samples ``1 .. n-1`` are its *siblings*. A sibling that
can fork waits here, in no queue of the scheduler's, until the leader is scheduled for the step
that computes its prompt's last token. In that step each sibling is a *fork row*: it computes
nothing, samples its first token from the leader's logits (with its own parameters, seed and
output position: what it would sample had it computed the prompt), and owns the prompt's KV
afterwards: the full blocks shared with the leader, the partial last block copied into a block
of its own (``BlockManager.fork``; the workers copy after the step's forward). So the prompt is
computed once for all ``n`` samples.

A sibling forks only when that is clean; otherwise it is queued in ``waiting`` as an ordinary
sequence (and finds the prompt's full blocks in the prefix cache):

    when                                                      what happens to the siblings
    ────────────────────────────────────────────────────────  ─────────────────────────────────
    prefix caching off, forks disabled, speculative decoding, queued at once (``can_wait``)
    prompt logprobs asked for
    the leader is preempted or finished (aborted) before its  queued behind it (``release``)
    prompt's last token is scheduled
    the fork step has no room: ``max_num_seqs`` running, or   those left over are queued at the
    no free block for a copy, or the cache was reset since    front of ``waiting`` (``plan``)
    the leader was given blocks (a weight change or a KV
    discard: no block is ever shared across one)

A request's samples start together (vLLM V0's sequence-group admission): the scheduler admits a
leader only when ``max_num_seqs`` has room for it and all its waiting siblings beside those
already running and those the running leaders' siblings will take (``num_slots_held``), unless
nothing runs at all (then ``n > max_num_seqs`` still makes progress, the siblings left over
queued). So the fork step has room, and the prompt is computed once, not once per wave of
sequences that happened to fit.

Invariant: every sibling here has an unfinished leader that is WAITING or RUNNING and has not
yet been scheduled to compute its prompt's last token; a sibling is never both here and in a
queue. Preemption stays recompute: a forked sibling is an ordinary running sequence.
"""

from __future__ import annotations

from collections import deque

from dormant.engine.batch import SchedulerConfig
from dormant.engine.block_manager import BlockManager
from dormant.engine.sequence import Sequence, SequenceStatus

Row = tuple[Sequence, int]  # a sequence and how many positions it computes in the step


class Forks:
    """Siblings waiting on their leaders (by the leader's sequence id, in sample order).

    ``waiting`` and ``running`` are the scheduler's own deques, shared."""

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        waiting: deque[Sequence],
        running: deque[Sequence],
    ) -> None:
        self.config, self.block_manager = config, block_manager
        self.waiting, self.running = waiting, running
        self._siblings: dict[int, list[Sequence]] = {}
        self._leaders: dict[int, Sequence] = {}  # by sequence id, those with siblings here
        self._leader_of: dict[int, int] = {}  # sibling id -> leader id, for those here

    @property
    def num_waiting(self) -> int:
        return len(self._leader_of)

    def num_siblings(self, leader: Sequence) -> int:
        """How many siblings wait here on ``leader``."""
        return len(self._siblings.get(leader.seq_id, ()))

    def num_slots_held(self) -> int:
        """The running sequences' slots their waiting siblings will take at their fork steps:
        the siblings of leaders already RUNNING (prefilling in chunks)."""
        return sum(
            len(self._siblings[seq_id])
            for seq_id, leader in self._leaders.items()
            if leader.status is SequenceStatus.RUNNING
        )

    def can_wait(self, leader: Sequence, sibling: Sequence) -> bool:
        """Whether ``sibling`` (new, of the same prompt) may wait to fork from ``leader``, an
        unfinished sequence of the scheduler's."""
        return (
            self.config.enable_fork
            and not self.config.num_speculative_tokens
            and self.block_manager.prefix_cache is not None
            and sibling.params.prompt_logprobs is None
            and leader.status is SequenceStatus.WAITING
            and not leader.output_token_ids
            and leader.num_computed_tokens == 0
            and sibling.prompt_token_ids == leader.prompt_token_ids
        )

    def add(self, leader: Sequence, sibling: Sequence) -> None:
        """Precondition: ``can_wait(leader, sibling)``."""
        self._siblings.setdefault(leader.seq_id, []).append(sibling)
        self._leaders[leader.seq_id] = leader
        self._leader_of[sibling.seq_id] = leader.seq_id

    def release(self, leader: Sequence) -> list[Sequence]:
        """Removes and returns the siblings waiting on ``leader`` (the caller queues them)."""
        siblings = self._siblings.pop(leader.seq_id, [])
        self._leaders.pop(leader.seq_id, None)
        for sibling in siblings:
            del self._leader_of[sibling.seq_id]
        return siblings

    def discard(self, sibling: Sequence) -> None:
        """Forgets a finished (aborted) sibling, if it was waiting here."""
        leader_id = self._leader_of.pop(sibling.seq_id, None)
        if leader_id is None:
            return
        siblings = self._siblings[leader_id]
        siblings.remove(sibling)
        if not siblings:
            del self._siblings[leader_id], self._leaders[leader_id]

    def plan(self, rows: list[Row]) -> tuple[list[Row], dict[int, int], list[tuple[int, int]]]:
        """The fork rows of a step whose final rows are ``rows``: for each leader whose row
        computes its prompt's last token, its siblings, while ``max_num_seqs`` and the copies'
        blocks allow (the rest are queued at the front of ``waiting``). Each fork row is
        RUNNING at the back of ``running`` with its prompt counted as computed.

        Returns the fork rows (sibling, 0), their leaders by sequence id, and the block copies.
        """
        if not self._siblings:  # nobody waits to fork: no row is a leader
            return [], {}, []
        manager, cache = self.block_manager, self.block_manager.prefix_cache
        fork_rows: list[Row] = []
        leaders: dict[int, int] = {}
        copies: list[tuple[int, int]] = []
        released: list[Sequence] = []
        for leader, num_new in rows:
            if leader.seq_id not in self._siblings:
                continue
            if leader.num_computed_tokens + num_new < leader.num_tokens:
                continue  # a chunk before the prompt's last: its siblings wait on
            siblings = self.release(leader)
            num_tokens = leader.num_tokens
            is_current = cache is not None and leader.cache_epoch == cache.epoch
            for index, sibling in enumerate(siblings):
                if not is_current or len(self.running) >= self.config.max_num_seqs:
                    released += siblings[index:]
                    break
                if not manager.can_fork(num_tokens):
                    released += siblings[index:]
                    break
                copy = manager.fork(leader, sibling, num_tokens)
                if copy is not None:
                    copies.append(copy)
                sibling.num_computed_tokens = num_tokens
                sibling.num_draft_computed_tokens = num_tokens
                sibling.status = SequenceStatus.RUNNING
                self.running.append(sibling)
                fork_rows.append((sibling, 0))
                leaders[sibling.seq_id] = leader.seq_id
        self.waiting.extendleft(reversed(released))
        return fork_rows, leaders, copies
