"""verl's rollout server code that the abort tests run, as verl writes it: from
volcengine/verl@b178a3cd ``verl/workers/rollout/vllm_rollout/vllm_async_server.py`` (``vas``),
``generate`` (L445-547; no LoRA, no multimodal data), ``clear_kv_cache``, ``abort_all_requests``
and ``abort_request`` (L595-680). ``from vllm.v1.engine import FinishReason`` needs
``dormant.install_as_vllm()`` first."""

from __future__ import annotations

import logging
from typing import Any

from dormant import SamplingParams
from dormant.engine.async_llm import AsyncLLM
from dormant.vllm_compat import TokensPrompt

logger = logging.getLogger(__name__)


async def verl_generate(
    engine: AsyncLLM, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str
) -> dict[str, Any]:
    """vas L445-547: the server's ``generate`` (no LoRA, no multimodal data)."""
    sampling_params = dict(sampling_params)
    max_possible_tokens = engine.max_model_len - len(prompt_ids)
    max_tokens = max(0, min(sampling_params.pop("max_tokens"), max_possible_tokens))
    sampling_params["logprobs"] = 0 if sampling_params.pop("logprobs", False) else None
    sampling_params.setdefault("repetition_penalty", 1.0)
    params = SamplingParams(max_tokens=max_tokens, **sampling_params)
    prompt = TokensPrompt(prompt_token_ids=prompt_ids, multi_modal_data={})
    generator = engine.generate(
        prompt=prompt, sampling_params=params, request_id=request_id, lora_request=None,
        priority=0,
    )  # fmt: skip
    final_res = None
    async for output in generator:
        final_res = output
    assert final_res is not None
    token_ids = final_res.outputs[0].token_ids
    logprobs = final_res.outputs[0].logprobs
    log_probs = [logprobs[i][token_ids[i]].logprob for i in range(len(token_ids))]
    finish_reason = final_res.outputs[0].finish_reason
    stop_reason = "aborted" if finish_reason == "abort" else "completed"
    return dict(token_ids=list(token_ids), log_probs=log_probs, stop_reason=stop_reason)


class VerlServer:
    """vas L595-680, verbatim but for ``self.node_rank`` (0: one node)."""

    def __init__(self, engine: AsyncLLM) -> None:
        self.engine = engine
        self.node_rank = 0

    async def clear_kv_cache(self):
        if self.node_rank == 0:
            await self.engine.reset_prefix_cache()

    async def abort_all_requests(self, reset_prefix_cache: bool = True) -> dict[str, Any]:
        try:
            # Take an atomic snapshot to avoid race conditions with the vLLM engine thread
            request_states_snapshot = list(self.engine.output_processor.request_states.items())
            request_ids = [req_id for req_id, _ in request_states_snapshot]

            if not request_ids:
                return {"aborted_count": 0, "request_ids": []}

            # For each request, create an abort output and put it to its queue
            # This allows the generator to receive the aborted result
            from vllm.v1.engine import FinishReason

            for _, req_state in request_states_snapshot:
                request_output = req_state.make_request_output(
                    [], pooling_output=None, finish_reason=FinishReason.ABORT, stop_reason=None
                )
                req_state.queue.put(request_output)

            # Abort requests in the output processor and engine core
            self.engine.output_processor.abort_requests(request_ids)
            await self.engine.engine_core.abort_requests_async(request_ids)

            # Try to reset prefix cache to ensure clean state
            if reset_prefix_cache:
                await self.clear_kv_cache()
                logger.info("Prefix cache reset after abort")

            logger.info(f"Aborted {len(request_ids)} requests: {request_ids}")
            return {"aborted_count": len(request_ids), "request_ids": request_ids}

        except Exception as e:
            logger.error(f"Error aborting requests: {e}")
            return {"aborted_count": 0, "request_ids": [], "error": str(e)}

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict:
        try:
            request_states = self.engine.output_processor.request_states
            req_state = request_states.get(request_id)

            if req_state is None:
                return {"aborted": False, "error": f"Request {request_id} not found"}

            # Create abort output and put it to the queue
            from vllm.v1.engine import FinishReason

            request_output = req_state.make_request_output(
                [], pooling_output=None, finish_reason=FinishReason.ABORT, stop_reason=None
            )
            req_state.queue.put(request_output)

            # Abort in output processor and engine core
            self.engine.output_processor.abort_requests([request_id])
            await self.engine.engine_core.abort_requests_async([request_id])

            # Try to reset prefix cache to ensure clean state
            if reset_prefix_cache:
                await self.clear_kv_cache()
                logger.info(f"Prefix cache reset after abort request {request_id}")

            logger.info(f"Aborted request: {request_id}")
            return {"aborted": True, "request_id": request_id}

        except Exception as e:
            logger.error(f"Error aborting request {request_id}: {e}")
            return {"aborted": False, "request_id": request_id, "error": str(e)}
