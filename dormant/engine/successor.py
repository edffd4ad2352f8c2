"""The decode batch that follows a batch still in flight: async scheduling's plan.

With async scheduling (``EngineConfig.async_scheduling``) the engine queues the next decode call
before it reads the one in flight, so the device runs it while the host applies the tokens it
just read. The next batch is planned without those tokens, so it is planned only when they
cannot change it, and it is then the batch ``Scheduler.schedule`` would return after them:

- the batch in flight is a plain decode (no prefill, speculative rows, forks or block copies)
  of every running sequence;
- nothing waits, or nothing that waits can start: the batch holds ``max_num_seqs`` sequences
  and none of them finishes by length in it (a row that stops on a token frees its slot only
  when the host reads it: the sequence waiting for that slot starts one call later than
  synchronous steps would start it, with the same tokens). Decodes with sequences waiting run
  one step per call, as ``StepPlanner`` runs them, so that a freed slot is filled soon;
- no row needs its output tokens on the host to compute its next one (penalties, bad words
  of several tokens: ``batch.needs_output_tokens``);
- each row continues with the same rows, less those finished since (aborted, or stopped when
  the host read a batch before), less those the batch in flight finishes by length;
- its steps are those ``StepPlanner`` would pick on the counts after the batch in flight, and
  its blocks are free now (taken here): it never preempts.

A row of the batch in flight may still stop on one of its tokens (EOS, a stop token or string):
its row in the next batch computes on, and ``postprocess_steps`` drops what it made, as it
drops a multi-step row's tokens after its stop. Either way every sequence's tokens are those
of synchronous scheduling: sampling is keyed by (seed, output index), never by batch.
"""

from __future__ import annotations

from collections.abc import Sized

from dormant.engine import stopping
from dormant.engine.batch import ScheduledBatch, SchedulerConfig, needs_output_tokens
from dormant.engine.block_manager import BlockManager
from dormant.engine.sequence import Sequence


def plan_successor(
    batch: ScheduledBatch,
    config: SchedulerConfig,
    block_manager: BlockManager,
    running: Sized,
    num_waiting: int,
) -> ScheduledBatch | None:
    """The batch after ``batch`` (in flight, its tokens unknown), or None where only its tokens
    can tell (see the module docstring). Takes the new batch's blocks; None changes nothing."""
    if batch.is_prefill or batch.is_speculative or batch.fork_of or batch.block_copies:
        return None
    lead, max_model_len = batch.num_steps, config.max_model_len
    live = [(row, seq) for row, seq in enumerate(batch.seqs) if not seq.is_finished]
    if len(live) != len(running):  # another sequence runs (a prompt being chunked)
        return None
    if num_waiting and len(live) < config.max_num_seqs:
        return None  # a slot is free: the next step admits a waiting sequence
    rows: list[int] = []
    seqs: list[Sequence] = []
    distinct = set()
    for row, seq in live:
        num_outputs = seq.num_output_tokens + lead
        if num_outputs >= stopping.max_tokens(seq, max_model_len) or (
            seq.num_prompt_tokens + num_outputs >= max_model_len
        ):
            if num_waiting:
                return None  # its slot frees: the next step admits a waiting sequence
            continue  # finishes by length in the batch in flight
        if id(seq.params) not in distinct:  # the n samples of a request share their params
            if needs_output_tokens(seq.params):
                return None
            distinct.add(id(seq.params))
        rows.append(row)
        seqs.append(seq)
    if not seqs:
        return None
    num_steps = 1 if num_waiting else _num_steps(seqs, lead, config)
    while not block_manager.grow_all(seqs, lead + num_steps - 1):
        if num_steps == 1:
            return None  # the synchronous step decides whom to preempt
        num_steps = 1
    return ScheduledBatch.decodes(seqs, num_steps, previous_rows=tuple(rows), lead=lead)


def _num_steps(seqs: list[Sequence], lead: int, config: SchedulerConfig) -> int:
    """``StepPlanner._num_decode_steps``' choice on the counts after ``lead`` more tokens."""
    num_steps, max_model_len = config.num_decode_steps, config.max_model_len
    if num_steps == 1 or len(seqs) > config.max_multi_step_seqs:
        return 1
    for seq in seqs:
        num_outputs = seq.num_output_tokens + lead
        if seq.num_prompt_tokens + num_outputs + num_steps - 1 > max_model_len:
            return 1
        if stopping.max_tokens(seq, max_model_len) - num_outputs < num_steps:
            return 1
    return num_steps
