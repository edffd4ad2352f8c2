"""SamplingParams: defaults, validation and normalisation."""

from __future__ import annotations

import dataclasses

import pytest

from dormant.core.sampling_params import SamplingParams


def test_defaults_mirror_vllm() -> None:
    params = SamplingParams()
    assert params.temperature == 1.0
    assert params.top_p == 1.0
    assert params.top_k is None
    assert params.max_tokens == 16
    assert params.seed is None
    assert params.stop_token_ids == ()
    assert params.ignore_eos is False
    assert not params.is_greedy


def test_is_frozen() -> None:
    params = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.5  # type: ignore[misc]


def test_unknown_kwarg_raises() -> None:
    with pytest.raises(TypeError):
        SamplingParams(temprature=0.5)  # type: ignore[call-arg]


def test_stop_token_ids_are_normalised_to_a_tuple() -> None:
    assert SamplingParams(stop_token_ids=[3, 1]).stop_token_ids == (3, 1)
    assert SamplingParams(stop_token_ids=range(2)).stop_token_ids == (0, 1)
    assert hash(SamplingParams(stop_token_ids=[3])) == hash(SamplingParams(stop_token_ids=(3,)))


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
        ({"top_k": 0}, "top_k"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
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
