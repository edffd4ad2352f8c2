"""vLLM's ``POST /collective_rpc`` over HTTP (an admin route, ``security.ADMIN_ROUTES``): the
worker methods JSON can call, and their results made JSON."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from fastapi import APIRouter, Request

from dormant.core.errors import EngineAsleepError
from dormant.server.errors import BadRequestError
from dormant.server.sglang_protocol import CollectiveRpcRequest

router = APIRouter()
# What /collective_rpc may call over HTTP (update_weights takes tensors, which JSON cannot
# carry; reload_weights from a path goes through /update_weights_from_disk's checks), and the
# tag each one reads: asleep, the call answers 503 instead of touching released memory.
RPC_OVER_HTTP: dict[str, str | None] = {
    "sleep": None, "wake_up": None, "sleep_state": None, "memory_status": None, "audit": None,
    "verify_guards": None, "check_health": None, "reload_weights": None,
    "kv_cache_scales": "runtime",
}  # fmt: skip


@router.post("/collective_rpc")
async def collective_rpc(body: CollectiveRpcRequest, request: Request) -> dict[str, Any]:
    if body.method not in RPC_OVER_HTTP:
        raise BadRequestError(
            f"collective_rpc over HTTP allows {sorted(RPC_OVER_HTTP)}; got {body.method!r} "
            "(refit with /update_weights_from_disk or /update_weights_from_tensor)"
        )
    if body.method == "reload_weights" and (body.args or body.kwargs):
        raise BadRequestError(
            "collective_rpc reload_weights over HTTP re-reads the served checkpoint only; load "
            "another one with /update_weights_from_disk (its paths are checked)"
        )
    engine = request.app.state.serving.engine
    tag = RPC_OVER_HTTP[body.method]
    if tag is not None and tag in await engine.asleep_tags():
        raise EngineAsleepError(
            f"{body.method} reads the {tag!r} memory, which is asleep; wake_up() first"
        )
    results = await engine.collective_rpc(body.method, args=body.args, kwargs=body.kwargs)
    return {"results": jsonable(results)}


def jsonable(value: Any) -> Any:
    """Worker results as JSON: dataclasses as objects, enums as their values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return jsonable(value.value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if hasattr(value, "tolist"):  # tensors
        return value.tolist()
    return str(value)
