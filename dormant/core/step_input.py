"""What one engine step asks every worker to compute: plain, picklable data.

The scheduler decides on ``Sequence`` objects in the driver (``ScheduledBatch.step_input``);
workers (possibly in other processes, one per tensor-parallel rank) only ever see this.

Workers keep no per-request state between steps, so a request's share of a step carries what
its sampling features need at this step. A request that does not use a feature sends nothing
for it (``None`` or empty), and the worker spends nothing on it:

| field                  | sent when                                  | used for                   |
|------------------------|--------------------------------------------|----------------------------|
| output_token_ids       | any penalty is set, or a multi-token bad   | presence/frequency/        |
|                        | word exists                                | repetition, bad words      |
| prompt_token_ids       | ``repetition_penalty != 1``                | repetition penalty         |
| masked_stop_token_ids  | fewer than ``min_tokens`` outputs so far   | ``min_tokens``             |
| bad_words_token_ids    | the request has bad words                  | ``bad_words``              |
| compute_prompt_logprobs| ``prompt_logprobs`` is set and this is the | prompt logprobs            |
|                        | request's first prefill                    |                            |
| num_draft_tokens       | speculative decoding, on a decode row that | drafts to propose and      |
|                        | may emit that many more tokens             | verify in this step        |
| draft_prefix_token_ids | speculative decoding, where the draft's KV | the draft catches up       |
|                        | lags the target's                          |                            |

With speculative decoding (``worker/spec_step.py``) the draft computes what the target does:
each row's ``draft_prefix_token_ids`` then ``token_ids``, from position ``draft_start``. A row
with ``num_draft_tokens = j > 0`` has one token (its newest); the worker drafts ``j`` tokens
after it, the target computes ``[newest, d_1 .. d_j]`` at ``start_position ..``, and the row
emits ``1 .. j + 1`` tokens. Its block table covers those ``j + 1`` positions.

Forks (the ``n`` samples of a request, ``engine/forks.py``): a *fork row* has ``fork_of = r``
and no tokens. It computes nothing and samples its first token from the logits of row ``r``
(its leader, which computes the prompt's last token in this step), with its own parameters,
seed and output position: exactly what it would sample had it computed the prompt itself.
``block_copies`` are ``(source, destination)`` KV blocks (a leader's partial last block into a
fork row's own): every rank copies them, in every KV cache indexed by the block tables (the
target's and a draft's), right after the step's forward and before the next step's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dormant.core.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class SeqInput:
    """One sequence's share of a step: tokens at positions ``start_position ..`` to compute,
    then one token to sample (the ``num_output_tokens``-th output, with ``seed``).

    Attributes beyond the tokens (see the module's table for when each is sent):
        output_token_ids: every output token so far, oldest first.
        prompt_token_ids: the whole prompt.
        masked_stop_token_ids: ids whose logits are set to -inf for this token: while the
            request has fewer than ``params.min_tokens`` outputs, its EOS ids (unless
            ``ignore_eos``) and its ``stop_token_ids``.
        bad_words_token_ids: each bad word as token ids. A one-token word is always masked;
            a longer one masks its last token when the outputs end with its other tokens.
        compute_prompt_logprobs: return ``prompt_logprobs`` for this step's positions whose
            next token is in ``token_ids`` (all but the last). False on a recompute after a
            preemption, so they are reported once.
        num_draft_tokens: speculative decoding's drafts for this row (see the module).
        draft_prefix_token_ids: the tokens before ``start_position`` whose draft KV is
            missing (the draft computes them first).
        fork_of: a fork row's leader (a row of the same step, not a fork row); None for a
            row that computes its tokens (see the module).
    """

    token_ids: tuple[int, ...]
    start_position: int
    block_table: tuple[int, ...]
    params: SamplingParams
    seed: int
    num_output_tokens: int
    output_token_ids: tuple[int, ...] | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    masked_stop_token_ids: tuple[int, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    compute_prompt_logprobs: bool = False
    num_draft_tokens: int = 0
    draft_prefix_token_ids: tuple[int, ...] = ()
    fork_of: int | None = None

    @property
    def draft_start(self) -> int:
        """The first position the draft computes in this step."""
        return self.start_position - len(self.draft_prefix_token_ids)

    @property
    def seq_len(self) -> int:
        """Context length after this step."""
        return self.start_position + len(self.token_ids)

    def advanced(self, token_id: int) -> SeqInput:
        """The next decode step's input after this step sampled ``token_id``.

        Precondition: ``block_table`` covers position ``seq_len`` (the new token's).
        """
        num_output_tokens = self.num_output_tokens + 1
        outputs = self.output_token_ids
        return dataclasses.replace(
            self,
            token_ids=(token_id,),
            start_position=self.seq_len,
            num_output_tokens=num_output_tokens,
            output_token_ids=None if outputs is None else (*outputs, token_id),
            masked_stop_token_ids=(
                self.masked_stop_token_ids if num_output_tokens < self.params.min_tokens else ()
            ),
            compute_prompt_logprobs=False,
        )


@dataclass(frozen=True, slots=True)
class StepInput:
    """A step's rows. ``previous_rows`` (the engine's async scheduling: a decode step queued
    before the host read the launch before it) gives, per row, the row of the previous launch
    whose last sampled token is this row's input: its ``token_ids`` are then a placeholder,
    and the worker gathers the real tokens on the device. None: every row's tokens are here."""

    seqs: tuple[SeqInput, ...]
    is_prefill: bool
    block_copies: tuple[tuple[int, int], ...] = ()  # (source, destination) blocks
    has_forks: bool = False  # some row is a fork row (a flag, so a step need not scan rows)
    previous_rows: tuple[int, ...] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    def without_forks(self) -> tuple[StepInput, list[int]]:
        """The step of the rows that compute (fork rows left out, no copies), and for each row
        of this step the index there of the row whose logits it samples from."""
        computing = [row for row, s in enumerate(self.seqs) if s.fork_of is None]
        index = {row: i for i, row in enumerate(computing)}
        logits_rows = [
            index[row if s.fork_of is None else s.fork_of] for row, s in enumerate(self.seqs)
        ]
        step = StepInput(tuple(self.seqs[row] for row in computing), self.is_prefill)
        return step, logits_rows
