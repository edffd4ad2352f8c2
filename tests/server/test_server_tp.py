"""The server over a TP=2 engine on the CPU (gloo): the engine loop drives the worker
processes from its own thread; answers equal TP=1, and the RL cycle works over HTTP."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from dormant import LLM, SamplingParams
from dormant.server import DormantServer
from tests.engine.conftest import PROMPTS
from tests.server.test_server import GREEDY, call, complete, events

OPTIONS = dict(device="cpu", max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=4 << 20)


@pytest.fixture(scope="module")
def expected(checkpoint: Path, other_checkpoint: Path) -> dict[str, list[tuple[int, ...]]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    result = {}
    for name, path in zip("ab", (checkpoint, other_checkpoint), strict=True):
        with LLM(str(path), **OPTIONS) as llm:
            result[name] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    return result


@pytest.fixture
def server(checkpoint: Path, expected) -> Iterator[DormantServer]:
    llm = LLM(str(checkpoint), tensor_parallel_size=2, **OPTIONS)
    server = DormantServer(("127.0.0.1", 0), llm, "tp2")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()
    llm.shutdown()


def test_tp2_server_equals_tp1_through_an_rl_cycle(server, expected, other_checkpoint) -> None:
    def token_ids(reply) -> list[tuple[int, ...]]:
        return [tuple(c["token_ids"]) for c in reply["choices"]]

    status, reply = complete(server, PROMPTS)
    assert status == 200 and token_ids(reply) == expected["a"]
    chunks = events(server, "/v1/completions", {"prompt": PROMPTS[0], "stream": True,
                                                "return_token_ids": True, **GREEDY})  # fmt: skip
    assert tuple(t for c in chunks for t in c["choices"][0]["token_ids"]) == expected["a"][0]
    assert call(server, "POST", "/sleep?level=2")[0] == 200
    assert call(server, "POST", "/wake_up?tags=weights")[0] == 200
    body = {"model_path": str(other_checkpoint)}  # the "trainer" produced new weights
    assert call(server, "POST", "/update_weights_from_disk", body)[0] == 200
    assert call(server, "POST", "/wake_up?tags=kv_cache")[0] == 200
    status, reply = complete(server, PROMPTS)
    assert status == 200 and token_ids(reply) == expected["b"] != expected["a"]
    status, reply = call(server, "POST", "/collective_rpc", {"method": "check_health"})
    assert status == 200 and reply["results"] == [True, True]
