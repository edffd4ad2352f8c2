"""SamplingParams: defaults, validation and normalisation."""

from __future__ import annotations

import pytest

from dormant.core.errors import InvalidSamplingParamsError, UnsupportedSamplingParamsError
from dormant.core.sampling_params import SamplingParams


def test_defaults_mirror_vllm() -> None:
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k) == (1, 1.0, 1.0, 0)
    assert (params.min_p, params.repetition_penalty) == (0.0, 1.0)
    assert (params.presence_penalty, params.frequency_penalty) == (0.0, 0.0)
    assert (params.max_tokens, params.min_tokens) == (16, 0)
    assert params.seed is None and params.stop is None and params.stop_token_ids is None
    assert params.logprobs is None and params.prompt_logprobs is None
    assert params.skip_special_tokens and params.detokenize and not params.ignore_eos
    assert not params.is_greedy


def test_fields_are_assignable_and_clone_is_deep() -> None:
    """OpenRLHF assigns ``params.max_tokens = ...``; the engine keeps its own copy."""
    params = SamplingParams(stop=["a"])
    params.max_tokens = 3
    copy = params.clone()
    copy.stop.append("b")  # type: ignore[union-attr]
    assert params.max_tokens == 3 and params.stop == ["a"]


def test_unknown_kwarg_raises() -> None:
    with pytest.raises(TypeError):
        SamplingParams(temprature=0.5)  # type: ignore[call-arg]


@pytest.mark.parametrize("name", ["structured_outputs", "guided_decoding", "logits_processors"])
def test_unsupported_features_are_refused(name: str) -> None:
    with pytest.raises(UnsupportedSamplingParamsError, match=name):
        SamplingParams(**{name: {"regex": "a+"}})


def test_special_token_spacing_that_cannot_be_honoured_is_refused() -> None:
    with pytest.raises(UnsupportedSamplingParamsError, match="spaces_between_special_tokens"):
        SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False)


def test_stop_strings_normalise_like_vllm() -> None:
    assert SamplingParams(stop="x").stop_strings == ["x"]
    assert SamplingParams(stop=None).stop_strings == []


def test_logprobs_limit_is_the_engines() -> None:
    params = SamplingParams(logprobs=21)
    with pytest.raises(InvalidSamplingParamsError, match="max_logprobs=20"):
        params.validate(max_logprobs=20, vocab_size=100)
    SamplingParams(logprobs=-1).validate(max_logprobs=-1, vocab_size=100)
    with pytest.raises(InvalidSamplingParamsError, match="logprobs"):
        SamplingParams(logprobs=-1).validate(max_logprobs=20, vocab_size=100)


@pytest.mark.parametrize("temperature", [0, 0.0, 1e-7])
def test_zero_temperature_is_greedy(temperature: float) -> None:
    assert SamplingParams(temperature=temperature).is_greedy


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -0.2}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"temperature": 2.5}, "temperature"),
        ({"n": 0}, "n"),
        ({"n": 2, "temperature": 0.0}, "greedy"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"logprobs": -2}, "logprobs"),
        ({"bad_words": [""]}, "bad_words"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"seed": 1.5}, "seed"),
        ({"stop_token_ids": [1, -2]}, "stop_token_ids"),
        ({"stop_token_ids": "ab"}, "stop_token_ids"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_invalid_values_raise_value_error(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_valid_edge_values() -> None:
    params = SamplingParams(temperature=0.0, top_p=1.0, top_k=1, max_tokens=1, seed=-3)
    assert params.top_k == 1
    assert params.seed == -3
