"""The OpenAI-compatible request bodies, as pydantic models: unknown fields are refused
(``extra="forbid"``), and so is a known OpenAI field at a value this server cannot honour
(``echo``, ``best_of``, ``logit_bias``, ``suffix``): refusing beats silently generating
something else. vLLM's extensions are accepted: ``top_k``, ``min_p``, ``min_tokens``,
``repetition_penalty``, ``seed``, ``stop_token_ids``, ``ignore_eos``, ``return_token_ids``,
``skip_special_tokens``, ``include_stop_str_in_output``, ``prompt_logprobs``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from dormant.core.sampling_params import SamplingParams

# Stop strings are matched against every sample's new text at every token: their number and
# length bound that work (OpenAI allows 4; a few dozen covers every RL recipe seen).
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_NAME_CHARS = 256  # a chat message's ``name``
MAX_ID_CHARS = 1024  # a request id chosen by the client


def _encodable(text: str) -> str:
    text.encode("utf-8")  # raises for a lone surrogate (JSON "\ud800"): no tokenizer takes it
    return text


Text = Annotated[str, AfterValidator(_encodable)]
TokenIds = Annotated[list[int], Field(min_length=1)]
StopText = Annotated[Text, Field(max_length=MAX_STOP_CHARS)]
Stop = StopText | Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)] | None
RequestId = Annotated[Text, Field(min_length=1, max_length=MAX_ID_CHARS)]
# Batches of prompts: an empty one has nothing to answer.
Texts = Annotated[list[Text], Field(min_length=1)]
TokenIdLists = Annotated[list[TokenIds], Field(min_length=1)]


class Strict(BaseModel):
    """Unknown fields are refused, and values are not coerced ("yes" is not a bool)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False


# What the chat template's own call sets: a request may not.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "tokenize",
        "chat_template",
        "conversation",
        "messages",
        "return_dict",
        "return_tensors",
        "tools",
    }
)
# The fields a request that leaves them unset takes from the model's generation config.
_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class SamplingFields(Strict):
    """Fields shared by completions and chat, mapped onto ``SamplingParams``."""

    model: str | None = None
    n: int = Field(default=1, ge=1, le=128)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Stop = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False  # vLLM's: logprob tokens as "token_id:<id>"
    user: str | None = None
    logit_bias: dict[str, float] | None = Field(default=None, description="only empty or null")

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, defaults: Mapping[str, Any]
    ) -> SamplingParams:
        """The engine's parameters; ``InvalidSamplingParamsError`` (400) names a bad one. An
        unset temperature, top-p, top-k, min-p or repetition penalty takes ``defaults`` (the
        engine's ``sampling_defaults``, as vLLM's ``to_sampling_params``)."""
        options: dict[str, Any] = {name: defaults[name] for name in _DEFAULTED if name in defaults}
        options |= {
            name: getattr(self, name)
            for name in (
                "n",
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "seed",
                "stop",
                "stop_token_ids",
                "presence_penalty",
                "frequency_penalty",
                "repetition_penalty",
                "min_tokens",
                "ignore_eos",
                "skip_special_tokens",
                "include_stop_str_in_output",
                "prompt_logprobs",
            )
            if getattr(self, name) is not None
        }
        if self.logit_bias:
            options["logit_bias"] = self.logit_bias  # refused by SamplingParams, by name
        return SamplingParams(**options, max_tokens=max_tokens, logprobs=logprobs)


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: ``prompt`` is a string, token ids, or a list of either."""

    prompt: Text | Texts | TokenIds | TokenIdLists
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: Literal[False] = False
    best_of: Literal[1] | None = None
    suffix: Literal[""] | None = None


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant"]
    content: Text
    name: Annotated[Text, Field(max_length=MAX_NAME_CHARS)] | None = None


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``: text messages; the prompt is the chat template's."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # vLLM's: how the chat template renders the messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = Field(default=None, description="only null: the model's")

    def template_kwargs(self) -> dict[str, Any]:
        """vLLM's: the two switches, then ``chat_template_kwargs`` over them (what the
        template reads, e.g. Qwen3's ``enable_thinking``)."""
        if self.chat_template is not None:
            raise ValueError(
                "chat_template from a request is not accepted (as vLLM without "
                "--trust-request-chat-template): leave it out to use the model's, or render "
                "the prompt yourself and send it to /v1/completions"
            )
        kwargs = dict(self.chat_template_kwargs or {})
        reserved = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {reserved}")
        kwargs = {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            **kwargs,
        }
        if kwargs["add_generation_prompt"] and kwargs["continue_final_message"]:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
        return kwargs


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]


class ErrorInfo(BaseModel):
    message: str
    type: str
    code: int


class ErrorResponse(BaseModel):
    """Every error's body."""

    error: ErrorInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dormant"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
