"""The RL driver's routes: vLLM's development routes (``/sleep``, ``/wake_up``, ``/pause``,
..., and ``/collective_rpc`` from ``rpc_route.py``) and SGLang's (``/release_memory_occupation``,
``/pause_generation``, ``/update_weights_from_*``, weight-update groups). All of them are admin
routes (``security.ADMIN_ROUTES``) except the read-only ``/is_sleeping`` and
``/get_weight_version``.

Refits follow ``AsyncLLM``'s refit policy (``wait``: running requests finish on the old
weights first), or abort running requests when SGLang's ``abort_all_requests`` says so.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request

from dormant.server import rpc_route
from dormant.server.errors import BadRequestError, NotImplementedByEngineError
from dormant.server.metrics import Metrics
from dormant.server.serving import Serving
from dormant.server.sglang_protocol import (
    DestroyWeightsUpdateGroupRequest,
    InitWeightsUpdateGroupRequest,
    PauseGenerationRequest,
    TagsRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightVersionRequest,
)
from dormant.server.weights import check_finite, checked_weight_dir, weight_files

router = APIRouter()
router.include_router(rpc_route.router)  # POST /collective_rpc
Mode = Literal["abort", "wait", "keep"]
OK = {"success": True, "message": "ok"}


def _serving(request: Request) -> Serving:
    return request.app.state.serving


def _metrics(request: Request) -> Metrics:
    return request.app.state.metrics


# ── vLLM ─────────────────────────────────────────────────────────────────────────────────────


@router.post("/sleep")
async def sleep(
    request: Request, level: Annotated[int, Query(ge=0, le=2)] = 1, mode: Mode = "abort"
) -> dict[str, Any]:
    with _metrics(request).timed("sleep"):
        await _serving(request).engine.sleep(level, mode)
    return {}


@router.post("/wake_up")
async def wake_up(
    request: Request, tags: Annotated[list[str] | None, Query()] = None
) -> dict[str, Any]:
    with _metrics(request).timed("wake"):
        is_awake = await _serving(request).engine.wake_up(tags or None)
    return {"is_awake": is_awake}


@router.get("/is_sleeping")
async def is_sleeping(request: Request) -> dict[str, bool]:
    return {"is_sleeping": await _serving(request).engine.is_sleeping()}


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> dict[str, bool]:
    return {"success": await _serving(request).engine.reset_prefix_cache()}


@router.post("/pause")
async def pause(request: Request, mode: Mode = "abort") -> dict[str, Any]:
    await _serving(request).engine.pause_generation(mode)
    return {}


@router.post("/resume")
async def resume(request: Request) -> dict[str, Any]:
    await _serving(request).engine.resume_generation()
    return {}


# ── SGLang ───────────────────────────────────────────────────────────────────────────────────


async def flush_cache(request: Request) -> dict[str, Any]:
    """SGLang's, on both of its methods (slime calls it with GET before every release)."""
    await _serving(request).engine.reset_prefix_cache()
    return {**OK, "message": "Cache flushed."}


# One route per method: one route for both gives both operations the same OpenAPI id.
for _method in ("GET", "POST"):
    router.add_api_route(
        "/flush_cache", flush_cache, methods=[_method], name=f"flush_cache_{_method.lower()}"
    )


@router.post("/pause_generation")
async def pause_generation(
    request: Request, body: PauseGenerationRequest | None = None
) -> dict[str, str]:
    """SGLang's modes: ``abort``; ``retract`` and ``in_place`` keep the requests (dormant
    recomputes their KV where it was discarded either way)."""
    mode = (body or PauseGenerationRequest()).mode
    await _serving(request).engine.pause_generation("abort" if mode == "abort" else "keep")
    return {"message": "Generation paused successfully.", "status": "ok"}


@router.post("/continue_generation")
async def continue_generation(request: Request) -> dict[str, str]:
    await _serving(request).engine.resume_generation()
    return {"message": "Generation continued successfully.", "status": "ok"}


@router.post("/release_memory_occupation")
async def release_memory_occupation(
    request: Request, body: TagsRequest | None = None
) -> dict[str, Any]:
    tags = (body or TagsRequest()).tags
    if tags == []:  # nothing named: nothing released, and nothing reports asleep
        return {**OK, "message": "no tags named; nothing was released"}
    with _metrics(request).timed("sleep"):
        await _serving(request).engine.release(tags)
    return OK


@router.post("/resume_memory_occupation")
async def resume_memory_occupation(
    request: Request, body: TagsRequest | None = None
) -> dict[str, Any]:
    tags = (body or TagsRequest()).tags
    if tags == []:
        return {**OK, "message": "no tags named; nothing was resumed"}
    with _metrics(request).timed("wake"):
        await _serving(request).engine.wake_up(tags)
    return OK


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(
    body: UpdateWeightsFromDiskRequest, request: Request
) -> dict[str, Any]:
    serving = _serving(request)
    if body.load_format not in (None, "auto", "safetensors"):
        raise BadRequestError(f"load_format={body.load_format!r}: only safetensors is read")
    directory = checked_weight_dir(body.model_path, serving.settings.allowed_weight_dirs)
    files = weight_files(directory)
    nbytes = await asyncio.to_thread(check_finite, files, serving.engine.device)
    engine = serving.engine
    with _metrics(request).timed("refit"):
        await engine.refit(
            lambda: engine.llm.reload_weights(str(directory)),
            policy="abort" if body.abort_all_requests else None,
            weight_version=body.weight_version,
        )
    _metrics(request).add_refit_bytes(nbytes)
    return {**OK, "num_paused_requests": 0}


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(
    body: UpdateWeightsFromTensorRequest, request: Request
) -> dict[str, Any]:
    kwargs = {"named_tensors": body.serialized_named_tensors,
              "load_format": body.load_format}  # fmt: skip
    await _refit_through(request, "update_weights_from_tensor", kwargs, body)
    return OK


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(
    body: UpdateWeightsFromDistributedRequest, request: Request
) -> dict[str, Any]:
    kwargs = {"names": body.names, "dtypes": body.dtypes, "shapes": body.shapes,
              "group_name": body.group_name, "load_format": body.load_format}  # fmt: skip
    await _refit_through(request, "update_weights_from_distributed", kwargs, body)
    return OK


@router.post("/init_weights_update_group")
async def init_weights_update_group(
    body: InitWeightsUpdateGroupRequest, request: Request
) -> dict[str, Any]:
    engine = _serving(request).engine
    method = llm_method(engine, "init_weights_update_group")
    arguments = body.model_dump()
    # On the engine's own thread, between steps, like every command: the rendezvous blocks it
    # until the trainer joins, which it does at once (SGLang's engine blocks the same way).
    await engine.call(lambda: method(**arguments))
    return OK


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(
    body: DestroyWeightsUpdateGroupRequest, request: Request
) -> dict[str, Any]:
    engine = _serving(request).engine
    method = llm_method(engine, "destroy_weights_update_group")
    await engine.call(lambda: method(group_name=body.group_name))
    return OK


@router.get("/get_weight_version")
async def get_weight_version(request: Request) -> dict[str, Any]:
    engine = _serving(request).engine
    method = llm_method(engine, "get_weight_version")
    return {"weight_version": await engine.call(method)}


@router.post("/update_weight_version")
async def update_weight_version(
    body: UpdateWeightVersionRequest, request: Request
) -> dict[str, Any]:
    """SGLang's: relabels the served weights (no weight changes) once no running request
    could carry two labels: aborted first by default (``abort_all_requests``), else under the
    refit policy."""
    await _serving(request).engine.refit(
        lambda: None,
        policy="abort" if body.abort_all_requests else None,
        weight_version=body.new_version,
    )
    return {**OK, "message": f"Weight version updated to {body.new_version}",
            "new_version": body.new_version}  # fmt: skip


async def _refit_through(request: Request, name: str, kwargs: dict[str, Any], body: Any) -> None:
    engine = _serving(request).engine
    method = llm_method(engine, name)
    with _metrics(request).timed("refit"):
        await engine.refit(
            lambda: method(**kwargs),
            policy="abort" if body.abort_all_requests else None,
            weight_version=body.weight_version,
        )


def llm_method(engine: Any, name: str) -> Any:
    """``LLM.<name>``, or a 501 naming what the engine lacks."""
    method = getattr(engine.llm, name, None)
    if method is None:
        raise NotImplementedByEngineError(
            f"this engine has no LLM.{name}() yet, so /{name} cannot run; use "
            "/update_weights_from_disk to refit",
            kind="NotImplementedError",
        )
    return method
