"""From the tokens and logprobs the workers return to vLLM's ``RequestOutput``: incremental
detokenization, stop strings, and logprobs in vLLM's shape, for every sample of a request.

Per appended token, in vLLM's order (``vllm/v1/engine/detokenizer.py``):

1. the scheduler decides the token-level stop (length, EOS, a stop token id);
2. the token's text is appended, except a stop token's when ``include_stop_str_in_output`` is
   False (as vLLM, which does not detokenize it);
3. past ``min_tokens`` outputs, a stop string ending in the new text stops the sample, and the
   text is cut before it (or after it, with ``include_stop_str_in_output``);
4. after the step, the logprobs of the tokens actually appended are recorded (a multi-step
   output is cut at the sample's stop), trimmed to the request's ``logprobs``.

While a sample runs, its visible text holds back ``max(len(stop)) - 1`` characters (a stop
string may still be completing), as vLLM's streamed outputs do.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field

from dormant.core.packed_logprobs import RowLogprobs
from dormant.core.sampling_params import SamplingParams
from dormant.core.step_output import SeqOutput, TokenLogprobs
from dormant.engine.logprob_positions import LogprobPositions
from dormant.engine.outputs import (
    CompletionOutput,
    LogprobsOnePosition,
    PromptLogprobs,
    RequestOutput,
)
from dormant.engine.sequence import Sequence
from dormant.engine.tokenizer import IncrementalDecoder, Tokenizer


@dataclass
class SampleState:
    """What one sample (sequence) produced beyond its token ids."""

    decoder: IncrementalDecoder | None
    text: str = ""
    logprobs: list[LogprobsOnePosition] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestState:
    """A request in flight: its prompt, its samples (in index order) and prompt logprobs."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    samples: list[SampleState]
    prompt_logprobs: PromptLogprobs | None = None
    stop_strings: list[str] = field(default_factory=list)
    # The weights each stretch of its tokens came from: (version name, weights epoch), oldest first.
    weights: list[tuple[str, object]] = field(default_factory=list)

    @property
    def is_finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)


class OutputProcessor:
    """Keeps every unfinished request's output state; builds ``RequestOutput``s.

    ``tokenizer`` is None under ``skip_tokenizer_init``: outputs carry no text and logprobs no
    ``decoded_token``.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        weight_version: Callable[[], str] | None = None,
        weight_epoch: Callable[[], object] | None = None,
    ) -> None:
        """``weight_version`` names the weights in use and ``weight_epoch`` changes whenever
        any weight is written, by any path. Refits through the engine wait for, or abort,
        running requests, but a request kept by ``pause(mode="keep")`` while a worker
        extension refits continues on the new weights, as in vLLM (OpenRLHF relies on it): so
        each output lists every version its tokens came from (``weight_versions``)."""
        self.tokenizer = tokenizer
        self._weight_version = weight_version
        self._weight_epoch = weight_epoch
        self._requests: dict[int, RequestState] = {}
        # Each tracked sequence's request and its own sample (looked up once per token).
        self._sample_of_seq: dict[int, tuple[RequestState, SampleState]] = {}
        self._positions = LogprobPositions(tokenizer)
        # For requests with ``detokenize=False``: vLLM gives their logprobs no decoded_token.
        self._positions_without_text = LogprobPositions(None)

    def add(
        self,
        request_id: int,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seqs: list[Sequence],
    ) -> None:
        """Starts tracking a request whose samples are ``seqs`` (sample ``i`` is ``seqs[i]``)."""
        samples = [self._new_sample(params, prompt_token_ids) for _ in seqs]
        state = RequestState(
            request_id, prompt, prompt_token_ids, params, seqs, samples,
            prompt_logprobs=None if params.prompt_logprobs is None else [None],
            stop_strings=params.stop_strings,
        )  # fmt: skip
        self._requests[request_id] = state
        for seq, sample in zip(seqs, samples, strict=True):
            self._sample_of_seq[seq.seq_id] = (state, sample)

    def seq_ids(self, request_ids: SequenceOf[int] | None) -> list[int] | None:
        """The sequence ids of these requests (all when None); unknown ids are skipped."""
        if request_ids is None:
            return None
        states = [self._requests[r] for r in request_ids if r in self._requests]
        return [seq.seq_id for state in states for seq in state.seqs]

    def on_token(self, seq: Sequence, token_id: int, is_stop_token: bool) -> str | None:
        """The scheduler's ``TokenHook``: appends the token's text; returns the stop string
        the text now ends with (and cuts the text there), else None."""
        state, sample = self._sample_of_seq[seq.seq_id]
        decoder = sample.decoder
        if decoder is None:
            return None
        params, stops = state.params, state.stop_strings
        num_chars_before = len(sample.text) if stops else 0
        if not is_stop_token or params.include_stop_str_in_output:
            sample.text += decoder.step(token_id)
        if not stops or seq.num_output_tokens <= params.min_tokens:
            return None
        return _cut_at_stop_string(sample, num_chars_before, stops, params)

    def record_step(
        self, seqs: SequenceOf[Sequence], outputs: SequenceOf[SeqOutput], num_before: list[int]
    ) -> None:
        """Records the logprobs of the tokens each of ``seqs`` appended in this step
        (``num_before[i]`` is how many outputs ``seqs[i]`` had before) and prompt logprobs."""
        weights = self._weights_in_use()
        tracked = self._sample_of_seq
        for seq, output, before in zip(seqs, outputs, num_before, strict=True):
            found = tracked.get(seq.seq_id)
            if found is None:
                continue
            state, sample = found
            appended = seq.output_token_ids[before:]
            if (
                appended
                and weights is not None
                and (not state.weights or state.weights[-1] != weights)
            ):
                state.weights.append(weights)
            if output.logprobs is not None and appended:
                self._record_logprobs(state, sample, appended, output.logprobs)
            if output.prompt_logprobs is not None and seq is state.seqs[0]:
                self._record_prompt_logprobs(state, output.prompt_logprobs)

    def output(self, request_id: int) -> RequestOutput | None:
        """The request's output so far (None if it is not tracked)."""
        state = self._requests.get(request_id)
        return None if state is None else self._build(state)

    def num_generated(self, request_id: int) -> int | None:
        """Tokens its samples generated so far, without building its output (None if it is not
        tracked): a listener's progress is built only when this grew."""
        state = self._requests.get(request_id)
        return None if state is None else sum(len(seq.output_token_ids) for seq in state.seqs)

    def pop_finished(self, finished: SequenceOf[Sequence]) -> list[RequestOutput]:
        """The outputs of the requests that ``finished`` completed, which are then forgotten."""
        outputs: list[RequestOutput] = []
        for seq in finished:
            found = self._sample_of_seq.get(seq.seq_id)
            if found is None or not found[0].is_finished:
                continue
            state = found[0]
            outputs.append(self._build(state))
            del self._requests[state.request_id]
            for done in state.seqs:
                del self._sample_of_seq[done.seq_id]
        return outputs

    def _new_sample(self, params: SamplingParams, prompt_token_ids: list[int]) -> SampleState:
        decoder = None
        if self.tokenizer is not None and params.detokenize:
            decoder = self.tokenizer.incremental_decoder(
                prompt_token_ids, params.skip_special_tokens
            )
        wants_logprobs = params.logprobs is not None
        return SampleState(
            decoder,
            logprobs=[] if wants_logprobs else None,
            cumulative_logprob=0.0 if wants_logprobs else None,
        )

    def _record_logprobs(
        self,
        state: RequestState,
        sample: SampleState,
        token_ids: list[int],
        entries: SequenceOf[TokenLogprobs],
    ) -> None:
        """Records the logprobs of ``token_ids``, the first ``len(token_ids)`` of ``entries``
        (the row's output may run past the sample's stop)."""
        assert sample.logprobs is not None and sample.cumulative_logprob is not None
        num = state.params.logprobs
        count = len(token_ids)
        shaper = self._shaper(state.params)
        values: list[float]
        # (An exact type test and num == 0, as_count(num) == 0: this runs once per row per step.)
        if type(entries) is RowLogprobs and (num == 0 or entries.block.num_top == 0):
            # Only each entry's first token is reported: read from the packed columns, no
            # TokenLogprobs made (what LogprobPositions.sampled builds for these entries).
            entry_ids, values, ranks = entries.columns(count)
            positions = shaper.sampled_first(state.request_id, token_ids, entry_ids, values, ranks)
        else:
            entries = entries[:count]
            positions = shaper.sampled(state.request_id, num, token_ids, entries)
            values = [entry.logprobs[0] for entry in entries]
        sample.logprobs += positions
        total = sample.cumulative_logprob
        for value in values:  # one addition per token, in order, as vLLM sums them
            total += value
        sample.cumulative_logprob = total

    def _record_prompt_logprobs(
        self, state: RequestState, entries: SequenceOf[TokenLogprobs]
    ) -> None:
        logprobs = state.prompt_logprobs
        if logprobs is None or len(logprobs) > 1:  # not asked for, or recorded already
            return
        shaper = self._shaper(state.params)
        logprobs.extend(shaper.prompt(state.params.prompt_logprobs, entries))

    def _shaper(self, params: SamplingParams) -> LogprobPositions:
        return self._positions if params.detokenize else self._positions_without_text

    def _build(self, state: RequestState) -> RequestOutput:
        params = state.params
        held_back = 0
        if state.stop_strings and not params.include_stop_str_in_output:
            held_back = max(len(s) for s in state.stop_strings) - 1
        completions = []
        for index, (seq, sample) in enumerate(zip(state.seqs, state.samples, strict=True)):
            text = sample.text
            if held_back and not seq.is_finished:
                text = text[: max(0, len(text) - held_back)]
            completions.append(
                CompletionOutput(
                    index=index,
                    text=text,
                    token_ids=list(seq.output_token_ids),
                    cumulative_logprob=sample.cumulative_logprob,
                    logprobs=None if sample.logprobs is None else list(sample.logprobs),
                    finish_reason=None if seq.finish_reason is None else str(seq.finish_reason),
                    stop_reason=seq.stop_reason,
                    spec_decode_stats=(
                        None if seq.spec_decode_stats is None else seq.spec_decode_stats.copy()
                    ),
                )
            )
        prompt_logprobs = state.prompt_logprobs
        return RequestOutput(
            request_id=str(state.request_id),
            prompt=state.prompt,
            prompt_token_ids=list(state.prompt_token_ids),
            prompt_logprobs=None if prompt_logprobs is None else list(prompt_logprobs),
            outputs=completions,
            finished=state.is_finished,
            # The prompt tokens a sample's first prefill found in the prefix cache (the most of
            # any sample: the first sample of n computes what the others hit).
            num_cached_tokens=max(seq.num_cached_tokens or 0 for seq in state.seqs),
            weight_version=None if self._weight_version is None else self._weight_version(),
            weight_versions=[name for name, _ in state.weights],
        )

    def _weights_in_use(self) -> tuple[str, object] | None:
        if self._weight_version is None:
            return None
        epoch = None if self._weight_epoch is None else self._weight_epoch()
        return self._weight_version(), epoch


def _cut_at_stop_string(
    sample: SampleState, num_chars_before: int, stops: list[str], params: SamplingParams
) -> str | None:
    """vLLM's ``check_stop_strings``: the first stop string (in ``stop`` order) that ends in
    the text appended since ``num_chars_before``; cuts ``sample.text`` there."""
    text = sample.text
    num_new_chars = len(text) - num_chars_before
    if not num_new_chars:
        return None
    for stop in stops:
        index = text.find(stop, max(0, num_chars_before - len(stop) + 1))
        if index == -1:
            continue
        end = index + len(stop) if params.include_stop_str_in_output else index
        sample.text = text[:end]
        return stop
    return None
