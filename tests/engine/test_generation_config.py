"""vLLM's default sampling parameters (vllm/config/model.py ``get_diff_sampling_param``,
vllm/entrypoints/llm.py ``get_default_sampling_params``): the model's ``generation_config.json``
and ``override_generation_config`` (verl passes it as JSON) replace vLLM's neutral defaults for
``LLM.generate`` without ``sampling_params``; ``generation_config="vllm"`` ignores the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dormant import SamplingParams
from dormant.core.config import EngineConfig
from dormant.core.errors import UnsupportedOptionError
from tests.engine.conftest import PROMPTS

MODEL_DEFAULTS = {"temperature": 0.0, "top_k": 20, "max_new_tokens": 3, "do_sample": True}


@pytest.fixture(scope="module")
def with_defaults(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with a generation config that samples greedily, 3 tokens."""
    path = tmp_path_factory.mktemp("gen") / "model"
    shutil.copytree(checkpoint, path)
    (path / "generation_config.json").write_text(json.dumps(MODEL_DEFAULTS))
    return path


def test_generate_without_params_samples_with_the_models_defaults(make_llm, with_defaults) -> None:
    llm = make_llm(str(with_defaults))
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.0, 20, 3)
    assert defaults.top_p == SamplingParams().top_p  # unset in the file: vLLM's neutral value
    assert llm.get_default_sampling_params() is not defaults  # a caller may change its copy
    implicit = llm.generate([PROMPTS[0]], use_tqdm=False)[0].outputs[0]
    explicit = SamplingParams(temperature=0.0, top_k=20, max_tokens=3)
    expected = llm.generate([PROMPTS[0]], explicit, use_tqdm=False)[0].outputs[0]
    assert len(implicit.token_ids) == 3
    assert list(implicit.token_ids) == list(expected.token_ids)


def test_vllm_source_ignores_the_file_and_overrides_apply_over_it(with_defaults) -> None:
    def defaults(**options: object) -> dict[str, object]:
        return EngineConfig.create(str(with_defaults), **options).sampling_defaults  # type: ignore[arg-type]

    assert defaults() == {"temperature": 0.0, "top_k": 20, "max_tokens": 3}
    assert defaults(generation_config="vllm") == {}
    # verl's form: JSON, the rollout's own values over the model's
    override = json.dumps({"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 7})
    assert defaults(override_generation_config=override) == {
        "temperature": 1.0, "top_k": 20, "top_p": 1.0, "max_tokens": 7,
    }  # fmt: skip
    assert defaults(generation_config="vllm", override_generation_config={"top_k": 5}) == {
        "top_k": 5
    }


def test_a_directory_source_and_a_checkpoint_without_a_file(
    checkpoint: Path, with_defaults: Path
) -> None:
    config = EngineConfig.create(str(checkpoint), generation_config=str(with_defaults))
    assert config.sampling_defaults["max_tokens"] == 3
    assert EngineConfig.create(str(checkpoint)).sampling_defaults == {}  # no file: none


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"override_generation_config": {"do_sample": True}}, "not sampling defaults"),
        ({"override_generation_config": "{temperature: 1}"}, "is not JSON"),
        ({"override_generation_config": [("top_k", 1)]}, "expected a dict"),
        ({"generation_config": "/no/such/dir"}, "expected 'auto'"),
        ({"override_generation_config": {"top_p": 2.0}}, "are invalid"),
    ],
)
def test_bad_generation_options_are_refused_by_name(
    with_defaults: Path, options: dict[str, object], match: str
) -> None:
    with pytest.raises(UnsupportedOptionError, match=match):
        EngineConfig.create(str(with_defaults), **options)  # type: ignore[arg-type]


def test_an_unreadable_generation_config_says_how_to_ignore_it(
    checkpoint: Path, tmp_path: Path
) -> None:
    path = tmp_path / "model"
    shutil.copytree(checkpoint, path)
    (path / "generation_config.json").write_text("{not json")
    with pytest.raises(UnsupportedOptionError, match="generation_config='vllm'"):
        EngineConfig.create(str(path))
    assert EngineConfig.create(str(path), generation_config="vllm").sampling_defaults == {}
