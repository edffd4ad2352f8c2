"""Each attack the old ``http.server`` server fell to, over real HTTP on 127.0.0.1 (or, for a
non-loopback bind, through the ASGI app in-process): the server answers the attacker alone,
and everyone else's requests carry on."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from dormant import SamplingParams
from dormant.engine.async_llm import AsyncLLM
from dormant.server import ServerSettings, build_app
from tests.server.conftest import GREEDY, OPTIONS, PROMPTS

GREEDY_GENERATE = {
    "input_ids": PROMPTS[0],
    "sampling_params": {"temperature": 0, "max_new_tokens": 8},
}
PROMPTS_8 = [[5 + i, 17, 99, 3 * i + 1, 250, 42][: 3 + i % 4] for i in range(8)]


def undisturbed(model_dir: Path, prompts, max_tokens: int) -> list[list[int]]:
    async def run():
        engine = AsyncLLM(str(model_dir), **OPTIONS)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        try:
            outs = [[o async for o in engine.generate(p, params, str(i))][-1]
                    for i, p in enumerate(prompts)]  # fmt: skip
        finally:
            engine.shutdown()
        return [list(o.outputs[0].token_ids) for o in outs]

    return asyncio.run(run())


def slow_down(server, seconds: float = 0.01) -> None:
    """Each engine step takes ``seconds`` more, so commands land mid-request."""
    engine = server.engine.engine
    step = engine.step
    engine.step = lambda: (time.sleep(seconds), step())[1]


def wait_until_running(server, num: int = 1) -> None:
    for _ in range(1000):
        if server.engine.num_requests >= num:
            return
        time.sleep(0.01)
    raise AssertionError("the requests never started")


def test_kv_cache_scales_while_asleep_is_503_not_a_crash(server) -> None:
    for level in (1, 2):
        assert server.post(f"/sleep?level={level}").status_code == 200
        reply = server.post("/collective_rpc", {"method": "kv_cache_scales"})
        assert reply.status_code == 503 and "asleep" in reply.json()["error"]["message"]
        assert server.post("/wake_up").status_code == 200
        server.post("/collective_rpc", {"method": "reload_weights"})
    reply = server.post("/collective_rpc", {"method": "kv_cache_scales"})
    assert reply.status_code == 200, reply.text
    assert server.get("/health").status_code == 200


@pytest.mark.parametrize("route", ["/sleep?level=1&mode=keep", "/release_memory_occupation"])
def test_keep_sleep_with_8_running_requests_completes_them_unchanged(
    server, model_dir, route
) -> None:
    expected = undisturbed(model_dir, PROMPTS_8, 40)
    slow_down(server)
    with ThreadPoolExecutor(8) as pool:
        body = {"temperature": 0.0, "max_tokens": 40, "ignore_eos": True, "return_token_ids": True}
        futures = [pool.submit(server.post, "/v1/completions", {"prompt": p, **body})
                   for p in PROMPTS_8]  # fmt: skip
        wait_until_running(server, 8)
        assert server.post(route, {} if "release" in route else None).status_code == 200
        time.sleep(0.2)
        assert not any(f.done() for f in futures)  # kept, not failed
        assert server.post("/wake_up").status_code == 200
        replies = [f.result(timeout=60) for f in futures]
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    assert [r.json()["choices"][0]["token_ids"] for r in replies] == expected


@pytest.mark.parametrize("bad", [512, 2**63, -1])
def test_an_out_of_range_token_id_fails_only_its_own_request(server, model_dir, bad) -> None:
    expected = undisturbed(model_dir, PROMPTS, 12)
    with ThreadPoolExecutor(7) as pool:
        good = [pool.submit(server.post, "/v1/completions",
                            {"prompt": p, "return_token_ids": True, **GREEDY})
                for p in PROMPTS * 2]  # fmt: skip
        evil = [pool.submit(server.post, "/v1/completions", {"prompt": [5, bad, 7], **GREEDY}),
                pool.submit(server.post, "/generate", {"input_ids": [bad]})]  # fmt: skip
        replies = [f.result(timeout=60) for f in good]
        refused = [f.result(timeout=60) for f in evil]
    assert [r.json()["choices"][0]["token_ids"] for r in replies] == expected * 2
    assert [r.status_code for r in refused] == [400, 400]
    assert all(r.json()["error"]["type"] == "BadRequestError" for r in refused)


def test_cross_site_requests_are_refused(start_server, model_dir, other_model_dir) -> None:
    server = start_server(allowed_weight_dirs=(model_dir.parent,))
    body = json.dumps({"model_path": str(other_model_dir)})
    reply = server.client.post(
        "/update_weights_from_disk",
        content=body,
        headers={"Content-Type": "text/plain", "Origin": "http://evil.example"},
    )
    assert reply.status_code == 403 and "origin" in reply.json()["error"]["message"]
    reply = server.client.post(
        "/update_weights_from_disk", content=body, headers={"Content-Type": "text/plain"}
    )
    assert reply.status_code == 415
    reply = server.client.post(
        "/update_weights_from_disk",
        content=body,
        headers={"Content-Type": "application/json", "Host": "rebound.example:8000"},
    )
    assert reply.status_code == 403 and "Host" in reply.json()["error"]["message"]
    assert server.post("/sleep?level=1", headers={"Origin": "null"}).status_code == 403
    assert server.get("/is_sleeping").json() == {"is_sleeping": False}  # nothing happened
    assert server.post("/v1/completions", {"prompt": PROMPTS[0], **GREEDY},
                       headers={"Origin": f"http://127.0.0.1:{server.thread.port}"}
                       ).status_code == 200  # fmt: skip


def write_weights(path: Path, source: Path, **changes: torch.Tensor) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, path / name)
    weights = load_file(str(source / "model.safetensors"))
    save_file({**weights, **changes}, str(path / "model.safetensors"))
    return path


def test_weights_load_only_from_allowed_dirs_and_only_finite(
    start_server, model_dir, other_model_dir, tmp_path
) -> None:
    root = tmp_path / "allowed"
    server = start_server(allowed_weight_dirs=(root,))
    first = server.post("/generate", GREEDY_GENERATE).json()["output_ids"]
    for path in (str(other_model_dir), "/etc", "/no/such/dir", str(root / ".." / "x")):
        reply = server.post("/update_weights_from_disk", {"model_path": path})
        assert reply.status_code == 403
        assert reply.json()["error"]["message"].startswith("model_path must name a checkpoint")
    weights = load_file(str(model_dir / "model.safetensors"))
    name = next(n for n in weights if n.endswith("q_proj.weight"))
    nan = write_weights(
        root / "nan", model_dir, **{name: torch.full_like(weights[name], torch.nan)}
    )
    reply = server.post("/update_weights_from_disk", {"model_path": str(nan)})
    assert reply.status_code == 400 and "NaN or Inf" in reply.json()["error"]["message"]
    escaping = write_weights(root / "escaping", model_dir)
    index = {"weight_map": {name: "../../outside.safetensors"}}
    (escaping / "model.safetensors.index.json").write_text(json.dumps(index))
    reply = server.post("/update_weights_from_disk", {"model_path": str(escaping)})
    assert reply.status_code == 400 and "outside its directory" in reply.json()["error"]["message"]
    again = server.post("/generate", GREEDY_GENERATE).json()["output_ids"]
    assert again == first  # nothing was written
    good = write_weights(root / "good", other_model_dir)
    assert server.post("/update_weights_from_disk", {"model_path": str(good)}).status_code == 200
    assert server.post("/generate", GREEDY_GENERATE).json()["output_ids"] != first


def test_no_allowed_dirs_refuses_every_path(server, model_dir) -> None:
    reply = server.post("/update_weights_from_disk", {"model_path": str(model_dir)})
    assert reply.status_code == 403 and "--allowed-weight-dirs" in reply.text


def test_400_half_sent_requests_hold_nothing(start_server) -> None:
    server = start_server(header_timeout_s=1.0, max_connections=512)
    sockets = []
    try:
        for _ in range(400):
            sock = socket.create_connection(("127.0.0.1", server.thread.port), timeout=10)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
            sockets.append(sock)
        reply = server.post("/v1/completions", {"prompt": PROMPTS[0], **GREEDY})
        assert reply.status_code == 200  # served while 400 connections dangle
        time.sleep(2.0)
        closed = 0
        for sock in sockets:
            sock.settimeout(5)
            try:
                closed += sock.recv(1024) == b""
            except (ConnectionResetError, TimeoutError):
                closed += 1
        assert closed == 400  # the server let go of every one
    finally:
        for sock in sockets:
            sock.close()


def test_a_slow_body_and_a_huge_body_are_refused(start_server) -> None:
    server = start_server(body_timeout_s=0.5, max_body_bytes=1 << 16)
    reply = server.post("/v1/completions", {"prompt": "x" * (1 << 17)})
    assert reply.status_code == 413
    with socket.create_connection(("127.0.0.1", server.thread.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"pro'
        )
        answer = sock.recv(4096)  # fmt: skip
    assert b" 408 " in answer.split(b"\r\n")[0]


def test_a_long_prompt_is_refused_before_tokenization(start_server, monkeypatch) -> None:
    server = start_server(max_prompt_chars=1000)
    calls = []
    tokenizer = server.engine.tokenizer
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: calls.append(1) or [1])
    reply = server.post("/v1/completions", {"prompt": "x" * 5000})
    assert reply.status_code == 400 and "characters" in reply.json()["error"]["message"]
    chat = {"messages": [{"role": "user", "content": "x" * 5000}]}
    reply = server.post("/v1/chat/completions", chat)
    assert reply.status_code == 400 and "characters" in reply.json()["error"]["message"]
    assert calls == []


def test_a_refit_during_a_request_never_mixes_weights(
    start_server, model_dir, other_model_dir
) -> None:
    server = start_server(allowed_weight_dirs=(other_model_dir.parent,))
    old = undisturbed(model_dir, PROMPTS[:1], 60)[0]
    new = undisturbed(other_model_dir, PROMPTS[:1], 60)[0]
    slow_down(server)
    body = {"prompt": PROMPTS[0], "temperature": 0.0, "max_tokens": 60, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(server.post, "/v1/completions", body)
        wait_until_running(server)
        refit = server.post("/update_weights_from_disk", {"model_path": str(other_model_dir)})
        assert refit.status_code == 200, refit.text
        reply = running.result(timeout=60)
    assert reply.json()["choices"][0]["token_ids"] == old
    assert server.post("/v1/completions", body).json()["choices"][0]["token_ids"] == new


def test_releasing_no_tags_does_not_report_sleeping(server) -> None:
    assert server.post("/release_memory_occupation", {"tags": []}).status_code == 200
    assert server.get("/is_sleeping").json() == {"is_sleeping": False}
    assert server.post("/v1/completions", {"prompt": PROMPTS[0], **GREEDY}).status_code == 200


def test_api_key_and_admin_token_guard_routes(start_server) -> None:
    server = start_server(api_key="k", admin_token="a")
    assert server.get("/health").status_code == 401
    auth = {"Authorization": "Bearer k"}
    admin = {"Authorization": "Bearer a"}
    assert server.get("/health", headers=auth).status_code == 200
    reply = server.post("/sleep?level=1", headers=auth)
    assert reply.status_code == 401 and "admin" in reply.json()["error"]["message"]
    assert server.post("/sleep?level=1", headers=admin).status_code == 200
    assert server.post("/wake_up", headers=admin).status_code == 200
    assert server.post("/v1/completions", {"prompt": PROMPTS[0], **GREEDY},
                       headers={"Authorization": "Bearer wrong"}).status_code == 401  # fmt: skip


@pytest.mark.parametrize(
    ("settings", "status"),
    [({}, 403), ({"insecure_admin": True}, 200), ({"admin_token": "t"}, 401)],
)
def test_admin_routes_off_loopback_need_a_token(server, settings, status) -> None:
    """A non-loopback bind, through the app in-process (no socket is opened beyond
    loopback): admin routes are refused unless a token is set or --insecure-admin is given."""
    config = replace(ServerSettings(served_model_names=("tiny",), host="0.0.0.0"), **settings)
    app = build_app(server.engine, config)

    async def ask() -> tuple[int, int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://10.1.2.3") as client:
            admin = await client.post("/pause")
            await client.post("/resume", headers={"Authorization": "Bearer t"})
            plain = await client.get("/is_sleeping")
            return admin.status_code, plain.status_code

    assert asyncio.run(ask()) == (status, 200)


def test_a_client_that_disconnects_mid_stream_aborts_quietly(server, caplog) -> None:
    slow_down(server, 0.005)
    caplog.set_level(logging.WARNING)
    body = {"prompt": PROMPTS[0], "stream": True, "max_tokens": 200, "ignore_eos": True}
    with socket.create_connection(("127.0.0.1", server.thread.port), timeout=10) as sock:
        data = json.dumps(body).encode()
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data)
        )
        received = b""
        while b"data: " not in received:  # the stream has started
            chunk = sock.recv(4096)
            assert chunk, received
            received += chunk
    for _ in range(500):
        if server.engine.num_requests == 0:
            break
        time.sleep(0.01)
    assert server.engine.num_requests == 0  # aborted
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
