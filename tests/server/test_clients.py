"""The official ``openai`` client against the server (completions, chat, streaming, ``n``,
logprobs), and a bounded load: 32 concurrent clients with a sleep/wake and a refit mid-load,
no request lost or hung, every reply well formed."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import openai
import pytest

from tests.server.conftest import PROMPTS


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_openai_completions_with_n_logprobs_and_streaming(client) -> None:
    reply = client.completions.create(
        model="tiny", prompt="hello world", max_tokens=6, n=2, temperature=0.9, seed=5,
        logprobs=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in reply.choices] == [0, 1]
    for choice in reply.choices:
        assert len(choice.logprobs.token_logprobs) == 6
        assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    assert reply.usage.completion_tokens == 12
    greedy = dict(model="tiny", prompt="hello", max_tokens=8, temperature=0.0,
                  extra_body={"ignore_eos": True})  # fmt: skip
    whole = client.completions.create(**greedy).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**greedy, stream=True))
    assert streamed == whole


def test_openai_chat_with_logprobs_and_streaming(client) -> None:
    messages = [{"role": "user", "content": "hello"}]
    options = dict(model="tiny", messages=messages, max_completion_tokens=6, temperature=0.0,
                   extra_body={"ignore_eos": True})  # fmt: skip
    reply = client.chat.completions.create(**options, logprobs=True, top_logprobs=3)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert len(choice.logprobs.content) == 6
    assert all(len(t.top_logprobs) == 3 for t in choice.logprobs.content)
    chunks = list(client.chat.completions.create(**options, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"] and models.data[0].created > 0


def test_openai_errors_are_typed(client) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt="x", max_tokens=10_000)
    assert "maximum context length" in str(caught.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)


def test_32_clients_with_a_sleep_wake_and_a_refit_mid_load(start_server, model_dir) -> None:
    server = start_server(allowed_weight_dirs=(model_dir.parent,))
    num_requests, replies, errors = 96, [], []
    done = threading.Event()

    def one(i: int):
        body = {"prompt": PROMPTS[i % 3], "max_tokens": 16, "temperature": 0.8, "seed": i,
                "ignore_eos": True, "return_token_ids": True, "stream": i % 4 == 0}  # fmt: skip
        if body["stream"]:
            with server.client.stream("POST", "/v1/completions", json=body) as reply:
                if reply.status_code != 200:
                    return reply.status_code, reply.read() and reply.json()
                lines = [x for x in reply.iter_lines() if x.startswith("data: ")]
                return reply.status_code, lines
        reply = server.post("/v1/completions", body)
        return reply.status_code, reply.json()

    def admin() -> None:
        time.sleep(0.3)
        for call in (
            lambda: server.post("/sleep?level=1&mode=keep"),
            lambda: server.post("/wake_up"),
            lambda: server.post("/update_weights_from_disk", {"model_path": str(model_dir)}),
        ):
            reply = call()
            if reply.status_code != 200:
                errors.append(reply.text)
            time.sleep(0.2)
        done.set()

    admin_thread = threading.Thread(target=admin)
    admin_thread.start()
    with ThreadPoolExecutor(32) as pool:
        futures = [pool.submit(one, i) for i in range(num_requests)]
        for future in as_completed(futures, timeout=180):
            replies.append(future.result())
    admin_thread.join(timeout=60)
    assert done.is_set() and errors == []
    assert len(replies) == num_requests  # none hung: as_completed's timeout bounds the wait
    for status, body in replies:
        # a request arriving while asleep is refused (503); none is lost, hung or malformed
        assert status in (200, 503), body
        if status == 503:
            assert body["error"]["type"] == "EngineAsleepError"
        elif isinstance(body, list):
            assert body[-1] == "data: [DONE]" and len(body) > 2
        else:
            assert body["choices"][0]["finish_reason"] == "length"
            assert len(body["choices"][0]["token_ids"]) == 16
    # Which requests meet the sleep depends on timing (a loaded machine puts more of them
    # there); that some are served, whole, is what keeps the test from passing vacuously.
    assert any(status == 200 for status, _ in replies)
