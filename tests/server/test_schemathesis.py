"""A schemathesis run over the server's ``/openapi.json``, over real HTTP, bounded in examples
(and so in time): no request it generates gets a 5xx or crashes the server. Admin routes that
change the engine's state (sleep, pause, refit) are left out: a sleep rightly answers later
generations with 503; they have their own tests."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from dormant.engine.async_llm import AsyncLLM
from dormant.server import ServerSettings, ServerThread, build_app
from tests.server.conftest import OPTIONS

STATE_CHANGING = [
    "/sleep", "/pause", "/collective_rpc", "/release_memory_occupation",
    "/pause_generation", "/update_weights_from_disk", "/update_weights_from_tensor",
    "/update_weights_from_distributed", "/init_weights_update_group",
    "/destroy_weights_update_group",
]  # fmt: skip


@pytest.fixture(scope="module")
def api(model_dir):
    engine = AsyncLLM(str(model_dir), enable_sleep_mode=True, **{**OPTIONS, "max_model_len": 48})
    config = ServerSettings(served_model_names=("tiny",), port=0)
    thread = ServerThread(build_app(engine, config), config).start()
    try:
        yield schemathesis.openapi.from_url(f"{thread.url}/openapi.json").exclude(
            path=STATE_CHANGING
        )
    finally:
        thread.stop()
        engine.shutdown()


schema = schemathesis.pytest.from_fixture("api")


@schema.parametrize()
@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_generated_request_gets_a_5xx(case) -> None:
    case.call_and_validate(checks=[not_a_server_error], timeout=30)
