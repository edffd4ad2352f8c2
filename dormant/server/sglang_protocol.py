"""SGLang's request bodies (``sglang/srt/managers/io_struct.py``), the fields dormant honours,
strict like the OpenAI ones: an unknown field is a 400, not silently dropped."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from dormant.core.sampling_params import SamplingParams
from dormant.server.protocol import (
    RequestId,
    Stop,
    Strict,
    Text,
    Texts,
    TokenIdLists,
    TokenIds,
)


class SGLangSamplingParams(Strict):
    """SGLang's ``sampling_params`` dict, mapped onto vLLM's names.

    ``spaces_between_special_tokens`` is accepted and changes nothing, as in SGLang with a fast
    tokenizer (its detokenizer passes it to ``batch_decode``, which fast tokenizers ignore;
    dormant's detokenizer is the fast one). slime sends ``False`` with every rollout request.
    """

    max_new_tokens: int | None = Field(default=128, ge=0)  # 0: prefill only (prompt logprobs)
    min_new_tokens: int = Field(default=0, ge=0)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: Stop = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = Field(default=1, ge=1, le=128)
    sampling_seed: int | None = None
    custom_params: dict[str, Any] | None = None  # SGLang's custom logit processor's: refused

    @field_validator("custom_params")
    @classmethod
    def _no_custom_params(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        """SGLang passes ``custom_params`` to a custom logit processor; slime sends
        ``{"return_top_p_token_ids": true}`` whenever top_p < 1, for its top-p replay, which
        needs its patched SGLang's reply keys. dormant has neither: refused, not ignored, so
        that the trainer does not silently train without the replay."""
        if value:
            raise ValueError(
                f"custom_params {sorted(value)} are not supported: dormant runs no custom logit "
                "processors and returns no top-p token ids (slime's top-p replay); send no "
                "custom_params (slime: --rollout-top-p 1.0)"
            )
        return value

    @model_validator(mode="after")
    def _min_within_max(self) -> SGLangSamplingParams:
        """SGLang's ``SamplingParams.verify``: checked on the values asked for, before the
        room beside the prompt caps ``max_new_tokens``."""
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got "
                f"{self.min_new_tokens}"
            )
        return self

    def to_vllm(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None):
        """``max_tokens`` is what fits (None: all the room); ``min_new_tokens`` is capped by it,
        as SGLang stops a sequence whose context is full whatever its minimum."""
        min_tokens = (
            self.min_new_tokens if max_tokens is None else min(self.min_new_tokens, max_tokens)
        )
        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.no_stop_trim,
            seed=self.sampling_seed,
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )


class GenerateRequest(Strict):
    """``POST /generate``: ``text`` or ``input_ids`` (one prompt, or a list of them)."""

    text: Text | Texts | None = None
    input_ids: TokenIds | TokenIdLists | None = None
    sampling_params: SGLangSamplingParams | None = None
    return_logprob: bool = False
    logprob_start_len: int = Field(default=-1, ge=-1)  # -1: none of the prompt's (SGLang's)
    top_logprobs_num: int = Field(default=0, ge=0, le=20)
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: RequestId | None = None

    @field_validator("return_logprob", "logprob_start_len", "top_logprobs_num", mode="before")
    @classmethod
    def _null_is_the_default(cls, value: Any, info: ValidationInfo) -> Any:
        """``null`` means the default, as in SGLang (its fields are Optional)."""
        return cls.model_fields[str(info.field_name)].default if value is None else value


class AbortRequest(Strict):
    """``POST /abort_request``: one ``/generate`` call's requests by its ``rid``, or all."""

    rid: str = ""
    abort_all: bool = False


class UpdateWeightVersionRequest(Strict):
    new_version: Annotated[str, Field(min_length=1)]
    abort_all_requests: bool = True


class TagsRequest(Strict):
    tags: list[str] | None = None


class PauseGenerationRequest(Strict):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class UpdateWeightsFromDiskRequest(Strict):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


class UpdateWeightsFromTensorRequest(Strict):
    serialized_named_tensors: list[Any] = Field(min_length=1)  # one entry per TP rank, or one
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class InitWeightsUpdateGroupRequest(Strict):
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=0)
    world_size: int = Field(ge=1)
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class UpdateWeightsFromDistributedRequest(Strict):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None  # None, or "flattened_bucket": one buffer, back to back


class DestroyWeightsUpdateGroupRequest(Strict):
    group_name: str = "weight_update_group"


class CollectiveRpcRequest(Strict):
    method: str
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout: float | None = None
