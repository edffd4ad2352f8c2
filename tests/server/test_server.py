"""The server over real HTTP on 127.0.0.1 against a tiny model: answers equal
``AsyncLLM.generate``, streams add up to the whole, the RL cycle over vLLM's and SGLang's
routes, refusals with typed errors, metrics."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from dormant import SamplingParams
from dormant.engine.async_llm import AsyncLLM
from tests.server.conftest import GREEDY, OPTIONS, PROMPTS


@pytest.fixture(scope="module")
def expected(model_dir: Path, other_model_dir: Path) -> dict[str, list[list[int]]]:
    async def tokens(path: Path) -> list[list[int]]:
        engine = AsyncLLM(str(path), **OPTIONS)
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        try:
            outs = [[o async for o in engine.generate(p, params, str(i))][-1]
                    for i, p in enumerate(PROMPTS)]  # fmt: skip
        finally:
            engine.shutdown()
        return [list(o.outputs[0].token_ids) for o in outs]

    return {"a": asyncio.run(tokens(model_dir)), "b": asyncio.run(tokens(other_model_dir))}


def complete(server, prompt: Any, **fields: Any):
    body = {"model": "tiny", "prompt": prompt, "return_token_ids": True, **GREEDY, **fields}
    return server.post("/v1/completions", body)


def token_ids(reply) -> list[list[int]]:
    return [c["token_ids"] for c in reply.json()["choices"]]


def events(server, path: str, body: Any) -> list[Any]:
    with server.client.stream("POST", path, json=body) as reply:
        assert reply.status_code == 200, reply.read()
        assert reply.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
    payloads = [line.removeprefix("data: ") for line in lines]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def test_completions_equal_the_engine_and_are_batched(server, expected) -> None:
    reply = complete(server, PROMPTS)
    assert reply.status_code == 200, reply.text
    assert token_ids(reply) == expected["a"]
    body = reply.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == 36
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda p: complete(server, p), PROMPTS * 4))
    assert [token_ids(r)[0] for r in replies] == expected["a"] * 4


def test_streams_add_up_to_the_whole(server, expected) -> None:
    body = {"prompt": PROMPTS, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}, **GREEDY}  # fmt: skip
    chunks = events(server, "/v1/completions", body)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 36
    streamed: list[list[int]] = [[] for _ in PROMPTS]
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        streamed[choice["index"]] += choice["token_ids"]
    # At least each prompt's first token and the rest (a slow reader gets the newest output).
    assert streamed == expected["a"] and len(chunks) >= 2 * len(PROMPTS) + 1
    text = {"prompt": "hello wörld", **GREEDY, "max_tokens": 24, "temperature": 0.8, "seed": 3}
    whole = server.post("/v1/completions", text).json()["choices"][0]["text"]
    pieces = events(server, "/v1/completions", {**text, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in pieces) == whole


def test_chat_with_n_logprobs_and_streaming(server) -> None:
    messages = [{"role": "user", "content": "hello world"}]
    body = {"messages": messages, "max_completion_tokens": 6, "temperature": 0.7, "seed": 1,
            "n": 2, "logprobs": True, "top_logprobs": 2, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    reply = server.post("/v1/chat/completions", body)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    assert [c["index"] for c in data["choices"]] == [0, 1]
    for choice in data["choices"]:
        content = choice["logprobs"]["content"]
        assert len(content) == len(choice["token_ids"]) == 6
        assert all(len(t["top_logprobs"]) == 2 and t["logprob"] <= 0 for t in content)
    chunks = events(server, "/v1/chat/completions", {**body, "stream": True})
    for index, choice in enumerate(data["choices"]):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"]["content"] for c in mine) == choice["message"]["content"]
        assert [t for c in mine for t in c.get("token_ids") or []] == choice["token_ids"]


def test_rl_cycle_over_vllm_routes(server, expected, model_dir, start_server) -> None:
    assert server.get("/is_sleeping").json() == {"is_sleeping": False}
    assert server.post("/sleep?level=2").status_code == 200
    assert server.get("/is_sleeping").json() == {"is_sleeping": True}
    reply = complete(server, PROMPTS[0])
    assert reply.status_code == 503 and reply.json()["error"]["type"] == "EngineAsleepError"
    assert server.post("/wake_up?tags=weights").status_code == 200
    assert server.post("/collective_rpc", {"method": "reload_weights"}).status_code == 200
    assert server.post("/wake_up?tags=kv_cache").json() == {"is_awake": True}
    assert token_ids(complete(server, PROMPTS)) == expected["a"]
    assert server.post("/sleep?level=1").status_code == 200
    reply = server.post("/sleep?level=2")
    assert reply.status_code == 409 and reply.json()["error"]["type"] == "SleepLevelConflictError"
    assert server.post("/wake_up?tags=nope").status_code == 400
    assert server.post("/wake_up").status_code == 200
    assert server.post("/reset_prefix_cache").json() == {"success": True}


def test_rl_cycle_over_sglang_routes(start_server, expected, model_dir, other_model_dir) -> None:
    server = start_server(allowed_weight_dirs=(model_dir.parent,))
    body = {
        "input_ids": PROMPTS[0],
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
    }
    reply = server.post("/generate", body).json()  # fmt: skip
    assert reply["output_ids"] == expected["a"][0]
    meta = reply["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert [e[1] for e in meta["output_token_logprobs"]] == expected["a"][0]
    assert all(e[0] <= 0 and e[2] is None for e in meta["output_token_logprobs"])
    assert server.post("/flush_cache").status_code == 200
    assert server.post("/pause_generation", {"mode": "abort"}).status_code == 200
    assert server.post("/release_memory_occupation", {}).status_code == 200
    assert server.get("/is_sleeping").json() == {"is_sleeping": True}
    assert server.post("/resume_memory_occupation", {"tags": ["weights"]}).status_code == 200
    refit = {"model_path": str(other_model_dir), "weight_version": "step-1"}
    reply = server.post("/update_weights_from_disk", refit)
    assert reply.status_code == 200, reply.text
    assert server.post("/resume_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
    assert server.post("/continue_generation").status_code == 200
    reply = server.post("/generate", body).json()
    assert reply["output_ids"] == expected["b"][0] != expected["a"][0]
    assert reply["meta_info"]["weight_version"] == "step-1"
    batch = server.post("/generate", {**body, "input_ids": PROMPTS}).json()
    assert [r["output_ids"] for r in batch] == expected["b"]
    assert server.get("/health_generate").status_code == 200


def test_generate_streams_and_takes_text(server) -> None:
    body = {
        "text": "hello",
        "stream": True,
        "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
    }
    chunks = events(server, "/generate", body)  # fmt: skip
    assert len(chunks[-1]["output_ids"]) == 5 and chunks[-1]["meta_info"]["finish_reason"]
    whole = server.post("/generate", {**body, "stream": False}).json()
    assert chunks[-1]["text"] == whole["text"] and chunks[-1]["output_ids"] == whole["output_ids"]


@pytest.mark.parametrize(
    ("fields", "status", "message"),
    [
        ({"temprature": 0.5}, 400, "Extra inputs are not permitted"),
        ({"temperature": -1.0}, 400, "temperature"),
        ({"prompt": []}, 400, "prompt"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"max_tokens": 251}, 400, "maximum context length is 256"),
        ({"prompt": "x" * 300}, 400, "maximum context length"),
        ({"echo": True}, 400, "echo"),
        ({"model": "gpt-4"}, 404, "not served here"),
        ({"prompt": [5, 512]}, 400, "[0, 512)"),
        ({"prompt": [5, 2**63]}, 400, "[0, 512)"),
        ({"stream": "yes"}, 400, "stream"),
    ],
)
def test_bad_requests_get_their_own_typed_error(server, fields, status, message) -> None:
    fields = dict(fields)
    reply = complete(server, fields.pop("prompt", PROMPTS[0]), **fields)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert message in error["message"] and error["code"] == status and error["type"]


def test_utility_routes(server) -> None:
    models = server.get("/v1/models").json()["data"]
    assert models[0]["id"] == "tiny" and models[0]["max_model_len"] == 256
    assert isinstance(models[0]["created"], int)
    ids = server.post("/tokenize", {"prompt": "hello"}).json()
    assert ids["count"] == len(ids["tokens"]) > 0
    assert server.post("/detokenize", {"tokens": ids["tokens"]}).json() == {"prompt": "hello"}
    assert server.get("/version").json()["version"]
    assert server.get("/health").status_code == 200
    info = server.get("/server_info").json()
    assert info["max_model_len"] == 256 and info["auth"]["admin_open"] is True
    assert server.get("/get_server_info").status_code == 200
    assert server.get("/nowhere").json()["error"]["type"] == "NotFoundError"
    assert "/v1/completions" in server.get("/openapi.json").json()["paths"]


def test_metrics_report_sleep_state_bytes_and_transitions(server) -> None:
    complete(server, PROMPTS[0])
    server.post("/sleep?level=1")
    text = server.get("/metrics").text
    assert 'dormant_is_sleeping{model_name="tiny"} 1.0' in text
    assert 'dormant_tag_bytes{location="host",model_name="tiny",tag="weights"}' in text
    assert 'dormant_tag_bytes{location="device",model_name="tiny",tag="weights"} 0.0' in text
    assert 'dormant_transition_seconds_count{kind="sleep",model_name="tiny"} 1.0' in text
    assert 'dormant_generation_tokens_total{model_name="tiny"} 12.0' in text
    assert 'dormant_weight_version_info{model_name="tiny",version="default"} 1.0' in text
    server.post("/wake_up")
    assert 'dormant_is_sleeping{model_name="tiny"} 0.0' in server.get("/metrics").text


def test_update_weights_from_tensor_route(server, expected) -> None:
    """slime's refit: /pause_generation, SGLang's flattened bucket of shared handles (CPU
    shared memory here; CUDA IPC on a GPU), /continue_generation, then /get_weight_version."""
    from dormant.worker.ipc_weights import FLATTENED_BUCKET, flattened_bucket_request
    from tests.engine.conftest import hf_state_dict

    entries, flat = flattened_bucket_request(list(hf_state_dict(2).items()))
    assert server.post("/pause_generation", {}).status_code == 200
    body = {"serialized_named_tensors": entries, "load_format": FLATTENED_BUCKET,
            "weight_version": "step-7"}  # fmt: skip
    reply = server.post("/update_weights_from_tensor", body)
    assert reply.status_code == 200, reply.text
    del flat
    assert server.post("/continue_generation", {}).status_code == 200
    assert token_ids(complete(server, PROMPTS)) == expected["b"]
    assert server.get("/get_weight_version").json() == {"weight_version": "step-7"}


def test_update_weights_from_tensor_with_a_bad_name_is_a_400(server, expected) -> None:
    import torch

    from dormant.worker.ipc_weights import flattened_bucket_request

    entries, _ = flattened_bucket_request([("model.layers.0.mlp.no_such.weight", torch.ones(4))])
    body = {"serialized_named_tensors": entries, "load_format": "flattened_bucket"}
    reply = server.post("/update_weights_from_tensor", body)
    assert reply.status_code == 400, reply.text
    assert token_ids(complete(server, PROMPTS)) == expected["a"]  # nothing was written


def test_idle_sleep_and_auto_wake(start_server) -> None:
    import time

    server = start_server(sleep_idle_ttl_s=0.5, auto_wake=True)
    assert complete(server, PROMPTS[0]).status_code == 200
    for _ in range(100):
        if server.get("/is_sleeping").json()["is_sleeping"]:
            break
        time.sleep(0.05)
    assert server.get("/is_sleeping").json() == {"is_sleeping": True}
    assert complete(server, PROMPTS[0]).status_code == 200  # woke for it
    assert 'dormant_auto_wakes_total{model_name="tiny"} 1.0' in server.get("/metrics").text


def test_without_the_flags_an_idle_server_stays_awake_and_asleep_refuses(server) -> None:
    import time

    time.sleep(1.0)
    assert server.get("/is_sleeping").json() == {"is_sleeping": False}
    server.post("/sleep?level=1")
    assert complete(server, PROMPTS[0]).status_code == 503


def test_update_weights_from_tensor_refuses_what_it_cannot_apply(server) -> None:
    """Schemathesis found a 500 here: no entries, or an entry that is not a payload, is the
    request's own 400, and the engine still serves."""
    for entries in ([], ["not base64 of anything"]):
        reply = server.post("/update_weights_from_tensor", {"serialized_named_tensors": entries})
        assert reply.status_code == 400, reply.text
    assert complete(server, PROMPTS).status_code == 200


def test_an_unknown_query_parameter_is_refused_and_changes_nothing(server) -> None:
    """``/sleep?levle=2`` (a typo) must not sleep at the default level."""
    reply = server.post("/sleep?levle=2")
    assert reply.status_code == 400, reply.text
    assert "levle" in reply.json()["error"]["message"]
    assert server.get("/is_sleeping").json() == {"is_sleeping": False}
    assert server.post("/wake_up?tag=weights").status_code == 400  # the parameter is "tags"
