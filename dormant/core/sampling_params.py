"""Per-request sampling parameters: vLLM's ``SamplingParams``, name for name, with its defaults
and its refusals.

Fields are assignable, as in vLLM (OpenRLHF sets ``params.max_tokens = ...`` between calls).
``validate()`` checks every field; the constructor runs it, and the engine runs it again, with
the engine's limits, on the copy it takes when a request is added, before anything is queued.
"""

from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass, field
from typing import Any

from dormant.core.errors import InvalidSamplingParamsError, UnsupportedSamplingParamsError


class RequestOutputKind(enum.IntEnum):
    """vLLM's ``RequestOutputKind``: what each output ``AsyncLLM.generate`` yields holds."""

    CUMULATIVE = 0  # everything so far
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # one output, when the request finished


# Temperatures below this are treated as greedy, as in vLLM (``_SAMPLING_EPS``): dividing logits
# by a vanishing temperature overflows float32 without changing which token wins.
GREEDY_TEMPERATURE_EPSILON = 1e-5
# vLLM raises positive temperatures below this to it (``_MAX_TEMP``), for the same reason.
MIN_RANDOM_TEMPERATURE = 1e-2
MAX_TEMPERATURE = 2.0
PENALTY_RANGE = (-2.0, 2.0)  # presence_penalty and frequency_penalty, as vLLM
# vLLM features that dormant does not implement: a request using one is refused, never run
# without it.
_UNSUPPORTED = {
    "structured_outputs": "structured outputs",
    "guided_decoding": "guided decoding",
    "logits_processors": "per-request logits processors",
    "logit_bias": "logit_bias (a logits processor)",
    "allowed_token_ids": "allowed_token_ids (a logits processor)",
}


@dataclass(slots=True)
class SamplingParams:
    """How to pick each output token of one request, and when to stop (vLLM's meanings).

    Attributes:
        n: completions to generate for the prompt (they share the prompt's KV).
        presence_penalty, frequency_penalty: in [-2, 2]; penalise tokens already generated.
        repetition_penalty: > 0; ``1`` is off; penalises tokens of the prompt and the output.
        temperature: in [0, 2]; ``0`` is greedy (argmax). Positive values below 0.01 are
            raised to 0.01 when the request is added.
        top_p: in (0, 1]; ``1`` keeps every token.
        top_k: ``0``, ``-1`` or ``None`` keep every token; else the ``top_k`` most likely.
        min_p: in [0, 1]; drop tokens less likely than ``min_p`` times the most likely one.
        seed: makes random sampling reproducible; ``None`` (or ``-1``) lets the engine draw one.
            With ``n > 1`` sample ``i`` uses ``seed + i``, as vLLM.
        stop: string(s) that end the output when generated; the text is cut before them
            unless ``include_stop_str_in_output``.
        stop_token_ids: token ids that end the output; the token is kept in ``token_ids``.
        bad_words: words never generated (their last token is masked when the rest matches).
        ignore_eos: keep generating past the model's EOS tokens.
        max_tokens: the most output tokens; ``None`` means up to ``max_model_len``.
        min_tokens: EOS and ``stop_token_ids`` cannot end the output before this many tokens.
        logprobs: ``None``: none; ``k >= 0``: the sampled token's logprob and the top ``k``;
            ``-1``: the whole vocabulary. At most the engine's ``max_logprobs``.
        prompt_logprobs: the same for every prompt position (the first is ``None``).
        detokenize, skip_special_tokens, spaces_between_special_tokens: how ``text`` is made.
        extra_args: carried for plugins; dormant reads none of it.
        structured_outputs, guided_decoding, logits_processors, logit_bias, allowed_token_ids:
            vLLM features dormant does not implement; anything but ``None`` is refused with
            ``UnsupportedSamplingParamsError``.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    extra_args: dict[str, Any] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: Any = None
    guided_decoding: Any = None
    logits_processors: Any = None
    logit_bias: Any = None
    allowed_token_ids: Any = None
    # Set by the engine from ``bad_words`` and its tokenizer (vLLM's ``_bad_words_token_ids``).
    _bad_words_token_ids: list[list[int]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        self.validate()

    @property
    def is_greedy(self) -> bool:
        """Whether the sampler takes the argmax (temperature is zero or vanishingly small)."""
        return self.temperature < GREEDY_TEMPERATURE_EPSILON

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as a list (vLLM normalises ``None`` and a single string the same way)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        """Each bad word as token ids, once the engine tokenized them (else None)."""
        return self._bad_words_token_ids

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's ``clone``): what the engine keeps for a request, so later
        assignments to the caller's object change no request in flight."""
        return copy.deepcopy(self)

    def validate(self, *, max_logprobs: int | None = None, vocab_size: int | None = None) -> None:
        """Raises ``InvalidSamplingParamsError`` (a ``ValueError``) naming the first bad field,
        or ``UnsupportedSamplingParamsError`` for a vLLM feature dormant does not implement.

        ``max_logprobs`` and ``vocab_size`` are the engine's limits (checked when given).
        """
        for name, feature in _UNSUPPORTED.items():
            if getattr(self, name) is not None:
                raise UnsupportedSamplingParamsError(
                    f"SamplingParams({name}=...): {feature} is not supported by dormant; "
                    f"leave {name}=None"
                )
        _check_int(self.n, "n", minimum=1)
        if self.n > 1 and self.is_greedy:
            raise InvalidSamplingParamsError(
                f"n must be 1 when using greedy sampling (temperature=0), got n={self.n}"
            )
        _check_range(self.presence_penalty, "presence_penalty", *PENALTY_RANGE)
        _check_range(self.frequency_penalty, "frequency_penalty", *PENALTY_RANGE)
        _check_real(self.repetition_penalty, "repetition_penalty")
        if self.repetition_penalty <= 0:
            raise InvalidSamplingParamsError(
                f"repetition_penalty must be > 0 (1 is off), got {self.repetition_penalty}"
            )
        _check_range(self.temperature, "temperature", 0.0, MAX_TEMPERATURE)
        _check_real(self.top_p, "top_p")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidSamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None:
            _check_int(self.top_k, "top_k (0 or -1 disable it)", minimum=-1)
        _check_range(self.min_p, "min_p", 0.0, 1.0)
        if self.seed is not None:
            _check_int(self.seed, "seed")
        self._validate_lengths()
        self._validate_stops(vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            self._validate_logprobs(name, max_logprobs, vocab_size)
        for name in (
            "include_stop_str_in_output", "ignore_eos", "detokenize", "skip_special_tokens",
            "spaces_between_special_tokens",
        ):  # fmt: skip
            if not isinstance(getattr(self, name), bool):
                raise InvalidSamplingParamsError(
                    f"{name} must be a bool, got {getattr(self, name)!r}"
                )
        if not self.skip_special_tokens and not self.spaces_between_special_tokens:
            raise UnsupportedSamplingParamsError(
                "spaces_between_special_tokens=False with skip_special_tokens=False is not "
                "supported: dormant's detokenizer (tokenizers' DecodeStream) keeps the "
                "tokenizer's own spacing; leave spaces_between_special_tokens=True"
            )
        if self.output_kind not in tuple(RequestOutputKind):
            raise InvalidSamplingParamsError(
                f"output_kind must be a RequestOutputKind (0, 1, 2), got {self.output_kind!r}"
            )
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise InvalidSamplingParamsError(
                f"extra_args must be a dict or None, got {self.extra_args!r}"
            )

    def _validate_lengths(self) -> None:
        if self.max_tokens is not None:
            _check_int(self.max_tokens, "max_tokens", minimum=1)
        _check_int(self.min_tokens, "min_tokens", minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidSamplingParamsError(
                f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}"
            )

    def _validate_stops(self, vocab_size: int | None) -> None:
        stop = self.stop
        is_list = isinstance(stop, list | tuple) and all(isinstance(s, str) for s in stop)
        if stop is not None and not isinstance(stop, str) and not is_list:
            raise InvalidSamplingParamsError(
                f"stop must be a string or a list of strings, got {stop!r}"
            )
        if any(not s for s in self.stop_strings):
            raise InvalidSamplingParamsError("stop cannot contain an empty string")
        if self.stop_strings and not self.detokenize:
            raise InvalidSamplingParamsError(
                "stop strings are only supported when detokenize is True; set detokenize=True"
            )
        ids = self.stop_token_ids
        if ids is not None:
            if isinstance(ids, str | bytes) or not isinstance(ids, list | tuple):
                raise InvalidSamplingParamsError(
                    f"stop_token_ids must be a list of ints or None, got {ids!r}"
                )
            bad = [t for t in ids if not _is_int(t) or t < 0 or (vocab_size and t >= vocab_size)]
            if bad:
                raise InvalidSamplingParamsError(
                    f"stop_token_ids must be ints in [0, vocab_size={vocab_size}), got {bad}"
                )
        words = self.bad_words
        if words is not None and (
            not isinstance(words, list | tuple) or not all(isinstance(w, str) and w for w in words)
        ):
            raise InvalidSamplingParamsError(
                f"bad_words must be a list of non-empty strings, got {words!r}"
            )

    def _validate_logprobs(
        self, name: str, max_logprobs: int | None, vocab_size: int | None
    ) -> None:
        value = getattr(self, name)
        if value is None:
            return
        if value is True:  # vLLM takes True as 1
            value = 1
        _check_int(value, f"{name} (-1 means the whole vocabulary)", minimum=-1)
        if max_logprobs is None:
            return
        limit = vocab_size if max_logprobs == -1 else max_logprobs
        wanted = vocab_size if value == -1 else value
        if limit is not None and wanted is not None and wanted > limit:
            raise InvalidSamplingParamsError(
                f"requested {name}={value}, more than max_logprobs={max_logprobs}; build the "
                "LLM with a larger max_logprobs (-1 allows the whole vocabulary)"
            )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(value: object, name: str, minimum: int | None = None) -> None:
    if not _is_int(value):
        raise InvalidSamplingParamsError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:  # type: ignore[operator]
        raise InvalidSamplingParamsError(f"{name} must be >= {minimum}, got {value}")


def _check_real(value: object, name: str) -> None:
    is_real = isinstance(value, int | float) and not isinstance(value, bool)
    if not is_real or not math.isfinite(value):  # type: ignore[arg-type]
        raise InvalidSamplingParamsError(f"{name} must be a finite number, got {value!r}")


def _check_range(value: object, name: str, low: float, high: float) -> None:
    _check_real(value, name)
    if not low <= value <= high:  # type: ignore[operator]
        raise InvalidSamplingParamsError(f"{name} must be in [{low}, {high}], got {value}")
