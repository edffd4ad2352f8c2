"""What ``generate`` returns, in vLLM's shapes and names (``vllm.outputs``, ``vllm.logprobs``).

``CompletionOutput.logprobs`` holds one ``{token_id: Logprob}`` per generated token: the sampled
token first (with its rank in the whole vocabulary), then the top ``k`` (ranks 1..k); the dict
has ``k`` entries when the sampled token is among the top ``k``, else ``k + 1``.
``RequestOutput.prompt_logprobs`` starts with ``None`` (the first prompt token has no logprob).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dormant.engine.spec_stats import SpecDecodeStats


@dataclass
class Logprob:
    """vLLM's ``Logprob``: a token's logprob, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


LogprobsOnePosition = dict[int, Logprob]
SampleLogprobs = list[LogprobsOnePosition]
PromptLogprobs = list[LogprobsOnePosition | None]


@dataclass
class CompletionOutput:
    """One of the ``n`` completions of a request.

    ``finish_reason`` is "stop", "length" or "abort" (None while unfinished); ``stop_reason`` is
    the stop string or stop token id that ended it (None for EOS and other reasons).
    ``cumulative_logprob`` sums the sampled tokens' logprobs; it and ``logprobs`` are None
    unless the request asked for logprobs. ``spec_decode_stats`` counts its speculative
    decoding (drafts verified, tokens proposed and accepted); None when it verified none.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    spec_decode_stats: SpecDecodeStats | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request and its completions (``outputs[i].index == i``); ``finished`` once all are."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    weight_version: str | None = None  # the weights in use now (SGLang's name)
    # Every weight version its tokens came from, oldest first. More than one only for a request
    # kept by pause(mode="keep") across a refit (vLLM's behaviour); a refit that named no new
    # version repeats the name.
    weight_versions: list[str] = field(default_factory=list)
