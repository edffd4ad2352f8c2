"""SGLang's native ``/generate`` (with ``/abort_request``, ``/health_generate`` and, from
``sglang_loads.py``, ``/v1/loads``), in SGLang's reply shape:

    {"text": ..., "output_ids": [...], "meta_info": {
        "id", "finish_reason": {"type": "length", "length": N} | {"type": "stop", "matched": x}
                               | {"type": "abort", "message": ...},
        "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version", "e2e_latency",
        "input_token_logprobs", "output_token_logprobs", ...}}   # return_logprob

(the logprob keys and ``logprob_start_len`` are in ``sglang_logprobs.py``).

One prompt with ``n == 1`` answers an object; a batch (or ``n > 1``) answers a list, prompt-
major. Streams (``"stream": true``) send the cumulative object per step, then ``[DONE]``.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.sse import EventSourceResponse, format_sse_event

from dormant.engine.outputs import CompletionOutput, RequestOutput
from dormant.server import sglang_loads
from dormant.server.errors import BadRequestError, error_body, status_of
from dormant.server.serving import Prepared, Serving
from dormant.server.sglang_logprobs import SGLangLogprobs
from dormant.server.sglang_protocol import AbortRequest, GenerateRequest, SGLangSamplingParams

router = APIRouter()
router.include_router(sglang_loads.router)  # GET /v1/loads


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request) -> Any:
    serving: Serving = request.app.state.serving
    if (body.text is None) == (body.input_ids is None):
        raise BadRequestError("give exactly one of text or input_ids")
    if body.text is not None:
        items: Sequence[str | list[int]] = [body.text] if isinstance(body.text, str) else body.text
    else:
        ids = body.input_ids or []
        items = ids if ids and isinstance(ids[0], list) else [ids]
    is_batch = not (
        isinstance(body.text, str) or (body.input_ids and isinstance(body.input_ids[0], int))
    )
    sampling = body.sampling_params or SGLangSamplingParams()
    serving.check_batch(len(items), sampling.n)
    prompts = [await serving.prepare(item) for item in items]
    logprobs = SGLangLogprobs(
        prompts,
        body.return_logprob,
        body.logprob_start_len,
        body.top_logprobs_num,
        serving.engine.tokenizer,
        body.return_text_in_logprobs,
    )
    is_prefill_only = sampling.max_new_tokens == 0
    max_tokens = _fitting(serving, prompts, 1 if is_prefill_only else sampling.max_new_tokens)
    params = sampling.to_vllm(max_tokens, logprobs.num_output, logprobs.num_prompt)
    rid = body.rid or uuid.uuid4().hex
    job = _Generate(serving, body, prompts, rid, is_prefill_only, logprobs)
    is_list = is_batch or params.n > 1
    if body.stream:
        started = await serving.streams(prompts, params, job.rid)
        return EventSourceResponse(job.events(started))
    outputs = await serving.run(prompts, params, job.rid, request.is_disconnected)
    replies = [job.reply(p, o, c) for p, o in enumerate(outputs) for c in o.outputs]
    return replies if is_list else replies[0]


def _fitting(serving: Serving, prompts: Sequence[Prepared], requested: int | None) -> int | None:
    """SGLang's ``Scheduler.init_req_max_new_tokens``: more new tokens than fit beside a prompt
    are not refused; the sequence gets what fits and finishes by length. This caps by the
    shortest prompt's room; the engine ends a longer prompt's sequences at ``max_model_len``
    itself. None (SGLang's null) is all the room."""
    if requested is None:
        return None
    shortest = min(len(p.token_ids) for p in prompts)
    return min(requested, serving.max_model_len - shortest)


@router.post("/abort_request")
async def abort_request(body: AbortRequest, request: Request) -> Response:
    """SGLang's: aborts the ``/generate`` call with this ``rid`` (all its prompts and samples;
    SGLang matches any rid it prefixes, dormant the call's own), or every request. They answer
    with what they generated so far and finish_reason ``{"type": "abort"}``."""
    if not body.abort_all and not body.rid:
        raise BadRequestError('give the rid of a /generate call, or "abort_all": true')
    await request.app.state.serving.abort(None if body.abort_all else body.rid)
    return Response(status_code=200)


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """200 once the engine generated one token; 503 (with the reason) if it cannot now."""
    serving: Serving = request.app.state.serving
    params = SGLangSamplingParams(max_new_tokens=1, temperature=0.0).to_vllm(1, None, None)
    await serving.run([serving.check_ids([0], None)], params, f"health-{uuid.uuid4().hex}")
    return Response(status_code=200)


class _Generate:
    def __init__(
        self,
        serving: Serving,
        body: GenerateRequest,
        prompts: list[Prepared],
        rid: str,
        is_prefill_only: bool,
        logprobs: SGLangLogprobs,
    ) -> None:
        self.serving, self.body, self.prompts, self.rid = serving, body, prompts, rid
        self.is_prefill_only, self.logprobs = is_prefill_only, logprobs
        self.started = time.perf_counter()
        self.version = serving.engine.weight_version

    def reply(self, p: int, output: RequestOutput, completion: CompletionOutput) -> dict[str, Any]:
        if self.is_prefill_only:
            completion = _unsampled(completion)
        meta: dict[str, Any] = {
            "id": f"{self.rid}-{p}-{completion.index}" if len(self.prompts) > 1 else self.rid,
            "finish_reason": _finish_reason(completion),
            "prompt_tokens": len(output.prompt_token_ids),
            "completion_tokens": len(completion.token_ids),
            "cached_tokens": output.num_cached_tokens,
            "weight_version": self.version,
            "e2e_latency": time.perf_counter() - self.started,
        }
        if self.body.return_logprob:
            meta.update(self.logprobs.fields(p, output, completion))
        return {
            "text": completion.text,
            "output_ids": list(completion.token_ids),
            "meta_info": meta,
        }

    async def events(self, started: Any) -> AsyncIterator[bytes]:
        try:
            async for p, output in self.serving.merged(started):
                for completion in output.outputs:
                    chunk = self.reply(p, output, completion)
                    chunk["index"] = p * len(output.outputs) + completion.index
                    yield format_sse_event(data_str=json.dumps(chunk))
        except Exception as error:  # the stream has started: the error is its last event
            body = error_body(str(error), type(error).__name__, status_of(error))
            yield format_sse_event(data_str=json.dumps(body))
        yield format_sse_event(data_str="[DONE]")


def _unsampled(completion: CompletionOutput) -> CompletionOutput:
    """SGLang's ``max_new_tokens=0`` (slime scores a prompt with it): the request ran with one
    token, which is dropped; it finishes by length 0 (or by an abort)."""
    reason = completion.finish_reason
    return dataclasses.replace(
        completion,
        text="",
        token_ids=[],
        logprobs=None if completion.logprobs is None else [],
        finish_reason=reason if reason in (None, "abort") else "length",
        stop_reason=None,
    )


def _finish_reason(completion: CompletionOutput) -> dict[str, Any] | None:
    reason = completion.finish_reason
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": len(completion.token_ids)}
    if reason == "abort":
        return {"type": "abort", "message": "the request was aborted"}
    matched = completion.stop_reason
    if matched is None and completion.token_ids:
        matched = completion.token_ids[-1]  # an EOS token
    return {"type": "stop", "matched": matched}
