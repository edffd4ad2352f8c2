"""SGLang's routes as the RL frameworks call them (slime's ``sglang_engine.py``,
``sglang_rollout.py``, ``server_control.py``, ``on_policy_distillation.py``; verl's
``http_server_engine.py``): the request forms they send and the fields they read back."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.server.conftest import PROMPTS

GREEDY = {"temperature": 0, "ignore_eos": True}


def slowed(server) -> None:
    """Each engine step takes 20 ms, so a long request is still running when it is aborted."""
    engine = server.engine.engine
    step = engine.step
    engine.step = lambda: (time.sleep(0.02), step())[1]


def wait_running(server, num_requests: int) -> None:
    for _ in range(300):
        if server.engine.num_requests == num_requests:
            return
        time.sleep(0.01)
    raise AssertionError(f"{server.engine.num_requests} requests running, not {num_requests}")


def long_generate(server, **fields: Any):
    body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 240, **GREEDY}}
    return server.post("/generate", {**body, **fields})


@pytest.mark.parametrize("abort", [{"rid": "rollout-7"}, {"abort_all": True}])
def test_abort_request_ends_running_generations_with_finish_reason_abort(server, abort) -> None:
    # slime's rollout ends with /abort_request {"abort_all": true} (server_control.py); its agent
    # adapters abort one turn by {"rid": rid}. SGLang answers 200 with an empty body, and the
    # aborted /generate answers 200 with what it generated and finish_reason type "abort".
    slowed(server)
    with ThreadPoolExecutor(2) as pool:
        mine = pool.submit(long_generate, server, rid="rollout-7", input_ids=PROMPTS[:2])
        other = pool.submit(long_generate, server, rid="rollout-70")
        wait_running(server, 3)
        reply = server.post("/abort_request", abort)
        assert reply.status_code == 200, reply.text
        for output in mine.result(timeout=4).json():
            assert output["meta_info"]["finish_reason"]["type"] == "abort"
            assert len(output["output_ids"]) < 240
        if "rid" in abort:  # another call's rid, even one the rid prefixes, runs on
            assert server.engine.num_requests == 1
            server.post("/abort_request", {"rid": "rollout-70"})
        assert other.result(timeout=4).json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert server.post("/abort_request", {"rid": "gone"}).status_code == 200  # finished: a no-op
    reply = server.post("/abort_request", {})
    assert reply.status_code == 400 and "abort_all" in reply.json()["error"]["message"]


def test_a_rid_already_running_is_refused_and_the_first_request_stays_abortable(server) -> None:
    slowed(server)
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(long_generate, server, rid="dup")
        wait_running(server, 1)
        reply = long_generate(server, rid="dup")
        assert reply.status_code == 400 and "dup" in reply.json()["error"]["message"]
        assert server.post("/abort_request", {"rid": "dup"}).status_code == 200
        assert first.result(timeout=4).json()["meta_info"]["finish_reason"]["type"] == "abort"


def test_max_new_tokens_zero_scores_the_prompt(server) -> None:
    # slime's on-policy distillation asks the teacher for the prompt's logprobs this way, and
    # reads meta_info.input_token_logprobs[1:].
    body = {
        "input_ids": PROMPTS[0],
        "sampling_params": {"temperature": 0, "max_new_tokens": 0, "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    reply = server.post("/generate", body)
    assert reply.status_code == 200, reply.text
    output = reply.json()
    meta = output["meta_info"]
    assert output["output_ids"] == [] and output["text"] == ""
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["completion_tokens"] == 0 and meta["output_token_logprobs"] == []
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == PROMPTS[0] and entries[0][0] is None
    assert all(e[0] <= 0 for e in entries[1:])
    one_token = {"max_new_tokens": 1, "temperature": 0}
    scored = server.post("/generate", {**body, "sampling_params": one_token}).json()
    assert scored["meta_info"]["input_token_logprobs"] == entries


def test_null_logprob_fields_mean_sglangs_defaults(server) -> None:
    body = {
        "input_ids": PROMPTS[1],
        "sampling_params": {"max_new_tokens": 3, **GREEDY},
        "return_logprob": None,
        "logprob_start_len": None,
        "top_logprobs_num": None,
    }
    reply = server.post("/generate", body)
    assert reply.status_code == 200, reply.text
    assert "output_token_logprobs" not in reply.json()["meta_info"]
    reply = server.post("/generate", {**body, "return_logprob": True})
    meta = reply.json()["meta_info"]
    assert len(meta["output_token_logprobs"]) == 3
    assert "output_top_logprobs" not in meta  # SGLang sends it only with top_logprobs_num > 0
    reply = server.post("/generate", {**body, "return_logprob": True, "top_logprobs_num": 2})
    assert [len(top) for top in reply.json()["meta_info"]["output_top_logprobs"]] == [2] * 3


def test_update_weight_version_relabels_the_weights(server) -> None:
    reply = server.post("/update_weight_version", {"new_version": "step-3"})
    assert reply.status_code == 200, reply.text
    assert reply.json() == {
        "success": True,
        "message": "Weight version updated to step-3",
        "new_version": "step-3",
    }
    assert server.get("/get_weight_version").json() == {"weight_version": "step-3"}
    body = {"input_ids": PROMPTS[1], "sampling_params": {"max_new_tokens": 2, **GREEDY}}
    assert server.post("/generate", body).json()["meta_info"]["weight_version"] == "step-3"
    reply = server.post("/update_weight_version", {"version": "x"})
    assert reply.status_code == 400
    assert server.get("/get_weight_version").json() == {"weight_version": "step-3"}


def test_get_model_info(server) -> None:
    """SGLang's ``/model_info`` (its router reads ``architectures``) and the older name."""
    info = server.get("/get_model_info").json()
    assert info["is_generation"] is True and info["model_path"] == "tiny"
    assert info["weight_version"] == server.get("/get_weight_version").json()["weight_version"]
    assert server.get("/model_info").json() == info
    assert info["architectures"] == ["Qwen3ForCausalLM"]


def test_custom_params_are_refused_with_what_to_do(server) -> None:
    """slime sends ``custom_params: {"return_top_p_token_ids": true}`` whenever top_p < 1 (its
    top-p replay, a patched SGLang's): a 400 that names it and says what to send, not pydantic's
    generic "extra inputs are not permitted"; an empty one is SGLang's default."""
    sampling = {"max_new_tokens": 2, **GREEDY}
    body = {"input_ids": PROMPTS[1], "sampling_params": sampling}
    reply = server.post("/generate", {**body, "sampling_params": {**sampling, "custom_params": {}}})
    assert reply.status_code == 200, reply.text
    custom = {"custom_params": {"return_top_p_token_ids": True}}
    reply = server.post("/generate", {**body, "sampling_params": {**sampling, **custom}})
    assert reply.status_code == 400
    assert "return_top_p_token_ids" in reply.text and "rollout-top-p 1.0" in reply.text


def test_max_new_tokens_beyond_the_context_is_capped_not_refused(server) -> None:
    """SGLang caps ``max_new_tokens`` at the room beside the prompt
    (``Scheduler.init_req_max_new_tokens``): slime asks for its whole response budget whatever
    the prompt's length, and gets a "length" finish where the context ends."""
    sampling = {"max_new_tokens": 1000, "min_new_tokens": 300, **GREEDY}
    body = {"input_ids": [PROMPTS[0], PROMPTS[2]], "sampling_params": sampling}
    reply = server.post("/generate", body)
    assert reply.status_code == 200, reply.text
    for output, prompt in zip(reply.json(), (PROMPTS[0], PROMPTS[2]), strict=True):
        room = 256 - len(prompt)  # each prompt its own room in the 256-token context
        assert output["meta_info"]["completion_tokens"] == len(output["output_ids"]) == room
        assert output["meta_info"]["finish_reason"] == {"type": "length", "length": room}
    # The values asked for are still checked against each other, as SGLang's verify() does.
    body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 3, "min_new_tokens": 5}}
    reply = server.post("/generate", body)
    assert reply.status_code == 400 and "min_new_tokens" in reply.json()["error"]["message"]
