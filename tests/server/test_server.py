"""The OpenAI-compatible server on the CPU: real HTTP against a tiny model, compared with
``LLM.generate``; the sleep endpoints; concurrent requests; and the refusals."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from dormant import LLM, SamplingParams
from dormant.server import DormantServer
from tests.engine.conftest import PROMPTS, write_checkpoint

OPTIONS = dict(max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=4 << 20)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
GREEDY = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module", params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def expected(checkpoint: Path, device: str) -> list[tuple[int, ...]]:
    with LLM(str(checkpoint), device=device, **OPTIONS) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@pytest.fixture
def server(checkpoint: Path, device: str, expected) -> Iterator[DormantServer]:
    llm = LLM(str(checkpoint), device=device, **OPTIONS)
    server = DormantServer(("127.0.0.1", 0), llm, "tiny")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    llm.shutdown()


def call(server: DormantServer, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    host, port = server.server_address[:2]
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://{host}:{port}{path}", data=data, method=method)
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def complete(server: DormantServer, prompt: Any, **fields: Any) -> tuple[int, Any]:
    body = {"model": "tiny", "prompt": prompt, "return_token_ids": True, **GREEDY, **fields}
    return call(server, "POST", "/v1/completions", body)


def test_completions_equal_generate(server, expected) -> None:
    status, reply = complete(server, PROMPTS)  # a batch of token-id prompts
    assert status == 200, reply
    assert [tuple(c["token_ids"]) for c in reply["choices"]] == expected
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == 12 * len(PROMPTS)
    assert reply["usage"]["prompt_tokens"] == sum(map(len, PROMPTS))
    status, reply = complete(server, "hello")  # text, through the (byte) tokenizer
    assert status == 200 and isinstance(reply["choices"][0]["text"], str)
    assert reply["choices"][0]["prompt_token_ids"] == list(b"hello")


def test_concurrent_requests_are_batched_and_each_gets_its_own(server, expected) -> None:
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda p: complete(server, p), PROMPTS * 4))
    assert all(status == 200 for status, _ in replies)
    got = [tuple(reply["choices"][0]["token_ids"]) for _, reply in replies]
    assert got == expected * 4


def test_rl_cycle_over_http(server, expected, checkpoint) -> None:
    assert call(server, "GET", "/is_sleeping") == (200, {"is_sleeping": False})
    assert call(server, "POST", "/sleep?level=2")[0] == 200
    assert call(server, "GET", "/is_sleeping") == (200, {"is_sleeping": True})
    status, reply = complete(server, PROMPTS[0])
    assert status == 503 and reply["error"]["type"] == "EngineAsleepError"
    assert call(server, "POST", "/wake_up?tags=weights")[0] == 200
    status, reply = complete(server, PROMPTS[0])
    assert status == 503 and "kv_cache" in reply["error"]["message"]  # still asleep
    assert call(server, "POST", "/wake_up?tags=kv_cache")[0] == 200
    status, reply = complete(server, PROMPTS[0])  # weights discarded and not refit yet
    assert status == 503 and reply["error"]["type"] == "WeightsNotLoadedError"
    body = {"model_path": str(checkpoint)}
    assert call(server, "POST", "/update_weights_from_disk", body) == (200, {"success": True})
    status, reply = complete(server, PROMPTS)
    assert status == 200 and [tuple(c["token_ids"]) for c in reply["choices"]] == expected
    status, reply = call(server, "POST", "/sleep?level=1")
    assert status == 200
    status, reply = call(server, "POST", "/sleep?level=2")  # asleep at another level
    assert status == 409 and reply["error"]["type"] == "SleepLevelConflictError"
    assert call(server, "POST", "/wake_up?tags=no_such_tag")[0] == 400
    assert call(server, "POST", "/resume_memory_occupation", {})[0] == 200
    assert call(server, "GET", "/is_sleeping") == (200, {"is_sleeping": False})


def test_a_sleep_answers_the_requests_it_aborts(server) -> None:
    engine = server.llm.llm_engine
    with ThreadPoolExecutor(1) as pool:
        sampled = {"max_tokens": 240, "temperature": 1.0, "seed": 0}  # one step per replay
        running = pool.submit(complete, server, PROMPTS[0], **sampled)
        while not server.loop.call(engine.has_unfinished_requests):
            pass
        assert call(server, "POST", "/sleep?level=1&mode=abort")[0] == 200
        status, reply = running.result(timeout=60)
    assert status == 200 and reply["choices"][0]["finish_reason"] == "abort"
    assert len(reply["choices"][0]["token_ids"]) < 240
    assert call(server, "POST", "/wake_up")[0] == 200


def test_collective_rpc_and_sglang_names(server) -> None:
    status, reply = call(server, "POST", "/collective_rpc", {"method": "memory_status"})
    assert status == 200 and reply["results"][0]["tags"]
    status, reply = call(server, "POST", "/collective_rpc", {"method": "sleep", "args": [1]})
    assert status == 200 and call(server, "GET", "/is_sleeping")[1] == {"is_sleeping": True}
    assert call(server, "POST", "/collective_rpc", {"method": "wake_up"})[0] == 200
    assert call(server, "GET", "/is_sleeping")[1] == {"is_sleeping": False}
    status, reply = call(server, "POST", "/collective_rpc", {"method": "update_weights"})
    assert status == 400 and "update_weights_from_disk" in reply["error"]["message"]
    assert call(server, "POST", "/release_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
    assert call(server, "POST", "/resume_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
    assert call(server, "GET", "/health") == (200, {})
    status, reply = call(server, "GET", "/v1/models")
    assert reply["data"][0]["id"] == "tiny" and reply["data"][0]["max_model_len"] == 256


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"n": 2}, "n=2 is not supported"),
        ({"stream": "yes"}, "stream must be a bool"),
        ({"stream_options": {"include_usage": True}}, "only allowed with stream=true"),
        ({"temprature": 0.5}, "unknown field"),
        ({"temperature": -1.0}, "temperature must be >= 0"),
        ({"prompt": []}, "prompt must be"),
        ({"max_tokens": 0}, "max_tokens must be"),
        ({"prompt": "x" * 300}, "max_model_len"),
    ],
)
def test_bad_requests_are_refused_with_400(server, fields, message) -> None:
    fields = dict(fields)  # parametrize shares the dict between the devices
    status, reply = complete(server, fields.pop("prompt", PROMPTS[0]), **fields)
    assert status == 400, reply
    assert message in reply["error"]["message"]


def events(server: DormantServer, path: str, body: Any) -> list[Any]:
    """The JSON events of a server-sent-event reply, up to ``data: [DONE]``."""
    host, port = server.server_address[:2]
    request = urllib.request.Request(
        f"http://{host}:{port}{path}", data=json.dumps(body).encode(), method="POST"
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        assert reply.headers["Content-Type"] == "text/event-stream"
        lines = [line.decode().strip() for line in reply]
    payloads = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def test_streamed_completions_add_up_to_the_whole(server, expected) -> None:
    body = {"prompt": PROMPTS, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}, **GREEDY}  # fmt: skip
    chunks = events(server, "/v1/completions", body)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 36
    streamed = [[] for _ in PROMPTS]
    reasons = [None] * len(PROMPTS)
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        assert reasons[choice["index"]] is None  # nothing after a choice's last chunk
        streamed[choice["index"]] += choice["token_ids"]
        reasons[choice["index"]] = choice["finish_reason"]
    assert [tuple(t) for t in streamed] == expected and reasons == ["length"] * 3
    assert len(chunks) > 2 * len(PROMPTS)  # it did stream: more than one chunk per choice
    status, whole = complete(server, "hello")
    pieces = events(server, "/v1/completions", {"prompt": "hello", "stream": True, **GREEDY})
    assert (
        status == 200
        and "".join(c["choices"][0]["text"] for c in pieces) == whole["choices"][0]["text"]
    )


def test_a_client_that_goes_away_aborts_its_stream(server, monkeypatch) -> None:
    import http.client

    finals: list[Any] = []
    deliver = server.loop._deliver
    monkeypatch.setattr(server.loop, "_deliver", lambda outputs: (finals.extend(outputs),
                                                                  deliver(outputs)))  # fmt: skip
    engine = server.llm.llm_engine
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: (time.sleep(0.005), step())[1])  # 240 steps: >1 s
    host, port = server.server_address[:2]
    connection = http.client.HTTPConnection(host, port, timeout=60)
    body = {"prompt": PROMPTS[0], "stream": True, "max_tokens": 240, "temperature": 1.0,
            "ignore_eos": True}  # fmt: skip
    connection.request("POST", "/v1/completions", json.dumps(body))
    reply = connection.getresponse()
    assert reply.readline().startswith(b"data: ")  # streaming has started
    reply.close()  # and the client leaves
    connection.close()
    while server.loop.call(engine.has_unfinished_requests):
        threading.Event().wait(0.01)
    (final,) = finals
    assert final.outputs[0].finish_reason == "abort" and len(final.outputs[0].token_ids) < 240


def test_a_stream_refused_while_asleep_is_a_plain_error(server) -> None:
    assert call(server, "POST", "/sleep?level=1")[0] == 200
    status, reply = complete(server, PROMPTS[0], stream=True)
    assert status == 503 and reply["error"]["type"] == "EngineAsleepError"
    assert call(server, "POST", "/wake_up")[0] == 200


def test_chat_needs_a_chat_template(server) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    status, reply = call(server, "POST", "/v1/chat/completions", body)
    assert status == 400 and "chat template" in reply["error"]["message"]
    assert call(server, "GET", "/nowhere")[0] == 404


def write_chat_tokenizer(path: Path) -> list[int]:
    """A word-level tokenizer with a chat template; returns the ids of the test chat's prompt."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "<eos>", "user", "assistant", ":", "hi", "there", "how", "are", "you"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, "[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", eos_token="<eos>")
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant :{% endif %}"
    )
    fast.save_pretrained(str(path))
    return [2, 4, 5, 6, 7, 8, 9, 3, 4]  # user : hi there how are you assistant :


def test_chat_completions_use_the_chat_template(tmp_path: Path) -> None:
    checkpoint = write_checkpoint(tmp_path / "chat", seed=1)
    prompt_ids = write_chat_tokenizer(checkpoint)
    llm = LLM(str(checkpoint), device="cpu", **OPTIONS)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = llm.generate([prompt_ids], params)[0].outputs[0]
    server = DormantServer(("127.0.0.1", 0), llm, "chat")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        messages = [{"role": "user", "content": "hi there how are you"}]
        body = {"messages": messages, "max_completion_tokens": 6, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        status, reply = call(server, "POST", "/v1/chat/completions", body)
        streamed_chat = events(server, "/v1/chat/completions", {**body, "stream": True})
    finally:
        server.shutdown()
        server.server_close()
        llm.shutdown()
    assert status == 200, reply
    assert reply["prompt_token_ids"] == prompt_ids
    choice = reply["choices"][0]
    assert tuple(choice["token_ids"]) == expected.token_ids
    assert choice["message"] == {"role": "assistant", "content": expected.text}
    assert reply["object"] == "chat.completion" and reply["usage"]["completion_tokens"] == 6
    assert streamed_chat[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(c["choices"][0]["delta"]["content"] for c in streamed_chat)
    assert content == expected.text
    assert streamed_chat[-1]["choices"][0]["finish_reason"] == "length"
    assert {c["object"] for c in streamed_chat} == {"chat.completion.chunk"}


@pytest.mark.parametrize("stop_signal", ["SIGINT", "SIGTERM"])
def test_dormant_serve_command(checkpoint: Path, stop_signal: str) -> None:
    """``dormant serve`` end to end: it prints its address, answers, and stops cleanly on
    Ctrl-C and on SIGTERM."""
    import re
    import signal
    import subprocess
    import sys

    options = ["--port", "0", "--device", "cpu", "--max-model-len", "128"]
    command = [sys.executable, "-m", "dormant.cli", "serve", str(checkpoint), *options]
    command += ["--served-model-name", "cli"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        match = re.search(r"http://([\d.]+):(\d+)/v1", line)
        assert match, line + (process.stderr.read() if process.poll() is not None else "")
        url = f"http://{match[1]}:{match[2]}"
        with urllib.request.urlopen(f"{url}/v1/models", timeout=60) as reply:
            card = json.loads(reply.read())["data"][0]
        assert card["id"] == "cli" and card["max_model_len"] == 128
        body = json.dumps({"prompt": PROMPTS[0], **GREEDY}).encode()
        request = urllib.request.Request(f"{url}/v1/completions", data=body, method="POST")
        with urllib.request.urlopen(request, timeout=60) as reply:
            assert json.loads(reply.read())["usage"]["completion_tokens"] == 12
    finally:
        process.send_signal(getattr(signal, stop_signal))
        assert process.wait(timeout=60) == 0
