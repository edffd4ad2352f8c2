"""vLLM's weight-transfer routes (its server's development mode, which TRL's ``VLLMClient`` and
other trainers drive) on the CPU: a trainer process pushes new weights with vLLM's trainer
helpers while the routes receive them, and the server then generates the new weights' tokens.
``/server_info``'s ``vllm_config`` says whether transfer is configured (TRL checks it first)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.engine.vllm_trainer import SMALL_BUFFER, init_info, start_trainer, update_info
from tests.server.conftest import GREEDY, PROMPTS

CONFIG = {"weight_transfer_config": {"backend": "nccl"}}


def _tokens(server) -> list[list[int]]:
    body = {"prompt": PROMPTS, **GREEDY, "return_token_ids": True}
    return [c["token_ids"] for c in server.post("/v1/completions", body).json()["choices"]]


def test_a_trainer_pushes_weights_through_the_routes(start_server, other_model_dir: Path) -> None:
    expected = _tokens(start_server(other_model_dir))
    server = start_server(engine_options=CONFIG)
    assert server.get("/get_world_size").json() == {"world_size": 1}
    assert server.get("/get_world_size", params={"include_dp": "false"}).json()["world_size"] == 1
    info = server.get("/server_info", params={"config_format": "json"}).json()
    assert info["vllm_config"]["weight_transfer_config"] == {"backend": "nccl"}
    before = _tokens(server)
    port, trainer, process = start_trainer([(2, "packed")])  # other_model_dir's weights
    try:
        body = {"init_info": init_info(port, packed=True, packed_buffer_size_bytes=SMALL_BUFFER)}
        reply = server.post("/init_weight_transfer_engine", body)
        assert reply.status_code == 200, reply.text
        assert trainer.recv() == "joined"
        assert server.post("/start_weight_update", {}).status_code == 200
        metadata = trainer.recv()
        trainer.send("go")
        reply = server.post("/update_weights", {"update_info": update_info(metadata)})
        assert reply.status_code == 200, reply.text
        reply = server.post("/finish_weight_update", {"weight_version": "step-1"})
        assert reply.status_code == 200, reply.text
        # an update that does not say what arrives: refused, and the group destroyed
        reply = server.post("/update_weights", {"update_info": {"names": []}})
        assert reply.status_code == 400 and "missing" in reply.text and "destroyed" in reply.text
        reply = server.post("/start_weight_update", {})
        assert reply.status_code == 400 and "init_weight_transfer_engine" in reply.text
        trainer.send("done")
    finally:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
    assert process.exitcode == 0
    assert _tokens(server) == expected != before
    assert server.get("/get_weight_version").json() == {"weight_version": "step-1"}
    assert server.get("/is_paused").json() == {"is_paused": False}


def test_calls_out_of_order_get_a_400_that_says_what_to_do(start_server) -> None:
    plain = start_server()
    info = plain.get("/server_info", params={"config_format": "json"}).json()
    assert info["vllm_config"]["weight_transfer_config"] is None
    reply = plain.post("/init_weight_transfer_engine", {"init_info": init_info(1)})
    assert reply.status_code == 400 and "weight_transfer_config" in reply.text
    server = start_server(engine_options=CONFIG)
    update: dict[str, Any] = {"update_info": {"names": [], "dtype_names": [], "shapes": []}}
    for path, body in (("/start_weight_update", {}), ("/update_weights", update)):
        reply = server.post(path, body)
        assert reply.status_code == 400 and "init_weight_transfer_engine" in reply.text
    assert server.post("/finish_weight_update").status_code == 400  # no body: vLLM's form
    assert _tokens(server) == _tokens(plain)  # nothing changed


def test_weight_transfer_routes_are_admin_routes(start_server) -> None:
    server = start_server(admin_token="secret", engine_options=CONFIG)
    reply = server.post("/init_weight_transfer_engine", {"init_info": init_info(1)})
    assert reply.status_code == 401
    assert server.get("/get_world_size").status_code == 200  # read-only: no token needed
