"""What verl's rollout server calls in the abort tests, as verl calls it (read from
volcengine/verl@b178a3cd ``verl/workers/rollout/vllm_rollout/vllm_async_server.py``, ``vas``):
``generate`` (L445-547; no LoRA, no multimodal data), ``abort_all_requests`` and
``abort_request`` (L595-680). ``from vllm.v1.engine import FinishReason`` needs
``dormant.install_as_vllm()`` first."""

from __future__ import annotations

from typing import Any

from dormant import SamplingParams
from dormant.engine.async_llm import AsyncLLM
from dormant.vllm_compat import TokensPrompt


async def verl_generate(
    engine: AsyncLLM, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str
) -> dict[str, Any]:
    """vas L445-547: the server's ``generate``, token ids in and out (``max_tokens`` in
    ``sampling_params`` is verl's response length; no LoRA, no multimodal data)."""
    sampling_params = dict(sampling_params)
    room = engine.max_model_len - len(prompt_ids)
    max_tokens = max(0, min(sampling_params.pop("max_tokens"), room))
    sampling_params["logprobs"] = 0 if sampling_params.pop("logprobs", False) else None
    sampling_params.setdefault("repetition_penalty", 1.0)
    params = SamplingParams(max_tokens=max_tokens, **sampling_params)
    prompt = TokensPrompt(prompt_token_ids=prompt_ids, multi_modal_data={})
    generator = engine.generate(
        prompt=prompt, sampling_params=params, request_id=request_id, lora_request=None,
        priority=0,
    )  # fmt: skip
    final = None
    async for output in generator:
        final = output
    assert final is not None
    completion = final.outputs[0]
    token_ids = list(completion.token_ids)
    log_probs = None
    if params.logprobs is not None:
        log_probs = [lps[token_ids[i]].logprob for i, lps in enumerate(completion.logprobs)]
    assert completion.finish_reason in ("stop", "length", "abort")
    return dict(
        token_ids=token_ids,
        log_probs=log_probs,
        stop_reason="aborted" if completion.finish_reason == "abort" else "completed",
        num_preempted=getattr(completion, "num_preempted", None),
    )


class VerlServer:
    """The calls of verl's ``abort_all_requests`` and ``abort_request`` (vas L595-680), in its
    order and with its arguments and result dicts (written here, not copied): a snapshot of
    ``output_processor.request_states``; per state ``make_request_output([], pooling_output=None,
    finish_reason=FinishReason.ABORT, stop_reason=None)`` put on ``state.queue``; then
    ``output_processor.abort_requests(ids)``, ``await engine_core.abort_requests_async(ids)``
    and ``reset_prefix_cache()``. verl turns any exception into an ``"error"`` entry."""

    def __init__(self, engine: AsyncLLM) -> None:
        self.engine = engine

    async def abort_all_requests(self, reset_prefix_cache: bool = True) -> dict[str, Any]:
        try:
            states = list(self.engine.output_processor.request_states.items())
            ids = [request_id for request_id, _ in states]
            if not ids:
                return {"aborted_count": 0, "request_ids": []}
            await self._abort([state for _, state in states], ids, reset_prefix_cache)
            return {"aborted_count": len(ids), "request_ids": ids}
        except Exception as error:
            return {"aborted_count": 0, "request_ids": [], "error": str(error)}

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict:
        try:
            state = self.engine.output_processor.request_states.get(request_id)
            if state is None:
                return {"aborted": False, "error": f"Request {request_id} not found"}
            await self._abort([state], [request_id], reset_prefix_cache)
            return {"aborted": True, "request_id": request_id}
        except Exception as error:
            return {"aborted": False, "request_id": request_id, "error": str(error)}

    async def _abort(self, states: list[Any], ids: list[str], reset_prefix_cache: bool) -> None:
        from vllm.v1.engine import FinishReason

        for state in states:
            state.queue.put(
                state.make_request_output(
                    [], pooling_output=None, finish_reason=FinishReason.ABORT, stop_reason=None
                )
            )
        self.engine.output_processor.abort_requests(ids)
        await self.engine.engine_core.abort_requests_async(ids)
        if reset_prefix_cache:
            await self.engine.reset_prefix_cache()
