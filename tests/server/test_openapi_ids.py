"""Every operation of the server's routers has its own OpenAPI id (regression: ``/flush_cache``
was one route for GET and POST, so both got the same id and FastAPI warned; clients generated
from the schema would collide)."""

from __future__ import annotations

import warnings

from fastapi import FastAPI

from dormant.server import admin_routes, openai_routes, sglang_routes


def test_operation_ids_are_unique_and_flush_cache_has_both_methods() -> None:
    app = FastAPI()
    for module in (admin_routes, openai_routes, sglang_routes):
        app.include_router(module.router)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # FastAPI warns on a duplicate operation id
        schema = app.openapi()
    ids = [op["operationId"] for path in schema["paths"].values() for op in path.values()]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    assert set(schema["paths"]["/flush_cache"]) == {"get", "post"}
