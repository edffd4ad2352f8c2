"""What one scheduling step is: its limits (``SchedulerConfig``) and its result
(``ScheduledBatch``)."""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

from dormant.core.sampling_params import SamplingParams
from dormant.core.step_input import SeqInput, StepInput
from dormant.engine.sequence import Sequence

# A successor row's input token before the worker gathers the real one (``previous_rows``).
PLACEHOLDER_TOKEN_ID = 0


def needs_output_tokens(params: SamplingParams) -> bool:
    """Whether computing a request's next token needs its output tokens so far: penalties,
    and bad words of several tokens (``SeqInput.output_token_ids``)."""
    return (
        (params.presence_penalty, params.frequency_penalty) != (0.0, 0.0)
        or params.repetition_penalty != 1.0
        or any(len(word) > 1 for word in params.bad_words_token_ids or ())
    )


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits of one scheduling step.

    Attributes:
        max_num_seqs: most sequences running at once (the largest decode batch).
        max_num_batched_tokens: most tokens computed in one step.
        max_model_len: most positions a sequence's KV may use.
        num_decode_steps: decode steps one batch may run at once (the worker's fused
            multi-step graph); 1 runs one step per batch.
        max_multi_step_seqs: the largest batch that may run several steps at once.
        enable_chunked_prefill: steps mix decodes with chunks of prompts (vLLM V1); off,
            a step is a prefill of whole sequences or a decode.
        num_speculative_tokens: drafts a decode row may verify per step (speculative
            decoding; 0: off). With it, ``num_decode_steps`` counts speculative rounds: a
            decode batch may run that many (draft, verify) rounds at once (the worker's
            fused rounds).
        enable_fork: the ``n`` samples of a request fork from one prefill
            (``engine/forks.py``), when prefix caching is on; off, each sample is prefilled
            and finds the prompt's full blocks in the prefix cache.

    Without chunked prefill a sequence of ``max_model_len`` tokens must fit in one step, so
    ``max_num_batched_tokens >= max_model_len`` is required; a full decode batch must always
    fit, so ``max_num_batched_tokens >= max_num_seqs``.
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    num_decode_steps: int = 1
    max_multi_step_seqs: int = 1
    enable_chunked_prefill: bool = False
    num_speculative_tokens: int = 0
    enable_fork: bool = True

    def __post_init__(self) -> None:
        names = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_decode_steps")
        for name in (*names, "max_multi_step_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) without chunked prefill, so that a "
                "preempted sequence is recomputable in one step; or enable chunked prefill"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}) so a full decode batch fits in one step"
            )


@dataclass(frozen=True, slots=True)
class ScheduledBatch:
    """The rows of one step: sequence ``seqs[i]`` computes ``num_new_tokens[i]`` positions from
    its ``num_computed_tokens`` on, then samples one token if that reaches its last token (a
    chunk of a longer prompt samples nothing). A decode (every row computes its newest token
    only) with ``num_steps > 1`` repeats that ``num_steps`` times, feeding each token back.
    Block tables already cover all computed positions.

    ``is_prefill`` (some row is not a decode: the step runs eagerly, not from a decode graph),
    ``num_scheduled_tokens`` (positions computed, over all steps) and ``num_prefill_tokens``
    (those of the rows that are not decodes) are fixed when the batch is scheduled.

    Speculative decoding (``is_speculative``): a decode row with ``num_draft_tokens[i] = j``
    computes ``num_new_tokens[i] = 1 + j`` positions (its newest token and ``j`` drafts) and
    emits ``1 .. j + 1`` tokens; its blocks cover them all. Every row's draft catches up from
    its sequence's ``num_draft_computed_tokens``. With ``num_steps = M > 1`` (speculative
    rounds), each row runs ``M`` such rounds, each fed the last, and emits ``M .. M (j + 1)``
    tokens; its blocks cover ``M (j + 1) - 1`` positions past its newest token.

    Forks (``engine/forks.py``): a fork row computes no position (``num_new_tokens[i] = 0``)
    and samples its first token from the logits of row ``fork_of[i]``, its leader, which
    computes its prompt's last token in this step; ``block_copies`` are the KV blocks the
    workers copy after the step's forward (the leaders' partial last blocks into the fork
    rows' own).
    """

    seqs: tuple[Sequence, ...]
    num_new_tokens: tuple[int, ...]
    is_prefill: bool
    num_scheduled_tokens: int
    num_prefill_tokens: int
    num_steps: int = 1
    num_draft_tokens: tuple[int, ...] = ()  # per row; () without speculation
    is_speculative: bool = False
    fork_of: tuple[int | None, ...] = ()  # per row; () when no row is a fork row
    block_copies: tuple[tuple[int, int], ...] = ()
    previous_rows: tuple[int, ...] = ()  # per row of a successor; () otherwise
    lead: int = 0  # a successor's: tokens each row gets from the batch in flight before it

    @classmethod
    def of(
        cls,
        rows: SequenceOf[tuple[Sequence, int]],
        num_steps: int = 1,
        drafts: dict[int, int] | None = None,
        forks: dict[int, int] | None = None,
        block_copies: SequenceOf[tuple[int, int]] = (),
    ) -> ScheduledBatch:
        """The batch of ``rows`` (a sequence and its number of new positions, drafts included),
        scheduled now. ``drafts`` (speculative decoding: None when off) maps sequence ids to
        their rows' draft counts (absent: 0); ``forks`` the fork rows' sequence ids to their
        leaders' (whose rows are in ``rows``)."""
        fork_of: tuple[int | None, ...] = ()
        if forks:
            row_of = {seq.seq_id: row for row, (seq, _) in enumerate(rows)}
            fork_of = tuple(row_of[forks[s.seq_id]] if s.seq_id in forks else None for s, _ in rows)
        num_drafts = tuple(0 if drafts is None else drafts.get(s.seq_id, 0) for s, _ in rows)
        prefill = [
            n
            for (seq, n), j in zip(rows, num_drafts, strict=True)
            if n - j != 1 or seq.num_computed_tokens != seq.num_tokens - 1
        ]
        return cls(
            seqs=tuple(seq for seq, _ in rows),
            num_new_tokens=tuple(n for _, n in rows),
            is_prefill=bool(prefill),
            num_scheduled_tokens=sum(n for _, n in rows) * num_steps,
            num_prefill_tokens=sum(prefill),
            num_steps=num_steps,
            num_draft_tokens=num_drafts if drafts is not None else (),
            is_speculative=drafts is not None,
            fork_of=fork_of,
            block_copies=tuple(block_copies),
        )

    @classmethod
    def decodes(
        cls,
        seqs: SequenceOf[Sequence],
        num_steps: int = 1,
        previous_rows: tuple[int, ...] = (),
        lead: int = 0,
    ) -> ScheduledBatch:
        """``of([(seq, 1) for seq in seqs], num_steps)`` for rows known to be decodes (each
        computes its sequence's newest token only), without checking each row again; with
        ``previous_rows``, of a successor (``engine/successor.py``)."""
        return cls(
            seqs=tuple(seqs),
            num_new_tokens=(1,) * len(seqs),
            is_prefill=False,
            num_scheduled_tokens=len(seqs) * num_steps,
            num_prefill_tokens=0,
            num_steps=num_steps,
            previous_rows=previous_rows,
            lead=lead,
        )

    def num_drafts_of(self, row: int) -> int:
        return self.num_draft_tokens[row] if self.num_draft_tokens else 0

    def check_token_ids(self, token_ids: list[list[int]]) -> None:
        """Raises ``ValueError`` unless every row returned ``num_steps`` tokens, or
        ``num_steps .. num_steps * (j + 1)`` with ``j`` drafts."""
        counts = [len(tokens) for tokens in token_ids]
        is_plain = not self.num_draft_tokens and len(counts) == self.num_seqs
        if is_plain and all(count == self.num_steps for count in counts):
            return  # the common case, without building each row's bounds
        expected = [
            (self.num_steps, self.num_steps * (1 + self.num_drafts_of(row)))
            for row in range(self.num_seqs)
        ]
        if len(counts) != self.num_seqs or any(
            not low <= count <= high for count, (low, high) in zip(counts, expected, strict=True)
        ):
            drafts = f" (drafts per row: {list(self.num_draft_tokens)})"
            raise ValueError(
                f"got token ids for {len(counts)} sequences with {sorted(set(counts))} steps, "
                f"for a batch of {self.num_seqs} sequences of {self.num_steps} steps"
                + (drafts if self.is_speculative else "")
            )

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    def step_input(self, eos_token_ids: frozenset[int]) -> StepInput:
        """What the workers compute for this batch: plain data, no ``Sequence`` objects.

        ``eos_token_ids`` are the engine's (model and tokenizer): ``min_tokens`` masks them
        with ``stop_token_ids`` until a request has that many outputs, unless ``ignore_eos``.
        Each feature's data is sent only by the requests that use it (``core/step_input.py``).

        A successor (``previous_rows``) is planned before the batch in flight returns its
        ``lead`` tokens per row: each row computes at ``lead`` positions past its sequence's
        newest token, from the token the worker gathers there (``StepInput.previous_rows``).
        """
        if self.previous_rows:
            seq_inputs = tuple(self._successor_input(seq, eos_token_ids) for seq in self.seqs)
            return StepInput(seq_inputs, is_prefill=False, previous_rows=self.previous_rows)
        fork_of = self.fork_of or (None,) * self.num_seqs
        seq_inputs = tuple(
            self._seq_input(seq, n, self.num_drafts_of(row), eos_token_ids, fork_of[row])
            for row, (seq, n) in enumerate(zip(self.seqs, self.num_new_tokens, strict=True))
        )
        return StepInput(seq_inputs, self.is_prefill, self.block_copies, bool(self.fork_of))

    def _successor_input(self, seq: Sequence, eos_token_ids: frozenset[int]) -> SeqInput:
        """A successor row's input: what ``_seq_input`` sends for a decode of ``seq`` once it
        has its ``lead`` more tokens, but for the token itself and the outputs (none of its
        features needs them: ``needs_output_tokens``)."""
        params = seq.params
        num_outputs = seq.num_output_tokens + self.lead
        return SeqInput(
            token_ids=(PLACEHOLDER_TOKEN_ID,),
            start_position=seq.num_tokens - 1 + self.lead,
            block_table=seq.block_table_tuple(),
            params=params,
            seed=seq.seed,
            num_output_tokens=num_outputs,
            masked_stop_token_ids=_masked_stop_token_ids(params, num_outputs, eos_token_ids),
            bad_words_token_ids=_bad_words(params),
        )

    def _seq_input(
        self,
        seq: Sequence,
        num_new: int,
        num_drafts: int,
        eos_token_ids: frozenset[int],
        fork_of: int | None,
    ) -> SeqInput:
        params = seq.params
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new - num_drafts
        if end == start + 1 == seq.num_tokens:  # a decode: its newest token
            token_ids: tuple[int, ...] = (seq.last_token_id,)
        else:
            token_ids = tuple(seq.token_ids_between(start, end))
        draft_prefix: tuple[int, ...] = ()
        if self.is_speculative:
            draft_prefix = tuple(seq.token_ids_between(seq.num_draft_computed_tokens, start))
        is_repetition_penalised = params.repetition_penalty != 1.0
        return SeqInput(
            token_ids=token_ids,
            start_position=start,
            block_table=seq.block_table_tuple(),
            params=params,
            seed=seq.seed,
            num_output_tokens=seq.num_output_tokens,
            output_token_ids=(tuple(seq.output_token_ids) if needs_output_tokens(params) else None),
            prompt_token_ids=seq.prompt_token_ids if is_repetition_penalised else None,
            masked_stop_token_ids=_masked_stop_token_ids(
                params, seq.num_output_tokens, eos_token_ids
            ),
            bad_words_token_ids=_bad_words(params),
            # The first prefill (a recompute has outputs), whole and uncached (the scheduler
            # neither chunks it nor gives it cached blocks): every prompt position is here.
            compute_prompt_logprobs=(
                params.prompt_logprobs is not None and seq.num_output_tokens == 0
            ),
            num_draft_tokens=num_drafts,
            draft_prefix_token_ids=draft_prefix,
            fork_of=fork_of,
        )


def _masked_stop_token_ids(
    params: SamplingParams, num_outputs: int, eos_token_ids: frozenset[int]
) -> tuple[int, ...]:
    """What ``min_tokens`` masks for the next token after ``num_outputs`` outputs: the EOS ids
    (unless ``ignore_eos``) and the stop token ids, while there are fewer than it asks."""
    if num_outputs >= params.min_tokens:
        return ()
    eos = () if params.ignore_eos else sorted(eos_token_ids)
    return tuple(dict.fromkeys([*eos, *(params.stop_token_ids or ())]))


def _bad_words(params: SamplingParams) -> tuple[tuple[int, ...], ...]:
    if not params.bad_words_token_ids:
        return ()
    return tuple(tuple(word) for word in params.bad_words_token_ids)
