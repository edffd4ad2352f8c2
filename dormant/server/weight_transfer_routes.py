"""vLLM's weight-transfer routes (its server's development mode), which TRL's ``VLLMClient``
and other RL trainers drive: ``/init_weight_transfer_engine``, ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update`` (admin routes, ``security.ADMIN_ROUTES``), and
the read-only ``/get_world_size`` and ``/is_paused`` (``/server_info``'s ``vllm_config`` says
whether the engine has a ``weight_transfer_config``).

The trainer's broadcasts travel beside the HTTP calls over the weight-transfer group
(``engine/weight_transfer.py``); the init and update calls block until they arrived, as vLLM's
do. An update is a refit under ``AsyncLLM``'s refit policy.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from dormant.engine.async_llm import AsyncLLM
from dormant.vllm_weight_transfer import WeightTransferInitRequest, WeightTransferUpdateRequest

router = APIRouter()


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class InitBody(_Body):
    init_info: dict[str, Any]


class StartBody(_Body):
    is_checkpoint_format: bool = True


class UpdateBody(_Body):
    update_info: dict[str, Any]


class FinishBody(_Body):
    weight_version: str | None = None


def _engine(request: Request) -> AsyncLLM:
    return request.app.state.serving.engine


@router.post("/init_weight_transfer_engine")
async def init_weight_transfer_engine(body: InitBody, request: Request) -> dict[str, Any]:
    await _engine(request).init_weight_transfer_engine(WeightTransferInitRequest(body.init_info))
    return {}


@router.post("/start_weight_update")
async def start_weight_update(request: Request, body: StartBody | None = None) -> dict[str, Any]:
    checkpoint = True if body is None else body.is_checkpoint_format
    await _engine(request).start_weight_update(checkpoint)
    return {}


@router.post("/update_weights")
async def update_weights(body: UpdateBody, request: Request) -> dict[str, Any]:
    await _engine(request).update_weights(WeightTransferUpdateRequest(body.update_info))
    return {}


@router.post("/finish_weight_update")
async def finish_weight_update(request: Request, body: FinishBody | None = None) -> dict[str, Any]:
    version = None if body is None else body.weight_version
    await _engine(request).finish_weight_update(version)
    return {}


@router.get("/get_world_size")
async def get_world_size(request: Request, include_dp: bool = True) -> dict[str, int]:
    """vLLM's: the engine's ranks (a trainer's group has one more: itself); dormant runs no
    data parallelism, so ``include_dp`` changes nothing."""
    return {"world_size": _engine(request).engine.config.tensor_parallel_size}


@router.get("/is_paused")
async def is_paused(request: Request) -> dict[str, bool]:
    return {"is_paused": await _engine(request).is_paused()}
