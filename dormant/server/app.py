"""The HTTP server: FastAPI routes over one ``AsyncLLM``, served by uvicorn.

| routes                                               | file                          |
|------------------------------------------------------|-------------------------------|
| /v1/completions, /v1/chat/completions, /v1/models,   | ``openai_routes.py``          |
| /tokenize, /detokenize                               |                               |
| /generate, /abort_request, /health_generate          | ``sglang_routes.py``          |
| /v1/loads                                            | ``sglang_loads.py``           |
| vLLM's /sleep, /wake_up, /is_sleeping, /pause,       | ``admin_routes.py``           |
| /resume, /reset_prefix_cache; SGLang's memory, pause |                               |
| and refit routes                                     |                               |
| /collective_rpc                                      | ``rpc_route.py``              |
| /init_weight_transfer_engine, /start_weight_update,  | ``weight_transfer_routes.py`` |
| /update_weights, /finish_weight_update (vLLM's),     |                               |
| /get_world_size, /is_paused                          |                               |
| /health, /version, /server_info, /get_server_info,   | here                          |
| /model_info, /get_model_info, /metrics, /openapi.json |                              |

Every request first passes ``SecurityMiddleware`` (Host, Origin, API key, admin token,
Content-Type, body size and time); errors are typed JSON (``errors.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import socket
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

import uvicorn
from fastapi import Depends, FastAPI, Request, Response

from dormant.engine.async_llm import AsyncLLM
from dormant.server import admin_routes, openai_routes, sglang_routes, weight_transfer_routes
from dormant.server.connection import header_timeout_protocol
from dormant.server.errors import install_error_handlers
from dormant.server.metrics import Metrics
from dormant.server.query_check import forbid_unknown_query
from dormant.server.security import SecurityMiddleware
from dormant.server.serving import Serving
from dormant.server.settings import ServerSettings

logger = logging.getLogger("dormant.server")


def version() -> str:
    try:
        return importlib.metadata.version("dormant")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def build_app(engine: AsyncLLM, settings: ServerSettings) -> FastAPI:
    """The ASGI app; it does not own ``engine`` (the caller shuts it down)."""
    metrics = Metrics(settings.served_model_names[0])
    serving = Serving(engine, settings, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        idle = None
        if settings.sleep_idle_ttl_s is not None:
            idle = asyncio.create_task(_sleep_when_idle(serving, settings.sleep_idle_ttl_s))
        yield
        if idle is not None:
            idle.cancel()

    app = FastAPI(
        title="dormant",
        version=version(),
        lifespan=lifespan,
        generate_unique_id_function=_operation_id,
    )
    app.state.serving, app.state.metrics = serving, metrics
    app.state.started_at = int(time.time())
    # vLLM's default_sampling_params: the OpenAI routes fill unset fields from them
    app.state.sampling_defaults = engine.engine.config.sampling_defaults
    install_error_handlers(app)
    for module in (openai_routes, sglang_routes, admin_routes, weight_transfer_routes):
        app.include_router(module.router, dependencies=[Depends(forbid_unknown_query)])
    _add_info_routes(app, serving, metrics)
    app.add_middleware(SecurityMiddleware, settings=settings)
    return app


def _add_info_routes(app: FastAPI, serving: Serving, metrics: Metrics) -> None:
    engine = serving.engine

    @app.get("/health")
    async def health() -> dict[str, Any]:
        """200 while the engine loop answers (asleep included); 503 once it stopped."""
        await engine.is_sleeping()
        return {}

    @app.get("/version")
    async def get_version() -> dict[str, str]:
        return {"version": version()}

    async def server_info(config_format: Literal["json", "text"] = "json") -> dict[str, Any]:
        """SGLang's server args, and vLLM's ``vllm_config`` (TRL checks its
        ``weight_transfer_config``; ``config_format`` as vLLM's, "text" gives it as a string)."""
        settings = serving.settings
        config = engine.engine.config
        vllm_config = {
            "weight_transfer_config": config.weight_transfer_config,
            "tensor_parallel_size": config.tensor_parallel_size,
            "max_model_len": config.max_model_len,
            "enable_sleep_mode": config.enable_sleep_mode,
            "enable_prefix_caching": config.enable_prefix_caching,
            "logprobs_mode": config.logprobs_mode,
            "max_logprobs": config.max_logprobs,
        }
        return {
            "vllm_config": vllm_config if config_format == "json" else str(vllm_config),
            # SGLang's server-args names that RL frameworks read: slime sizes an external
            # engine by tp/pp size and checks enable_memory_saver against --offload-rollout.
            "enable_memory_saver": bool(config.enable_sleep_mode),
            "tp_size": config.tensor_parallel_size,
            "pp_size": 1,
            "dp_size": 1,
            "ep_size": 1,
            "version": version(),
            "served_model_names": list(settings.served_model_names),
            "max_model_len": serving.max_model_len,
            "vocab_size": serving.vocab_size,
            "is_sleeping": await engine.is_sleeping(),
            "weight_version": engine.weight_version,
            "refit_policy": engine.refit_policy,
            "limits": {
                "max_body_bytes": settings.max_body_bytes,
                "max_prompt_chars": serving.max_prompt_chars,
                "max_sequences_per_request": settings.max_sequences_per_request,
                "max_connections": settings.max_connections,
                "header_timeout_s": settings.header_timeout_s,
                "body_timeout_s": settings.body_timeout_s,
            },
            "auth": {
                "api_key": settings.api_key is not None,
                "admin_token": settings.admin_token is not None,
                "admin_open": settings.admin_is_open,
            },
            "internal_states": [],
        }

    app.add_api_route("/server_info", server_info, methods=["GET"], name="server_info")
    app.add_api_route("/get_server_info", server_info, methods=["GET"], name="get_server_info")

    async def model_info() -> dict[str, Any]:
        """SGLang's keys (its router reads ``architectures`` when a worker registers);
        ``model_path`` is the served name (no file system path is shown)."""
        name = serving.model_name
        return {
            "model_path": name,
            "tokenizer_path": name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": engine.weight_version,
            "architectures": [engine.engine.config.model_config.architecture],
        }

    # SGLang's current name, and the older one slime and verl call
    app.add_api_route("/model_info", model_info, methods=["GET"], name="model_info")
    app.add_api_route("/get_model_info", model_info, methods=["GET"], name="get_model_info")

    @app.get("/metrics")
    async def get_metrics(request: Request) -> Response:
        statuses = await engine.memory_status()
        metrics.refresh(
            is_sleeping=await engine.is_sleeping(),
            status=statuses[0] if statuses else None,
            num_requests=engine.num_requests,
            version=engine.weight_version,
        )
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")


def _operation_id(route: Any) -> str:
    """One id per method and path (a route serving GET and POST gets two)."""
    methods = "_".join(sorted(route.methods))
    return f"{route.name}_{methods}".lower()


async def _sleep_when_idle(serving: Serving, ttl_s: float) -> None:
    """Sleeps (level 1) once nothing ran for ``ttl_s`` seconds."""
    engine = serving.engine
    while True:
        await asyncio.sleep(min(ttl_s / 4, 1.0))
        idle_for = time.monotonic() - serving.last_activity
        if serving.num_in_flight or engine.num_requests or idle_for < ttl_s:
            continue
        if not await engine.is_sleeping():
            with serving.metrics.timed("sleep"):
                await engine.sleep(1, "keep")
            logger.info("idle for %.0f s: asleep at level 1", idle_for)


def uvicorn_config(app: FastAPI, settings: ServerSettings, sock: socket.socket | None = None):
    """uvicorn's settings from ours: connection cap, keep-alive, a head deadline, h11 limits."""
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http=header_timeout_protocol(settings.header_timeout_s),
        limit_concurrency=settings.max_connections,
        timeout_keep_alive=settings.keep_alive_s,
        timeout_graceful_shutdown=5,
        h11_max_incomplete_event_size=64 * 1024,  # the request head's size
        backlog=max(settings.max_connections, 128),
        log_level="warning",
        access_log=False,
        lifespan="on",
    )
    return config


class StoppableServer(uvicorn.Server):
    """uvicorn's server, except that a SIGINT or SIGTERM that stopped it gracefully is not
    raised again afterwards (uvicorn re-raises it, which would end the process with the
    signal's status instead of returning, so the engine could not shut down cleanly)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        with super().capture_signals():
            try:
                yield
            finally:
                self._captured_signals.clear()


def bind_socket(host: str, port: int) -> socket.socket:
    """Binds before the model loads, so a busy port is reported at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(128)  # connections wait in the backlog until uvicorn serves them
    sock.set_inheritable(True)
    return sock


class ServerThread:
    """uvicorn on a background thread, for tests and embedding: ``start`` returns once it
    listens; ``url`` is where."""

    def __init__(self, app: FastAPI, settings: ServerSettings) -> None:
        self.sock = bind_socket(settings.host, settings.port)
        self.server = StoppableServer(uvicorn_config(app, settings))
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self._thread: Any = None

    def start(self) -> ServerThread:
        import threading

        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )
        self._thread.start()
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server thread stopped before it listened")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.sock.close()
