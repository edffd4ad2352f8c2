"""``LLM(..., speculative_config={...})``: speculative decoding, with vLLM's keys.

| key                        | accepted                            | meaning                 |
|----------------------------|-------------------------------------|-------------------------|
| method                     | "draft_model" (the default with a   | who proposes drafts     |
|                            | "model"), "mtp"                     |                         |
| model                      | a HF directory, or a ``ModelConfig``| the draft model         |
|                            | (random weights, seeded as the      | ("draft_model" only)    |
|                            | target)                             |                         |
| num_speculative_tokens     | int >= 1                            | drafts per step (k)     |
| draft_tensor_parallel_size | None, or the target's TP size       | sharded as the target   |
| draft_sample_method        | "greedy" (vLLM's default),          | how a random request's  |
|                            | "probabilistic"                     | drafts are drawn        |
| quantization, revision,    | None                                | the draft as on disk    |
| code_revision              |                                     |                         |
| max_model_len              | None, or >= the engine's            | the engine's applies    |
| enforce_eager              | None or a bool                      | True: no graphs for the |
|                            |                                     | drafts and verification |
| disable_logprobs,          | a bool                              | logprobs are the        |
| disable_log_stats          |                                     | target's; stats kept    |

Any other key, and any other method ("ngram", "eagle", "medusa"...), raises
``UnsupportedOptionError`` naming what is supported.

Self-speculation is ``{"model": <the target's own path>}``: the draft is a second copy of the
target (every draft is accepted under greedy decoding).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from dormant.core.errors import UnsupportedOptionError
from dormant.models import ModelConfig
from dormant.models.mtp import MTP_ARCHITECTURES, num_mtp_layers

SpeculativeMethod = Literal["draft_model", "mtp"]
DraftSampleMethod = Literal["greedy", "probabilistic"]
# Accepted with only the value that changes nothing in dormant.
_NEUTRAL_NONE = ("quantization", "revision", "code_revision")
_NEUTRAL_BOOL = ("disable_logprobs", "disable_log_stats")
_KNOWN_KEYS = frozenset(
    {
        "method", "model", "num_speculative_tokens", "draft_tensor_parallel_size",
        "draft_sample_method", "max_model_len", "enforce_eager",
        *_NEUTRAL_NONE, *_NEUTRAL_BOOL,
    }
)  # fmt: skip


@dataclass(frozen=True)
class SpeculativeConfig:
    """A validated speculative configuration.

    ``draft_model_config`` is the draft's model config ("draft_model"), or None ("mtp": the
    MTP layers come from the target's checkpoint). ``draft_path`` is the draft's checkpoint
    directory, or None for a random draft (seeded by the engine's ``seed``, as the target).
    """

    method: SpeculativeMethod
    num_speculative_tokens: int
    draft_model_config: ModelConfig | None = None
    draft_path: str | None = None
    draft_sample_method: DraftSampleMethod = "greedy"
    # The draft is the target itself: its checkpoint path, or (random weights) its config
    is_self_speculation: bool = False
    # vLLM's override: True runs drafting and verification eagerly even where the engine
    # captures graphs (None: as the engine)
    enforce_eager: bool | None = None

    @classmethod
    def create(
        cls,
        options: Mapping[str, Any],
        *,
        target_path: str | None,
        target_config: ModelConfig,
        tensor_parallel_size: int,
        max_model_len: int,
    ) -> SpeculativeConfig:
        """Resolves vLLM's ``speculative_config`` dict against the target. Raises
        ``UnsupportedOptionError`` for unknown keys, unsupported methods or values, and a
        draft whose vocabulary differs from the target's."""
        if not isinstance(options, Mapping):
            raise UnsupportedOptionError(
                f"speculative_config must be a dict of vLLM's keys, got {type(options).__name__}"
            )
        unknown = sorted(set(options) - _KNOWN_KEYS)
        if unknown:
            raise UnsupportedOptionError(
                f"speculative_config keys {unknown} are not supported; supported: "
                f"{sorted(_KNOWN_KEYS)}"
            )
        _check_neutral(options, tensor_parallel_size, max_model_len)
        model = options.get("model")
        method = options.get("method") or ("draft_model" if model is not None else None)
        if method not in get_args(SpeculativeMethod):
            raise UnsupportedOptionError(
                f"speculative_config method={method!r} is not supported; supported: "
                "'draft_model' (give 'model': a draft checkpoint with the target's vocabulary, "
                "or the target's own path for self-speculation) and 'mtp' (a checkpoint whose "
                "config carries MTP layers)"
            )
        k = options.get("num_speculative_tokens")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise UnsupportedOptionError(
                f"speculative_config needs num_speculative_tokens, an int >= 1; got {k!r}"
            )
        sample_method = options.get("draft_sample_method", "greedy")
        if sample_method not in get_args(DraftSampleMethod):
            raise UnsupportedOptionError(
                f"draft_sample_method={sample_method!r} is not supported; supported: "
                f"{get_args(DraftSampleMethod)}"
            )
        if method == "mtp":
            if model is not None:
                raise UnsupportedOptionError(
                    "method 'mtp' takes its MTP layers from the target's checkpoint; drop "
                    f"'model' ({model!r}) or use method 'draft_model'"
                )
            if num_mtp_layers(target_config) == 0:
                raise UnsupportedOptionError(
                    f"method 'mtp' needs a checkpoint whose config carries MTP layers in a layout "
                    f"dormant builds ({', '.join(MTP_ARCHITECTURES)} with "
                    f"num_nextn_predict_layers >= 1); {target_config.architecture} has none"
                )
            return cls(
                "mtp", k, draft_sample_method=sample_method,
                enforce_eager=options.get("enforce_eager"),
            )  # fmt: skip
        if model is None:
            raise UnsupportedOptionError(
                "method 'draft_model' needs 'model': the draft's checkpoint directory"
            )
        draft_config, draft_path = _draft_model(model, target_config)
        if draft_config.vocab_size != target_config.vocab_size:
            raise UnsupportedOptionError(
                f"the draft's vocabulary ({draft_config.vocab_size} tokens) differs from the "
                f"target's ({target_config.vocab_size}); a draft must share the target's "
                "tokenizer"
            )
        if draft_config.max_position_embeddings < max_model_len:
            raise UnsupportedOptionError(
                f"the draft's max_position_embeddings={draft_config.max_position_embeddings} "
                f"is below max_model_len={max_model_len}; lower max_model_len"
            )
        if draft_path is None:
            is_self = target_path is None and draft_config == target_config
        else:
            is_self = target_path is not None and (
                Path(draft_path).resolve() == Path(target_path).resolve()
            )
        return cls(
            "draft_model",
            k,
            draft_model_config=draft_config,
            draft_path=draft_path,
            draft_sample_method=sample_method,
            is_self_speculation=is_self,
            enforce_eager=options.get("enforce_eager"),
        )


def _draft_model(model: Any, target: ModelConfig) -> tuple[ModelConfig, str | None]:
    """The draft's config in the target's dtype, and its checkpoint path (None: random)."""
    from dataclasses import replace

    if isinstance(model, ModelConfig):
        return replace(model, dtype=target.dtype), None
    if not isinstance(model, str | Path):
        raise UnsupportedOptionError(
            f"speculative_config model must be a checkpoint directory, got {model!r}"
        )
    path = str(model)
    return replace(ModelConfig.from_pretrained(path), dtype=target.dtype), path


def _check_neutral(options: Mapping[str, Any], tensor_parallel_size: int, max_len: int) -> None:
    """vLLM's keys that dormant accepts only with a value that changes nothing."""
    for name in _NEUTRAL_NONE:
        if options.get(name) is not None:
            raise UnsupportedOptionError(
                f"speculative_config {name}={options[name]!r} is not supported: the draft is "
                "loaded as it is on disk; pass None"
            )
    for name in _NEUTRAL_BOOL:
        if name in options and not isinstance(options[name], bool):
            raise UnsupportedOptionError(f"speculative_config {name} must be a bool")
    draft_tp = options.get("draft_tensor_parallel_size")
    if draft_tp is not None and draft_tp != tensor_parallel_size:
        raise UnsupportedOptionError(
            f"draft_tensor_parallel_size={draft_tp!r}: dormant shards the draft as the target "
            f"(tensor_parallel_size={tensor_parallel_size}); pass None or that value"
        )
    draft_len = options.get("max_model_len")
    if draft_len is not None and draft_len < max_len:
        raise UnsupportedOptionError(
            f"speculative_config max_model_len={draft_len} is below the engine's {max_len}: "
            "dormant speculates at every length; pass None"
        )
    if options.get("enforce_eager") not in (None, True, False):
        raise UnsupportedOptionError("speculative_config enforce_eager must be None or a bool")
