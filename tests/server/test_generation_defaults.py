"""The OpenAI routes fill what a request leaves unset from the model's generation config, as
vLLM's server does (vllm/entrypoints/openai ``to_sampling_params`` with
``default_sampling_params``; vllm/entrypoints/utils.py ``get_max_tokens``): temperature, top-p,
top-k, min-p and the repetition penalty, and ``max_tokens`` (within the room the prompt leaves).
A value the request gives always wins."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.server.conftest import PROMPTS


@pytest.fixture(scope="module")
def greedy_model(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The server's checkpoint with a generation config: greedy, 3 new tokens."""
    path = tmp_path_factory.mktemp("gen") / "model"
    shutil.copytree(model_dir, path)
    config = {"temperature": 0.0, "max_new_tokens": 3}
    (path / "generation_config.json").write_text(json.dumps(config))
    return path


def _tokens(body: dict) -> list[int]:
    return body["choices"][0]["token_ids"]


def test_unset_fields_take_the_models_generation_config(start_server, greedy_model) -> None:
    server = start_server(greedy_model)
    base = {"prompt": PROMPTS[0], "ignore_eos": True, "return_token_ids": True}
    implicit = server.post("/v1/completions", {**base, "max_tokens": None})
    explicit = server.post("/v1/completions", {**base, "max_tokens": 3, "temperature": 0.0})
    assert implicit.status_code == explicit.status_code == 200, implicit.text
    assert len(_tokens(implicit.json())) == 3
    assert _tokens(implicit.json()) == _tokens(explicit.json())
    # the request's own value wins; completions keep the OpenAI default of 16 tokens
    assert len(_tokens(server.post("/v1/completions", {**base, "max_tokens": 5}).json())) == 5
    assert len(_tokens(server.post("/v1/completions", base).json())) == 16
    chat = {"messages": [{"role": "user", "content": "the quick brown fox"}], "ignore_eos": True}
    reply = server.post("/v1/chat/completions", chat)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 3


def test_generation_config_vllm_keeps_the_neutral_defaults(start_server, greedy_model) -> None:
    server = start_server(greedy_model, engine_options={"generation_config": "vllm"})
    chat = {"messages": [{"role": "user", "content": "the quick brown fox"}], "ignore_eos": True}
    usage = server.post("/v1/chat/completions", chat).json()["usage"]
    # no default: all the room the prompt leaves in the 256-token context
    assert usage["completion_tokens"] == 256 - usage["prompt_tokens"]
