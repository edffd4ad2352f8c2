"""What one client could send to hold up everyone else, each refused or bounded (a review found
each over real HTTP; these are its regression tests): a batch of thousands of prompts, stop
strings by the hundred thousand, chat messages that escape the character limit, a non-streaming
request whose client left, a browser's cross-site GET, and empty batches or text that no
tokenizer takes."""

from __future__ import annotations

import json
import socket
import time

import pytest

from dormant import SamplingParams
from dormant.engine.async_llm import AsyncLLM
from dormant.engine.request_tracker import RequestTracker, TrackedRequest
from dormant.server.protocol import MAX_NAME_CHARS, MAX_STOP_CHARS, MAX_STOP_STRINGS
from tests.server.conftest import OPTIONS, PROMPTS


def refused(response, *words: str) -> None:
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    for word in words:
        assert word in message, message


def test_a_request_over_the_sequence_limit_is_refused_before_tokenization(start_server) -> None:
    server = start_server(max_sequences_per_request=8)
    calls = []
    tokenizer = server.engine.tokenizer
    encode = tokenizer.encode
    tokenizer.encode = lambda *args: (calls.append(1), encode(*args))[1]
    refused(server.post("/v1/completions", {"prompt": ["a"] * 9}), "9 prompts", "(8,")
    refused(server.post("/v1/completions", {"prompt": ["a"] * 3, "n": 3}), "= 9 sequences")
    generate = {"text": ["a"] * 2, "sampling_params": {"n": 5, "max_new_tokens": 2}}
    refused(server.post("/generate", generate), "= 10 sequences")
    assert calls == []  # nothing was tokenized
    ok = server.post("/v1/completions", {"prompt": [[5]] * 4, "n": 2, "max_tokens": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 8
    limits = server.get("/server_info").json()["limits"]
    assert limits["max_sequences_per_request"] == 8


def test_progress_is_built_only_for_the_requests_that_advanced(model_dir) -> None:
    """A step hands out the outputs of the requests it advanced, not of every request waiting
    for a slot: with thousands waiting, each step built thousands of outputs (quadratic)."""
    engine = AsyncLLM(str(model_dir), **{**OPTIONS, "max_num_seqs": 2}).engine
    try:
        tracker, heard = RequestTracker(engine), []
        built = []
        request_output = engine.request_output
        engine.request_output = lambda i: (built.append(i), request_output(i))[1]  # type: ignore[method-assign]
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        for i in range(12):
            tracker.add((PROMPTS[0], params), TrackedRequest(str(i), heard.append, True))
        num_steps = 0
        while engine.has_unfinished_requests():
            built.clear()
            tracker.deliver(engine.step())
            tracker.send_progress()
            num_steps += 1
            assert len(built) <= 2, built  # at most the two running, never the ten waiting
        assert num_steps >= 12 and len(heard) >= 12  # every request was heard
    finally:
        engine.shutdown()


def test_stop_strings_are_bounded_in_number_and_length(server) -> None:
    many = {"prompt": [5], "max_tokens": 2, "stop": ["x"] * (MAX_STOP_STRINGS + 1)}
    refused(server.post("/v1/completions", many), "stop")
    long = {"prompt": [5], "max_tokens": 2, "stop": "x" * (MAX_STOP_CHARS + 1)}
    refused(server.post("/v1/completions", long), "stop")
    sglang = {"input_ids": [5], "sampling_params": {"stop": ["x"] * (MAX_STOP_STRINGS + 1)}}
    refused(server.post("/generate", sglang), "stop")
    fine = {"prompt": [5], "max_tokens": 2, "stop": ["x"] * MAX_STOP_STRINGS}
    assert server.post("/v1/completions", fine).status_code == 200


def test_chat_messages_count_and_names_are_bounded(start_server) -> None:
    server = start_server(max_prompt_chars=100)
    message = {"role": "user", "content": ""}
    refused(server.post("/v1/chat/completions", {"messages": [message] * 256}), "256 messages")
    named = [{"role": "user", "content": "hi", "name": "n" * 120}]
    refused(server.post("/v1/chat/completions", {"messages": named}), "characters")
    too_long = [{"role": "user", "content": "hi", "name": "n" * (MAX_NAME_CHARS + 1)}]
    refused(server.post("/v1/chat/completions", {"messages": too_long}), "name")


def test_a_non_streaming_request_whose_client_left_is_aborted(server) -> None:
    engine = server.engine.engine
    step = engine.step
    engine.step = lambda: (time.sleep(0.02), step())[1]  # 240 steps: over 4.8 s
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 240, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.thread.port)) as connection:
        connection.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        for _ in range(200):
            if server.engine.num_requests:
                break
            time.sleep(0.01)
        assert server.engine.num_requests == 1
    for _ in range(150):  # 3 s: well before its 240 steps end
        if server.engine.num_requests == 0:
            break
        time.sleep(0.02)
    assert server.engine.num_requests == 0
    assert server.post("/v1/completions", {"prompt": [5], "max_tokens": 2}).status_code == 200


def test_a_browsers_cross_site_get_is_refused(server) -> None:
    for site in ("cross-site", "same-site"):
        response = server.get("/flush_cache", headers={"Sec-Fetch-Site": site})
        assert response.status_code == 403 and "Sec-Fetch-Site" in response.text
    assert server.get("/flush_cache", headers={"Sec-Fetch-Site": "none"}).status_code == 200
    assert server.get("/flush_cache").status_code == 200  # a program sends no such header


@pytest.mark.parametrize(
    "route, body",
    [
        ("/generate", {"text": []}),
        ("/generate", {"input_ids": []}),
        ("/v1/completions", {"prompt": []}),
        ("/generate", {"text": "hi", "rid": "\ud800"}),
        ("/generate", {"text": "\ud800"}),
        ("/v1/completions", {"prompt": ["ok", "\ud800"]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}),
    ],
)
def test_empty_batches_and_lone_surrogates_are_validation_errors(server, route, body) -> None:
    """Refused as invalid requests, before anything is generated (an empty batch answered
    "max() arg is an empty sequence"; a lone surrogate in ``rid`` failed after generating)."""
    response = server.post(
        route, content=json.dumps(body), headers={"content-type": "application/json"}
    )
    refused(response, "invalid request")
    assert server.engine.num_requests == 0


def test_a_slow_streaming_client_holds_each_streams_newest_output_only() -> None:
    """Regression: ``Serving.merged`` queued every step's cumulative output of every stream
    for a client that did not read (memory growing with the square of the length). Now an
    unread output is replaced by its stream's newer one, and the order of the streams' ends,
    the finished outputs and an error are kept."""
    import asyncio
    import contextlib
    from types import SimpleNamespace

    from dormant.engine.outputs import CompletionOutput, RequestOutput
    from dormant.server.serving import Serving

    def output(num_tokens: int, finished: bool) -> RequestOutput:
        completion = CompletionOutput(index=0, text="", token_ids=list(range(num_tokens)),
                                      cumulative_logprob=None, logprobs=None)  # fmt: skip
        return RequestOutput("r", None, [1], None, [completion], finished)

    async def stream(num_steps: int):
        for step in range(2, num_steps + 1):
            await asyncio.sleep(0)  # a step
            yield output(step, step == num_steps)

    counted: list[RequestOutput] = []
    metrics = SimpleNamespace(track_request=lambda serving: contextlib.nullcontext(),
                              count_outputs=counted.extend)  # fmt: skip
    host = SimpleNamespace(metrics=metrics)

    async def run() -> list[tuple[int, int, bool]]:
        started = [(output(1, False), stream(50)), (output(1, False), stream(30))]
        merged = Serving.merged(host, started)  # type: ignore[arg-type]
        seen = [await anext(merged)]
        for _ in range(200):  # the client reads nothing while both streams run out
            await asyncio.sleep(0)
        seen += [item async for item in merged]
        return [(index, len(o.outputs[0].token_ids), o.finished) for index, o in seen]

    seen = asyncio.run(run())  # 80 outputs before the fix
    assert len(seen) <= 4 and sorted(o for o in seen if o[2]) == [(0, 50, True), (1, 30, True)]
    assert len(counted) == 2
