"""vLLM's chat-template options on ``/v1/chat/completions`` (TRL's ``VLLMClient.chat`` sends
``chat_template_kwargs``, e.g. Qwen3's ``enable_thinking``): ``add_generation_prompt``,
``continue_final_message`` and ``chat_template_kwargs`` reach the model's template; a template
in the request is refused, as vLLM refuses it without ``--trust-request-chat-template``."""

from __future__ import annotations

import pytest

MESSAGES = [{"role": "user", "content": "hello world"}]
BASE = {"messages": MESSAGES, "max_tokens": 1, "return_token_ids": True}


def _prompt(server, **fields: object) -> list[int]:
    reply = server.post("/v1/chat/completions", {**BASE, **fields})
    assert reply.status_code == 200, reply.text
    return reply.json()["prompt_token_ids"]


def test_template_options_reach_the_template(server) -> None:
    with_turn = _prompt(server)
    without = _prompt(server, add_generation_prompt=False)
    assert with_turn[: len(without)] == without and len(with_turn) > len(without)
    assert _prompt(server, chat_template_kwargs={"add_generation_prompt": False}) == without
    continued = [*MESSAGES, {"role": "assistant", "content": "the engine"}]
    assert (
        _prompt(
            server, messages=continued, add_generation_prompt=False, continue_final_message=True
        )[: len(without)]
        == without
    )


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"chat_template": "{{ messages }}"}, "--trust-request-chat-template"),
        ({"chat_template_kwargs": {"tokenize": False}}, "may not set"),
        ({"chat_template_kwargs": {"messages": []}}, "may not set"),
        ({"continue_final_message": True}, "cannot both be true"),
    ],
)
def test_template_options_that_are_refused(server, fields: dict, match: str) -> None:
    reply = server.post("/v1/chat/completions", {**BASE, **fields})
    assert reply.status_code == 400 and match in reply.json()["error"]["message"], reply.text
