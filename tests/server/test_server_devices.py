"""The server over other engines: a TP=2 engine on the CPU (gloo worker processes driven by
the loop thread) and, on a GPU machine, CUDA; answers equal TP=1 on the CPU, streaming, and
the RL cycle with a refit from disk."""

from __future__ import annotations

import pytest

from tests.server.conftest import GREEDY, PROMPTS

ENGINES = [
    pytest.param({"tensor_parallel_size": 2}, id="cpu-tp2"),
    pytest.param({"device": "cuda", "enforce_eager": True}, id="cuda", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("engine_options", ENGINES)
def test_server_over_other_engines_equals_tp1_through_an_rl_cycle(
    start_server, model_dir, other_model_dir, engine_options
) -> None:
    body = {"prompt": PROMPTS, "return_token_ids": True, **GREEDY}
    reference = start_server(allowed_weight_dirs=(model_dir.parent,))
    expected = [c["token_ids"] for c in reference.post("/v1/completions", body).json()["choices"]]
    reference.post("/update_weights_from_disk", {"model_path": str(other_model_dir)})
    expected_b = [c["token_ids"] for c in reference.post("/v1/completions", body).json()["choices"]]
    reference.close()
    server = start_server(allowed_weight_dirs=(model_dir.parent,), engine_options=engine_options)
    reply = server.post("/v1/completions", body)
    assert reply.status_code == 200, reply.text
    assert [c["token_ids"] for c in reply.json()["choices"]] == expected
    with server.client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
    assert len(chunks) > len(PROMPTS)
    assert server.post("/sleep?level=2").status_code == 200
    assert server.post("/wake_up?tags=weights").status_code == 200
    refit = server.post("/update_weights_from_disk", {"model_path": str(other_model_dir)})
    assert refit.status_code == 200, refit.text
    assert server.post("/wake_up?tags=kv_cache").status_code == 200
    reply = server.post("/v1/completions", body)
    assert [c["token_ids"] for c in reply.json()["choices"]] == expected_b != expected
    health = server.post("/collective_rpc", {"method": "check_health"}).json()["results"]
    assert health == [True] * engine_options.get("tensor_parallel_size", 1)
