"""``speculative_config``: vLLM's keys accepted, everything else refused with a typed error
that says what is supported, before any engine is built."""

from __future__ import annotations

from pathlib import Path

import pytest

from dormant.core.config import EngineConfig
from dormant.core.errors import UnsupportedOptionError
from dormant.core.speculative_config import SpeculativeConfig
from dormant.models import ModelConfig


def _create(model: object, spec: object, **options: object) -> EngineConfig:
    return EngineConfig.create(model, speculative_config=spec, **options)  # type: ignore[arg-type]


def test_a_draft_model_with_vllms_keys(checkpoint: Path, other_checkpoint: Path) -> None:
    config = _create(
        checkpoint,
        {
            "model": str(other_checkpoint),
            "num_speculative_tokens": 3,
            "draft_tensor_parallel_size": 1,
            "disable_logprobs": False,
            "quantization": None,
        },
    )
    spec = config.speculative_config
    assert spec is not None and spec.method == "draft_model" and spec.num_speculative_tokens == 3
    assert spec.draft_path == str(other_checkpoint) and not spec.is_self_speculation
    assert spec.draft_model_config is not None
    assert spec.draft_model_config.dtype == config.model_config.dtype


def test_self_speculation_is_the_targets_own_path_or_config(checkpoint: Path) -> None:
    by_path = _create(checkpoint, {"method": "draft_model", "model": str(checkpoint),
                                   "num_speculative_tokens": 1})  # fmt: skip
    assert by_path.speculative_config is not None
    assert by_path.speculative_config.is_self_speculation
    target = ModelConfig.from_pretrained(str(checkpoint))
    by_config = _create(target, {"model": target, "num_speculative_tokens": 2})
    assert by_config.speculative_config is not None
    assert by_config.speculative_config.is_self_speculation
    assert by_config.speculative_config.draft_path is None  # random, seeded as the target


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"method": "ngram", "num_speculative_tokens": 3}, "'draft_model'.*'mtp'"),
        ({"method": "eagle", "model": "x", "num_speculative_tokens": 3}, "not supported"),
        ({"num_speculative_tokens": 3}, "not supported"),  # no model, no method
        ({"model": "{ckpt}", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"model": "{ckpt}"}, "num_speculative_tokens"),
        ({"model": "{ckpt}", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "keys"),
        ({"model": "{ckpt}", "num_speculative_tokens": 2, "quantization": "fp8"}, "on disk"),
        (
            {"model": "{ckpt}", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
            "tensor_parallel_size=1",
        ),
        (
            {"model": "{ckpt}", "num_speculative_tokens": 2, "draft_sample_method": "x"},
            "draft_sample_method",
        ),
        ({"method": "mtp", "model": "{ckpt}", "num_speculative_tokens": 2}, "drop 'model'"),
        ("{ckpt}", "a dict"),
    ],
)
def test_refused(checkpoint: Path, spec: object, match: str) -> None:
    if isinstance(spec, dict):
        spec = {k: str(checkpoint) if v == "{ckpt}" else v for k, v in spec.items()}
    elif spec == "{ckpt}":
        spec = str(checkpoint)
    with pytest.raises(UnsupportedOptionError, match=match):
        _create(checkpoint, spec)


def test_a_draft_with_another_vocabulary_is_refused(checkpoint: Path) -> None:
    target = ModelConfig.from_pretrained(str(checkpoint))
    from dataclasses import replace

    draft = replace(target, vocab_size=target.vocab_size * 2)
    with pytest.raises(UnsupportedOptionError, match="vocabulary"):
        _create(checkpoint, {"model": draft, "num_speculative_tokens": 2})


def test_a_config_object_passes_through(checkpoint: Path) -> None:
    spec = SpeculativeConfig("draft_model", 2, ModelConfig.from_pretrained(str(checkpoint)))
    assert _create(checkpoint, spec).speculative_config is spec
