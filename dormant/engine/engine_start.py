"""What the engine learns while starting its workers, and what it derives from that.

Start-up runs, on every rank: load the model, count the KV blocks that fit (the engine takes
the MIN over ranks, DESIGN §3 invariant 6), allocate that many and capture the graphs, report
the sleep state. Values found here are not configuration: they go in ``EngineRuntime``, and the
config stays as it was given.
"""

from __future__ import annotations

from dataclasses import dataclass

from dormant.core.commands import Command
from dormant.core.config import EngineConfig
from dormant.core.sleep_state import RankSleepState
from dormant.engine.batch import SchedulerConfig
from dormant.engine.tokenizer import Tokenizer, load_tokenizer
from dormant.executors import Executor


@dataclass(frozen=True)
class EngineRuntime:
    """What the engine learned while starting: sizes and ids that are not configuration."""

    num_kv_blocks: int
    eos_token_ids: frozenset[int]
    weight_names: frozenset[str]


@dataclass(frozen=True)
class WorkersStarted:
    """What the ranks answered while starting."""

    weight_names: tuple[str, ...]  # rank 0's: every checkpoint name a full refit writes
    num_blocks: int  # MIN over the ranks
    max_multi_step_seqs: int  # MIN over the ranks; 0: no fused multi-step graph
    ranks: list[RankSleepState]


def start_workers(executor: Executor) -> WorkersStarted:
    """Loads the model and initialises the KV cache on every rank. Raises ValueError if not
    one KV block fits (the caller shuts the executor down)."""
    weight_names = executor.run(Command.LOAD_MODEL)[0]
    num_blocks = min(executor.run(Command.NUM_AVAILABLE_BLOCKS))  # MIN over ranks
    if num_blocks < 1:
        raise ValueError(
            "no room for a single KV block; raise gpu_memory_utilization or "
            "kv_cache_memory_bytes, or use a smaller model"
        )
    max_multi_step_seqs = min(executor.run(Command.INIT_KV_CACHE, num_blocks))
    ranks = executor.run(Command.SLEEP_STATE)
    return WorkersStarted(weight_names, num_blocks, max_multi_step_seqs, ranks)


def engine_tokenizer(config: EngineConfig) -> Tokenizer | None:
    """The tokenizer of ``config`` (None when skipped; see ``load_tokenizer``)."""
    return load_tokenizer(
        config.model,
        config.model_config.vocab_size,
        tokenizer_dir=config.tokenizer,
        is_random_model=config.load_format == "dummy",
        skip_tokenizer_init=config.skip_tokenizer_init,
        trust_remote_code=config.trust_remote_code,
    )


def scheduler_config(config: EngineConfig, max_multi_step_seqs: int) -> SchedulerConfig:
    """The scheduler's limits: ``config``'s, with the multi-step batch the workers captured
    (with speculative decoding, their fused rounds')."""
    speculative = config.speculative_config
    num_steps = config.cuda_graph_multi_steps if max_multi_step_seqs else 1
    return SchedulerConfig(
        config.max_num_seqs,
        config.max_num_batched_tokens,
        config.max_model_len,
        num_decode_steps=num_steps,
        max_multi_step_seqs=max(max_multi_step_seqs, 1),
        enable_chunked_prefill=config.enable_chunked_prefill is not False,  # None: on
        num_speculative_tokens=speculative.num_speculative_tokens if speculative else 0,
    )
