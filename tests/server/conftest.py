"""Server fixtures: a tiny Qwen3 checkpoint with a byte-level BPE tokenizer (seeds 1 and 2),
and servers over real HTTP on 127.0.0.1 (a free port each)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import httpx
import pytest

from dormant.engine.async_llm import AsyncLLM
from dormant.server import ServerSettings, ServerThread, build_app
from tests.engine.conftest import write_checkpoint
from tests.server.tokenizer_files import write_tokenizer

# The official client and schemathesis come with the test extra, beside the server's own
# packages. Where only the server's packages are (carried to the bare GPU machine), the rest of
# the server's tests run.
collect_ignore = [
    module
    for module, needs in (("test_clients.py", "openai"), ("test_schemathesis.py", "schemathesis"))
    if find_spec(needs) is None
]

OPTIONS = dict(
    device="cpu", max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=4 << 20, seed=0
)
PROMPTS = [[5, 17, 99, 3, 250, 42], [7, 7, 7], [101, 202, 33, 44, 55, 66, 77, 88, 99, 11]]
GREEDY = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_checkpoint(tmp_path_factory.mktemp("weights") / "a", seed=1)
    write_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def other_model_dir(model_dir: Path) -> Path:
    path = write_checkpoint(model_dir.parent / "b", seed=2)
    write_tokenizer(path)
    return path


class Running:
    """A server and its engine; ``client`` speaks HTTP to it."""

    def __init__(self, engine: AsyncLLM, thread: ServerThread, headers: dict[str, str]) -> None:
        self.engine, self.thread, self.url = engine, thread, thread.url
        self.client = httpx.Client(base_url=thread.url, timeout=60, headers=headers)

    def post(self, path: str, body: Any = None, **options: Any) -> httpx.Response:
        return self.client.post(path, json=body, **options)

    def get(self, path: str, **options: Any) -> httpx.Response:
        return self.client.get(path, **options)

    def close(self) -> None:
        self.client.close()
        self.thread.stop()
        self.engine.shutdown()


@pytest.fixture
def start_server(model_dir: Path) -> Iterator[Callable[..., Running]]:
    """Starts servers (``settings`` overrides; engine ``options``); stops them afterwards."""
    servers: list[Running] = []

    def start(
        model: Path | None = None,
        headers: dict[str, str] | None = None,
        engine_options: dict[str, Any] | None = None,
        **settings: Any,
    ) -> Running:
        engine = AsyncLLM(
            str(model or model_dir), enable_sleep_mode=True, **{**OPTIONS, **(engine_options or {})}
        )
        base = ServerSettings(served_model_names=("tiny",), port=0)
        config = replace(base, **settings)
        thread = ServerThread(build_app(engine, config), config).start()
        running = Running(engine, thread, headers or {})
        servers.append(running)
        return running

    yield start
    for running in servers:
        running.close()


@pytest.fixture
def server(start_server) -> Running:
    return start_server()
