"""Whether the engine can ever serve a sequence: what the scheduler checks before it adds one.

A sequence is refused, in this order, when
    - its prompt exceeds ``max_model_len``;
    - the KV it may need at once (``stopping.max_num_kv_tokens``) exceeds every block of the
      cache: it could not run to completion even alone;
    - its next prefill may not be split (a first prefill with prompt logprobs, computed in one
      step) and its tokens exceed ``max_num_batched_tokens``.
The scheduler raises ``RequestTooLongError`` with the message; nothing changes either way.
"""

from __future__ import annotations

from dormant.engine import stopping
from dormant.engine.batch import SchedulerConfig
from dormant.engine.block_manager import BlockManager
from dormant.engine.sequence import Sequence


def refusal(
    seq: Sequence, config: SchedulerConfig, block_manager: BlockManager, may_chunk: bool
) -> str | None:
    """Why ``seq`` can never be served (a message that says what to change), or None when it
    can. ``may_chunk``: whether its next prefill may be split. No state changes."""
    if seq.num_tokens > config.max_model_len:
        return (
            f"sequence {seq.seq_id} has {seq.num_tokens} prompt tokens, more than "
            f"max_model_len={config.max_model_len}; shorten the prompt"
        )
    num_blocks = block_manager.num_blocks_for(stopping.max_num_kv_tokens(seq, config.max_model_len))
    if num_blocks > block_manager.num_blocks:
        return (
            f"sequence {seq.seq_id} may need {num_blocks} KV blocks (prompt "
            f"{seq.num_prompt_tokens} + max_tokens {seq.params.max_tokens}, capped by "
            f"max_model_len={config.max_model_len}) but the cache has only "
            f"{block_manager.num_blocks}; lower max_tokens or grow the KV cache"
        )
    if not may_chunk and seq.num_tokens > config.max_num_batched_tokens:
        return (
            f"sequence {seq.seq_id} asks for prompt logprobs, which are computed in one "
            f"step, but its {seq.num_tokens} prompt tokens exceed max_num_batched_tokens="
            f"{config.max_num_batched_tokens}; raise it or shorten the prompt"
        )
    return None
