"""vLLM's default sampling parameters: the model's ``generation_config.json`` and the
``override_generation_config`` option, for requests that leave a parameter unset.

vLLM reads them at start (``ModelConfig.get_diff_sampling_param``): ``LLM.generate`` without
``sampling_params`` samples with them, and the OpenAI server fills a request's missing
``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and ``max_tokens`` from
them. ``generation_config`` picks the source: ``"auto"`` the model directory's file,
``"vllm"`` none (vLLM's neutral defaults), or a directory holding a ``generation_config.json``.

dormant is stricter than vLLM in one place: an override key that is not one of the six
parameters raises ``UnsupportedOptionError`` (vLLM ignores it), and a value that
``SamplingParams`` refuses raises when the engine is built, not on the first request.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dormant.core.errors import UnsupportedOptionError
from dormant.core.vllm_options import json_option

GENERATION_CONFIG_FILE = "generation_config.json"
# The Hugging Face names vLLM takes from the file; max_new_tokens becomes max_tokens.
SAMPLING_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")


def parse_override(value: Any) -> dict[str, Any]:
    """``override_generation_config`` as vLLM takes it: a dict, its JSON (vLLM's CLI form,
    which verl passes), or None. Raises ``UnsupportedOptionError`` for anything else, or for a
    key dormant would ignore."""
    if value is None:
        return {}
    value = json_option("override_generation_config", value)
    if not isinstance(value, Mapping):
        raise UnsupportedOptionError(
            f"override_generation_config={value!r}: expected a dict (or its JSON) of "
            f"{', '.join(SAMPLING_KEYS)}"
        )
    unknown = sorted(set(value) - set(SAMPLING_KEYS))
    if unknown:
        raise UnsupportedOptionError(
            f"override_generation_config keys {unknown} are not sampling defaults; dormant "
            f"takes {', '.join(SAMPLING_KEYS)} (the rest of a generation config has no effect "
            "on sampling: leave it out)"
        )
    return dict(value)


def check_source(generation_config: str) -> None:
    """Raises ``UnsupportedOptionError`` unless ``generation_config`` is "auto", "vllm" or an
    existing directory."""
    if generation_config in ("auto", "vllm"):
        return
    if not isinstance(generation_config, str) or not Path(generation_config).is_dir():
        raise UnsupportedOptionError(
            f"generation_config={generation_config!r}: expected 'auto' (the model's "
            "generation_config.json), 'vllm' (no model defaults) or a directory holding a "
            "generation_config.json"
        )


def sampling_defaults(
    generation_config: str, model_dir: str | None, override: Mapping[str, Any]
) -> dict[str, Any]:
    """The ``SamplingParams`` fields that replace vLLM's neutral defaults: the source's
    sampling keys that are set, updated by ``override``, with ``max_new_tokens`` named
    ``max_tokens``. Empty when nothing is set (as vLLM's ``get_diff_sampling_param``)."""
    if generation_config == "vllm":
        config: dict[str, Any] = {}
    else:
        source = model_dir if generation_config == "auto" else generation_config
        config = _read(source)
    config.update(override)
    fields = {key: config[key] for key in SAMPLING_KEYS if config.get(key) is not None}
    if "max_new_tokens" in fields:
        fields["max_tokens"] = fields.pop("max_new_tokens")
    return fields


def _read(directory: str | None) -> dict[str, Any]:
    """The directory's ``generation_config.json`` (nothing when there is none, as vLLM)."""
    if directory is None:
        return {}
    path = Path(directory) / GENERATION_CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise UnsupportedOptionError(
            f"{path} is not a readable generation config: {error}; fix it, or pass "
            "generation_config='vllm' to ignore it"
        ) from error
    return config if isinstance(config, dict) else {}
