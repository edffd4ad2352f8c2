"""How one step is composed from the scheduler's queues: the passes of a mixed step (chunked
prefill beside decodes, vLLM V1) and of the split one (whole prefills, else decodes). The rules
are the scheduler's module docstring; ``Scheduler`` owns the queues and the sequences' lifecycle,
the planner only decides and takes blocks.

Speculative decoding: a decode row of an eligible sequence (``speculation.num_drafts``) also
computes its drafts' positions, when the budget and free blocks allow (else it is a plain
decode: drafts never preempt anyone). Only its real tokens are published to the prefix cache,
so no cached block ever holds a rejected draft's KV. A batch of such decodes, every row with
all ``k`` drafts, may run ``num_decode_steps`` speculative rounds at once
(``_num_spec_rounds``)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from dormant.engine import speculation, stopping
from dormant.engine.batch import ScheduledBatch, SchedulerConfig
from dormant.engine.block_manager import BlockManager
from dormant.engine.forks import Forks, Row
from dormant.engine.sequence import Sequence, SequenceStatus


class StepPlanner:
    """Plans steps over ``waiting`` and ``running`` (the scheduler's own deques, shared, not
    copied). ``preempt`` is the scheduler's: it frees a running sequence's blocks and puts it at
    the front of ``waiting``; the caller has removed it from ``running``."""

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        waiting: deque[Sequence],
        running: deque[Sequence],
        preempt: Callable[[Sequence], None],
        forks: Forks,
    ) -> None:
        self.config, self.block_manager = config, block_manager
        self.waiting, self.running, self.preempt = waiting, running, preempt
        self.forks = forks
        # This plan's draft counts by sequence id; None without speculative decoding.
        self.drafts: dict[int, int] | None = None

    def _start_plan(self) -> None:
        self.drafts = {} if self.config.num_speculative_tokens else None

    def _num_drafts(self, seq: Sequence) -> int:
        """Drafts a decode of ``seq`` may verify now (0 without speculation)."""
        if self.drafts is None:
            return 0
        return speculation.num_drafts(seq, self.config)

    # ── chunked prefill mixed with decodes ─────────────────────────────────────────────────────

    def plan_mixed(self) -> ScheduledBatch | None:
        self._start_plan()
        budget = self.config.max_num_batched_tokens
        decodes = self._schedule_decodes(budget)
        if decodes is not None:
            rows, num_preempted = list(decodes), 0
        else:
            rows, num_preempted = self._schedule_running(budget)
        budget -= sum(num_new for _, num_new in rows)
        if not num_preempted:
            rows += self._schedule_waiting(budget, may_chunk=True)
        if not rows:
            return None
        # The rows are final: the leaders among them that compute their prompts' last tokens
        # fork their siblings (``engine/forks.py``).
        fork_rows, leaders, copies = self.forks.plan(rows)
        is_decode = (decodes is not None and len(rows) == len(decodes)) or all(
            _is_decode(s, n) for s, n in rows
        )
        if not fork_rows and self.drafts is None and is_decode:
            return self._decode_batch([seq for seq, _ in rows])
        if not fork_rows and self.drafts is not None and all(self._is_spec_decode(r) for r in rows):
            return self._decode_batch([seq for seq, _ in rows])
        return ScheduledBatch.of(rows + fork_rows, 1, self.drafts, leaders, copies)

    def _is_spec_decode(self, row: Row) -> bool:
        """A decode row (its newest token) with its drafts, if any."""
        seq, num_new = row
        assert self.drafts is not None
        return _is_decode(seq, num_new - self.drafts.get(seq.seq_id, 0))

    def _schedule_decodes(self, budget: int) -> list[Row] | None:
        """Step 1 at once when every running sequence is a decode without drafts and they all
        fit (the budget, the free blocks): the rows ``_schedule_running`` would plan, with one
        free-block count for the batch. Else None, and nothing changes."""
        manager, running = self.block_manager, self.running
        if self.drafts is not None or len(running) > budget:
            return None
        if any(seq.num_tokens - seq.num_computed_tokens != 1 for seq in running):
            return None
        if not manager.grow_all(running):
            return None
        for seq in running:
            manager.publish(seq, seq.num_tokens)
        return [(seq, 1) for seq in running]

    def _schedule_running(self, budget: int) -> tuple[list[Row], int]:
        """Step 1 of a mixed step: the running sequences' rows, and how many were preempted."""
        manager, running = self.block_manager, self.running
        rows: list[Row] = []
        num_decodes_left = sum(
            1 for seq in running if seq.num_tokens - seq.num_computed_tokens == 1
        )
        num_preempted, index = 0, 0
        while index < len(running):
            seq = running[index]
            num_left = seq.num_tokens - seq.num_computed_tokens
            if num_left == 1:
                num_decodes_left -= 1
            num_new = min(num_left, budget - num_decodes_left)
            if num_new < 1:
                index += 1
                continue
            num_drafts = 0
            if num_left == 1:  # a decode: its drafts too, where the budget and blocks allow
                num_drafts = max(0, min(self._num_drafts(seq), budget - num_decodes_left - 1))
                while num_drafts and not manager.can_grow(seq, seq.num_tokens + num_drafts):
                    num_drafts = 0
                num_new += num_drafts
            while not manager.can_grow(seq, seq.num_computed_tokens + num_new):
                victim = running.pop()  # the newest; never one scheduled already
                if victim is not seq and victim.num_tokens - victim.num_computed_tokens == 1:
                    num_decodes_left -= 1
                self.preempt(victim)
                num_preempted += 1
                if victim is seq:
                    break
            else:
                manager.grow(seq, seq.num_computed_tokens + num_new)
                rows.append((seq, num_new))
                if num_drafts:
                    assert self.drafts is not None
                    self.drafts[seq.seq_id] = num_drafts
                budget -= num_new
                index += 1
        for seq, num_new in rows:  # final now: no later preemption can take them back
            num_drafts = 0 if self.drafts is None else self.drafts.get(seq.seq_id, 0)
            manager.publish(seq, seq.num_computed_tokens + num_new - num_drafts)
        return rows, num_preempted

    def _schedule_waiting(self, budget: int, *, may_chunk: bool) -> list[Row]:
        """Waiting sequences, in order, while ``budget`` tokens, blocks and ``max_num_seqs``
        allow (a leader with all its waiting siblings, unless nothing runs); each computes from
        its prefix-cache hits on, whole or (``may_chunk``) a chunk."""
        manager, forks = self.block_manager, self.forks
        rows: list[Row] = []
        if not self.waiting:
            return rows
        free_slots = self.config.max_num_seqs - len(self.running)
        if forks.num_waiting:
            free_slots -= forks.num_slots_held()
        while self.waiting and free_slots > 0 and budget > 0:
            seq = self.waiting[0]
            num_slots = 1 + forks.num_siblings(seq) if forks.num_waiting else 1
            if num_slots > free_slots and self.running:
                break  # a request's samples start together (``engine/forks.py``)
            cached = manager.cached_blocks(seq)
            num_computed = len(cached) * manager.block_size
            num_left = seq.num_tokens - num_computed
            num_new = min(num_left, budget)
            if num_new < num_left and not (may_chunk and self.may_chunk(seq)):
                break
            if not manager.can_allocate(seq, num_computed + num_new, cached):
                break
            manager.allocate(seq, num_computed + num_new, cached)
            manager.publish(seq, num_computed + num_new)
            seq.num_computed_tokens = num_computed
            # The draft catches up over the cached prefix at its first step: a cached block's
            # draft KV may never have been written (MTP writes a prompt's at the first decode,
            # which the request that cached it may never have run), and MTP's last position
            # pairs with the next token, which the block's hash does not cover.
            seq.num_draft_computed_tokens = 0
            seq.status = SequenceStatus.RUNNING
            self.running.append(self.waiting.popleft())
            rows.append((seq, num_new))
            budget -= num_new
            free_slots -= num_slots
        return rows

    def may_chunk(self, seq: Sequence) -> bool:
        """Whether ``seq``'s next prefill may be split: not a first prefill that returns
        prompt logprobs (they are computed, and recorded, in one step)."""
        return seq.params.prompt_logprobs is None or seq.num_output_tokens > 0

    # ── whole prefills, or decodes ─────────────────────────────────────────────────────────────

    def plan_prefill(self) -> ScheduledBatch | None:
        self._start_plan()
        rows = self._schedule_waiting(self.config.max_num_batched_tokens, may_chunk=False)
        if not rows:
            return None
        fork_rows, leaders, copies = self.forks.plan(rows)  # rows are final
        return ScheduledBatch.of(rows + fork_rows, 1, self.drafts, leaders, copies)

    def plan_decode(self) -> ScheduledBatch | None:
        self._start_plan()
        scheduled: list[Sequence] = []
        spare = self.config.max_num_batched_tokens - len(self.running)  # tokens for drafts
        while self.running:
            seq = self.running.popleft()
            num_drafts = min(self._num_drafts(seq), spare)
            if num_drafts and self.block_manager.can_append(seq, num_drafts):
                spare -= num_drafts
                self.block_manager.append_block_if_needed(seq, num_drafts)
                assert self.drafts is not None
                self.drafts[seq.seq_id] = num_drafts
            while not self.block_manager.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                self.block_manager.append_block_if_needed(seq)
                scheduled.append(seq)
        self.running.extend(scheduled)
        for seq in scheduled:
            self.block_manager.publish(seq, seq.num_tokens)
        return self._decode_batch(scheduled) if scheduled else None

    def _decode_batch(self, seqs: list[Sequence]) -> ScheduledBatch:
        if self.drafts is not None:
            rows = [(seq, 1 + self.drafts.get(seq.seq_id, 0)) for seq in seqs]
            return ScheduledBatch.of(rows, self._num_spec_rounds(seqs), self.drafts)
        return ScheduledBatch.decodes(seqs, self._num_decode_steps(seqs))

    def _num_spec_rounds(self, seqs: list[Sequence]) -> int:
        """Runs ``num_decode_steps`` speculative rounds at once when nothing waits to be
        prefilled, every sequence verifies all ``k`` drafts and has a token left to make per
        round, and the blocks of its positions up to ``num_decode_steps * (k + 1) - 1`` past its
        newest token are free (taken here) and within ``max_model_len``; else one round. Each
        round emits ``1 .. k + 1`` tokens, so a sequence may stop before the last round: it
        drops the tokens after its stop, as a multi-step decode does."""
        config, drafts = self.config, self.drafts
        num_rounds, k = config.num_decode_steps, config.num_speculative_tokens
        if num_rounds == 1 or drafts is None or self.waiting:
            return 1
        if len(seqs) > config.max_multi_step_seqs:
            return 1
        lookahead = num_rounds * (k + 1) - 1
        for seq in seqs:
            if drafts.get(seq.seq_id, 0) != k or seq.num_tokens + lookahead > config.max_model_len:
                return 1
            if stopping.max_tokens(seq, config.max_model_len) - seq.num_output_tokens < num_rounds:
                return 1
        manager = self.block_manager
        missing = sum(manager.num_missing_blocks(seq, lookahead) for seq in seqs)
        if missing > manager.num_free_blocks:
            return 1
        for seq in seqs:
            manager.append_block_if_needed(seq, lookahead)
        return num_rounds

    def _num_decode_steps(self, seqs: list[Sequence]) -> int:
        """Runs ``num_decode_steps`` steps at once when nothing waits to be prefilled, every
        sequence has that many tokens left to make within ``max_model_len``, and the blocks of
        the extra positions are free (they are taken here); else one step. Greedy and sampled
        requests alike: the worker's steps sample as single steps do (its fused graph, or
        single steps for rows it does not fit). A sequence that stops on a token before the
        last step drops the tokens after it."""
        num_steps, config = self.config.num_decode_steps, self.config
        if num_steps == 1 or self.waiting or len(seqs) > config.max_multi_step_seqs:
            return 1
        max_model_len = config.max_model_len
        for seq in seqs:  # (once per row per step: each count read once)
            num_outputs = seq.num_output_tokens
            if seq.num_prompt_tokens + num_outputs + num_steps - 1 > max_model_len:
                return 1
            if stopping.max_tokens(seq, max_model_len) - num_outputs < num_steps:
                return 1
        # Every row's blocks up to its lookahead, taken only when all fit (one count for all).
        if not self.block_manager.grow_all(seqs, num_steps - 1):
            return 1
        return num_steps


def _is_decode(seq: Sequence, num_new: int) -> bool:
    """A row computing only the sequence's newest token (its KV before it is all there)."""
    return num_new == 1 and seq.num_computed_tokens == seq.num_tokens - 1
