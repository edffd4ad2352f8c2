"""SGLang's ``GET /v1/loads`` from the engine's scheduler and KV cache, as slime reads it:
``server_control.abort_server_until_idle`` aborts every request, then polls
``/v1/loads?include=core`` until ``num_running_reqs + num_waiting_reqs`` is 0."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tests.server.conftest import PROMPTS
from tests.server.test_sglang_fidelity import slowed

CORE = {
    "dp_rank", "num_running_reqs", "num_waiting_reqs", "num_used_tokens", "max_total_num_tokens",
    "max_running_requests", "token_usage", "cache_hit_rate",
}  # fmt: skip


def core_load(server) -> dict[str, Any]:
    reply = server.get("/v1/loads?include=core")
    assert reply.status_code == 200, reply.text
    (load,) = reply.json()["loads"]
    assert set(load) == CORE
    return load


def test_loads_count_the_sequences_running_and_waiting_until_an_abort(server) -> None:
    blocks = server.engine.engine.scheduler.block_manager
    idle = core_load(server)
    assert idle["num_running_reqs"] == idle["num_waiting_reqs"] == idle["num_used_tokens"] == 0
    assert idle["max_total_num_tokens"] == blocks.num_blocks * blocks.block_size
    assert idle["max_running_requests"] == 8  # the test engine's max_num_seqs
    slowed(server)
    sampling = {"max_new_tokens": 240, "n": 6, "ignore_eos": True}
    body = {"input_ids": PROMPTS[0], "sampling_params": sampling}
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(server.post, "/generate", {**body, "rid": "a"})
        for _ in range(300):
            if core_load(server)["num_running_reqs"] == 6:
                break
            time.sleep(0.01)
        n4 = {**body, "rid": "b", "sampling_params": {**sampling, "n": 4}}
        second = pool.submit(server.post, "/generate", n4)
        for _ in range(300):
            load = core_load(server)
            if load["num_waiting_reqs"] == 4:  # 6 + 4 samples > max_num_seqs: they wait
                break
            time.sleep(0.01)
        assert (load["num_running_reqs"], load["num_waiting_reqs"]) == (6, 4)
        assert load["num_used_tokens"] > 0 and load["num_used_tokens"] % blocks.block_size == 0
        assert load["token_usage"] == round(
            load["num_used_tokens"] / load["max_total_num_tokens"], 4
        )
        assert server.post("/abort_request", {"abort_all": True}).status_code == 200
        load = core_load(server)
        assert load["num_running_reqs"] + load["num_waiting_reqs"] == 0  # slime's idle test
        assert load["num_used_tokens"] == 0
        for reply in (first.result(timeout=10), second.result(timeout=10)):
            assert {o["meta_info"]["finish_reason"]["type"] for o in reply.json()} == {"abort"}


def test_sections_and_how_they_are_asked_for(server) -> None:
    assert server.post("/release_memory_occupation", {}).status_code == 200  # asleep: answers
    reply = server.get("/v1/loads")
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert set(body) == {"timestamp", "version", "loads"}
    (load,) = body["loads"]
    assert set(load) == CORE | {"memory", "disaggregation"}  # no speculative decoding here
    status = server.engine.engine.memory_status()[0]
    weights = status.tag("weights").reserved_bytes
    assert weights > 0 and load["memory"]["weight_gb"] == round(weights / 2**30, 3)
    assert load["memory"]["token_capacity"] == load["max_total_num_tokens"]
    assert load["disaggregation"]["mode"] == "null"
    (load,) = server.get("/v1/loads?include=core,disagg").json()["loads"]
    assert set(load) == CORE | {"disaggregation"}
    assert server.get("/v1/loads?dp_rank=1").json()["loads"] == []  # one data-parallel rank
    for query, word in (("include=core,gpu", "gpu"), ("format=prometheus", "/metrics")):
        reply = server.get(f"/v1/loads?{query}")
        assert reply.status_code == 400 and word in reply.json()["error"]["message"]


def test_the_speculative_section_once_a_draft_was_verified(start_server, model_dir) -> None:
    spec = {"model": str(model_dir), "num_speculative_tokens": 2}  # self-speculation
    server = start_server(engine_options={"speculative_config": spec})
    assert "speculative" not in server.get("/v1/loads?include=spec").json()["loads"][0]
    body = {"input_ids": PROMPTS[2], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    assert server.post("/generate", body).status_code == 200
    (load,) = server.get("/v1/loads?include=spec").json()["loads"]
    stats = server.engine.engine.spec_decode_stats
    assert load["speculative"] == {
        "accept_length": stats.mean_acceptance_length,
        "accept_rate": stats.acceptance_rate,
    }
    assert load["speculative"]["accept_rate"] == 1.0  # every self-draft is accepted
