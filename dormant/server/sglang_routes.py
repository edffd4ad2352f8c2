"""SGLang's native ``/generate`` (with ``/abort_request`` and ``/health_generate``), in SGLang's
reply shape:

    {"text": ..., "output_ids": [...], "meta_info": {
        "id", "finish_reason": {"type": "length", "length": N} | {"type": "stop", "matched": x}
                               | {"type": "abort", "message": ...},
        "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version", "e2e_latency",
        "output_token_logprobs": [[logprob, token_id, text or None], ...],   # return_logprob
        "output_top_logprobs": [[[logprob, token_id, text or None], ...], ...],
        "input_token_logprobs": [[logprob or None, token_id, text or None], ...]}}

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
from dormant.server.errors import BadRequestError, error_body, status_of
from dormant.server.responses import token_texts
from dormant.server.serving import Prepared, Serving
from dormant.server.sglang_protocol import AbortRequest, GenerateRequest, SGLangSamplingParams

router = APIRouter()


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
    logprobs = body.top_logprobs_num if body.return_logprob else None
    prompt_logprobs = logprobs if body.return_logprob and body.logprob_start_len >= 0 else None
    is_prefill_only = sampling.max_new_tokens == 0
    max_tokens = serving.max_tokens(prompts, 1 if is_prefill_only else sampling.max_new_tokens)
    params = sampling.to_vllm(max_tokens, logprobs, prompt_logprobs)
    job = _Generate(serving, body, prompts, body.rid or uuid.uuid4().hex, is_prefill_only)
    is_list = is_batch or params.n > 1
    if body.stream:
        started = await serving.streams(prompts, params, job.rid)
        return EventSourceResponse(job.events(started))
    outputs = await serving.run(prompts, params, job.rid, request.is_disconnected)
    replies = [job.reply(p, o, c) for p, o in enumerate(outputs) for c in o.outputs]
    return replies if is_list else replies[0]


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
    ) -> None:
        self.serving, self.body, self.prompts, self.rid = serving, body, prompts, rid
        self.is_prefill_only = is_prefill_only
        self.started = time.perf_counter()
        self.tokenizer = serving.engine.tokenizer
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
            meta.update(self._logprobs(output, completion))
        return {
            "text": completion.text,
            "output_ids": list(completion.token_ids),
            "meta_info": meta,
        }

    def _logprobs(self, output: RequestOutput, completion: CompletionOutput) -> dict[str, Any]:
        ids = list(completion.token_ids)
        positions = completion.logprobs or []
        chosen = [[pos[t].logprob, t, None] for t, pos in zip(ids, positions, strict=False)]
        result: dict[str, Any] = {"output_token_logprobs": chosen}
        if self.body.top_logprobs_num > 0:  # as SGLang: the key only when asked for
            num = self.body.top_logprobs_num
            by_rank = [sorted(pos.items(), key=lambda i: i[1].rank or 0) for pos in positions]
            result["output_top_logprobs"] = [
                [[lp.logprob, t, None] for t, lp in ranked if 0 < (lp.rank or 0) <= num]
                for ranked in by_rank
            ]
        if self.body.logprob_start_len >= 0:
            prompt_ids = list(output.prompt_token_ids)
            prompt_lps = output.prompt_logprobs or [None] * len(prompt_ids)
            result["input_token_logprobs"] = [
                [None if pos is None else pos[t].logprob, t, None]
                for t, pos in list(zip(prompt_ids, prompt_lps, strict=False))[
                    self.body.logprob_start_len :
                ]
            ]
        if self.body.return_text_in_logprobs:
            for key in ("output_token_logprobs", "input_token_logprobs"):
                entries = result.get(key, [])
                texts = token_texts(self.tokenizer, [e[1] for e in entries])
                for entry, text in zip(entries, texts, strict=True):
                    entry[2] = text
        return result

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
