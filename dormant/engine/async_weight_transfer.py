"""vLLM's weight-transfer calls on ``AsyncLLM`` (``engine/weight_transfer.py`` says what each
does), run on its loop between two steps; ``update_weights(request)`` is ``AsyncLLM``'s own, a
refit under its refit policy."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dormant.engine.engine_loop import EngineLoop
from dormant.engine.llm import LLM
from dormant.vllm_weight_transfer import WeightTransferInitRequest


class AsyncWeightTransferCalls:
    llm: LLM
    _engine_loop: EngineLoop

    async def init_weight_transfer_engine(
        self, request: WeightTransferInitRequest | Mapping[str, Any]
    ) -> None:
        """vLLM's: every rank joins the trainer's group; blocks until the trainer joined too."""
        await self._engine_loop.call(lambda: self.llm.init_weight_transfer_engine(request))

    async def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        await self._engine_loop.call(lambda: self.llm.start_weight_update(is_checkpoint_format))

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        await self._engine_loop.call(lambda: self.llm.finish_weight_update(weight_version))
