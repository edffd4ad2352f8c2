"""When a sequence stops, and how much KV it may ever need: vLLM's rules, as plain functions of
the sequence and the engine's limits (the scheduler applies them)."""

from __future__ import annotations

from dormant.engine.sequence import FinishReason, Sequence


def max_tokens(seq: Sequence, max_model_len: int) -> int:
    """``max_tokens``, where None (vLLM's "up to max_model_len") is what fits."""
    limit = seq.params.max_tokens
    return max_model_len if limit is None else limit


def finish_reason(
    seq: Sequence, token_id: int, eos_token_ids: frozenset[int], max_model_len: int
) -> tuple[FinishReason | None, int | None]:
    """Why ``seq`` finishes on its newest token ``token_id``, with vLLM's precedence
    (``check_stop``): past ``min_tokens``, EOS, then a stop token (its ``stop_reason``), then
    length. So a stop token that is also the last token ``max_tokens`` allows is a "stop".
    Length applies before ``min_tokens`` too: a request that cannot reach ``min_tokens`` in
    ``max_model_len`` ends there."""
    params, num_outputs = seq.params, seq.num_output_tokens
    if num_outputs >= params.min_tokens:
        if token_id in eos_token_ids and not params.ignore_eos:
            return FinishReason.STOP, None
        if params.stop_token_ids and token_id in params.stop_token_ids:
            return FinishReason.STOP, token_id
    limit = params.max_tokens
    if num_outputs >= (max_model_len if limit is None else limit):
        return FinishReason.LENGTH, None
    if seq.num_prompt_tokens + num_outputs >= max_model_len:
        return FinishReason.LENGTH, None
    return None, None


def max_num_kv_tokens(seq: Sequence, max_model_len: int) -> int:
    """The most tokens whose KV ``seq`` may ever need at once.

    The last token a sequence gets is sampled but never computed, so it needs KV for at most
    ``max_total - 1`` tokens, and at least its prompt.
    """
    max_total = min(seq.num_prompt_tokens + max_tokens(seq, max_model_len), max_model_len)
    return max(seq.num_prompt_tokens, max_total - 1)
