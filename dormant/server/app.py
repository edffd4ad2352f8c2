"""An OpenAI-compatible HTTP server over one engine, with vLLM's and SGLang's sleep endpoints.

| route                           | body or query                | does                          |
|---------------------------------|------------------------------|-------------------------------|
| GET  /health                    |                              | 200 while the engine loop runs |
| GET  /v1/models                 |                              | the served model              |
| POST /v1/completions            | OpenAI completion            | generate (see protocol.py)    |
|                                 | with "stream": true          | server-sent events            |
| POST /v1/chat/completions       | OpenAI chat, text messages   | generate from the chat template |
| POST /sleep                     | ?level=1&mode=abort          | ``LLM.sleep(level, mode)``    |
| POST /wake_up                   | ?tags=weights&tags=kv_cache  | ``LLM.wake_up(tags)``         |
| GET  /is_sleeping               |                              | ``{"is_sleeping": bool}``     |
| POST /collective_rpc            | {"method", "args", "kwargs"} | an allowlisted worker method  |
| POST /release_memory_occupation | {"tags": [...]}, optional    | SGLang's release              |
| POST /resume_memory_occupation  | {"tags": [...]}, optional    | SGLang's resume               |
| POST /update_weights_from_disk  | {"model_path": "..."}        | ``reload_weights(model_path)`` |

Errors come back as ``{"error": {"message", "type", "code"}}`` with a status that says whose
fault it is: 400 for a bad request, 409 for a sleep-level conflict, 503 while the engine cannot
generate (asleep, weights not refit, out of memory on wake), 500 otherwise. The standard
library's threading HTTP server handles connections; one thread (``EngineLoop``) owns the engine.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from dormant.core.errors import EngineAsleepError
from dormant.core.sampling_params import SamplingParams
from dormant.engine.llm import LLM
from dormant.memory.errors import SleepConflictError, TagAsleepError, WakeOutOfMemoryError
from dormant.server.engine_loop import EngineLoop, EngineStoppedError
from dormant.server.protocol import (
    BadRequestError,
    Options,
    Prompt,
    chat_response,
    completion_response,
    parse_chat,
    parse_completion,
)
from dormant.server.streaming import Stream

Query = dict[str, list[str]]
Route = Callable[[Query, Any], Any]
# update_weights takes tensors, which JSON cannot carry: refit over HTTP from disk instead.
_RPC_OVER_HTTP = {"wake_up", "reload_weights", "memory_status", "kv_cache_scales", "audit",
                  "verify_guards", "check_health"}  # fmt: skip


class DormantServer(ThreadingHTTPServer):
    """Serves ``llm`` at ``address`` (port 0 picks a free one: see ``server_address``)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], llm: LLM, model_name: str) -> None:
        self.llm, self.model_name = llm, model_name
        self.engine = llm.llm_engine
        self.loop = EngineLoop(self.engine)
        self._routes: dict[tuple[str, str], Route] = {
            ("GET", "/health"): lambda query, body: self.loop.call(dict),
            ("GET", "/v1/models"): self._models,
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/sleep"): self._sleep,
            ("POST", "/wake_up"): self._wake_up,
            ("GET", "/is_sleeping"): lambda query, body: {
                "is_sleeping": self.loop.call(self.engine.is_sleeping)
            },
            ("POST", "/collective_rpc"): self._collective_rpc,
            ("POST", "/release_memory_occupation"): self._release,
            ("POST", "/resume_memory_occupation"): self._resume,
            ("POST", "/update_weights_from_disk"): self._update_weights_from_disk,
        }
        super().__init__(address, _Handler)

    def server_close(self) -> None:
        super().server_close()
        self.loop.stop()

    def handle(self, method: str, path: str, query: Query, body: Any) -> Any:
        """The reply to one request (JSON, or a ``Stream``); raises to make an error reply."""
        route = self._routes.get((method, path))
        if route is None:
            raise LookupError(f"no route {method} {path}")
        return route(query, body)

    def _models(self, query: Query, body: Any) -> Any:
        card = {"id": self.model_name, "object": "model", "owned_by": "dormant"}
        return {"object": "list", "data": [{**card, "max_model_len": self._max_model_len}]}

    def _completions(self, query: Query, body: Any) -> Any:
        request = parse_completion(body)
        if request.options.stream:
            return self._stream("completion", request.prompts, request.params, request.options)
        outputs = self.loop.generate(request.prompts, request.params)
        return completion_response(outputs, self.model_name, request.options.return_token_ids)

    def _chat(self, query: Query, body: Any) -> Any:
        chat = parse_chat(body, self._max_model_len)
        prompt = self.engine.tokenizer.apply_chat_template(chat.messages)
        if chat.options.stream:
            return self._stream("chat", [prompt], chat.params, chat.options)
        output = self.loop.generate([prompt], chat.params)[0]
        return chat_response(output, self.model_name, chat.options.return_token_ids)

    def _sleep(self, query: Query, body: Any) -> Any:
        level = _one(query, "level", "1")
        if not level.isdigit():
            raise BadRequestError(f"level must be 0, 1 or 2, got {level!r}")
        self.loop.sleep(int(level), _one(query, "mode", "abort"))
        return {}

    def _wake_up(self, query: Query, body: Any) -> Any:
        tags = query.get("tags") or None
        self.loop.call(lambda: self.engine.wake_up(tags))
        return {}

    def _release(self, query: Query, body: Any) -> Any:
        tags = _optional_tags(body)
        self.loop.call(lambda: self.engine.release(tags))
        return {}

    def _resume(self, query: Query, body: Any) -> Any:
        tags = _optional_tags(body)
        self.loop.call(lambda: self.engine.wake_up(tags))
        return {}

    def _update_weights_from_disk(self, query: Query, body: Any) -> Any:
        path = body.get("model_path") if isinstance(body, dict) else None
        if not isinstance(path, str):
            raise BadRequestError('update_weights_from_disk needs {"model_path": "..."}')
        self.loop.call(lambda: self.engine.reload_weights(path))
        return {"success": True}

    @property
    def _max_model_len(self) -> int:
        return self.engine.config.max_model_len

    def _stream(
        self, kind: str, prompts: list[Prompt], params: SamplingParams, options: Options
    ) -> Stream:
        stream = Stream(self.loop, kind, self.model_name, options)
        stream.open(prompts, params)  # a refusal raises here, before anything is sent
        return stream

    def _collective_rpc(self, query: Query, body: Any) -> Any:
        if not isinstance(body, dict) or not isinstance(body.get("method"), str):
            raise BadRequestError(
                'collective_rpc needs {"method": ..., "args": [...], "kwargs": {}}'
            )
        method, args, kwargs = body["method"], body.get("args", []), body.get("kwargs", {})
        if method == "sleep":  # through the loop, so that requests it aborts are answered
            self.loop.sleep(*args, **kwargs)
            return {"results": [None] * self.engine.executor.world_size}
        if method not in _RPC_OVER_HTTP:
            raise BadRequestError(
                f"collective_rpc over HTTP allows {sorted({'sleep', *_RPC_OVER_HTTP})}; "
                f"got {method!r} (refit with /update_weights_from_disk)"
            )
        results = self.loop.call(lambda: self.engine.collective_rpc(method, args, kwargs))
        return {"results": _jsonable(results)}


class _Handler(BaseHTTPRequestHandler):
    server: DormantServer
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: errors are in the replies

    def _serve(self, method: str) -> None:
        url = urlsplit(self.path)
        try:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else {}
            except json.JSONDecodeError as error:
                raise BadRequestError(f"the body is not valid JSON: {error}") from error
            reply = self.server.handle(method, url.path, parse_qs(url.query), body)
            if isinstance(reply, Stream):
                self._send_events(reply)
                return
            self._reply(HTTPStatus.OK, reply)
        except Exception as error:
            status = _status_of(error)
            message = str(error.args[0]) if error.args else type(error).__name__
            self._reply(status, {"error": {"message": message, "type": type(error).__name__,
                                           "code": int(status)}})  # fmt: skip

    def _send_events(self, stream: Stream) -> None:
        """Server-sent events until ``data: [DONE]``; the connection closes after them. A
        client that goes away aborts its requests."""
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        try:
            for event in stream:
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except OSError:  # the client went away (BrokenPipe, ConnectionReset)
            stream.cancel()

    def _reply(self, status: HTTPStatus, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _status_of(error: Exception) -> HTTPStatus:
    if isinstance(error, LookupError) and not isinstance(error, KeyError):
        return HTTPStatus.NOT_FOUND
    if isinstance(error, SleepConflictError):
        return HTTPStatus.CONFLICT
    unavailable = (EngineAsleepError, TagAsleepError, WakeOutOfMemoryError, EngineStoppedError)
    if isinstance(error, unavailable):
        return HTTPStatus.SERVICE_UNAVAILABLE
    if isinstance(error, BadRequestError | ValueError | KeyError | TypeError):
        return HTTPStatus.BAD_REQUEST
    return HTTPStatus.INTERNAL_SERVER_ERROR


def _one(query: dict[str, list[str]], name: str, default: str) -> str:
    values = query.get(name, [default])
    if len(values) != 1:
        raise BadRequestError(f"give {name} once, got {values}")
    return values[0]


def _optional_tags(body: Any) -> list[str] | None:
    tags = body.get("tags") if isinstance(body, dict) else None
    if tags is not None and not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
        raise BadRequestError(f"tags must be a list of strings, got {tags!r}")
    return tags


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)
