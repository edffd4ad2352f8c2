"""One completion's tokens, lifecycle state and KV block table (a request with ``n`` samples has
``n`` sequences)."""

from __future__ import annotations

import enum
import itertools
import random
from collections.abc import Iterable
from typing import TYPE_CHECKING

from dormant.core.sampling_params import SamplingParams
from dormant.errors import EngineError

if TYPE_CHECKING:
    from dormant.engine.spec_stats import SpecDecodeStats

# Seeds drawn for unseeded requests are uniform over the 64-bit range the sampler hashes.
_NUM_SEED_BITS = 64


class SequenceStatus(enum.Enum):
    """Where a sequence is in its lifecycle.

    WAITING -> RUNNING (scheduled for prefill) -> FINISHED, with RUNNING -> WAITING on
    preemption. FINISHED is terminal.
    """

    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class FinishReason(enum.StrEnum):
    """Why a sequence finished (the values are the OpenAI/vLLM ``finish_reason`` strings)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class Sequence:
    """One completion of a request: its prompt, the tokens generated so far, and where its KV
    lives.

    ``stop_reason`` is the stop token id or stop string that finished it (vLLM's), else None.

    Prefix-cache bookkeeping (``engine/prefix_cache.py``): ``block_hashes`` are the hashes of
    its first full blocks, computed once each as it grows; ``num_published_blocks`` how many
    leading blocks of its table were offered to the cache, in ``cache_epoch`` (the cache's
    epoch when it was given blocks; after a reset it publishes nothing more). And
    ``num_cached_tokens``: the tokens its first prefill found cached (None before it).

    Speculative decoding: ``num_draft_computed_tokens`` positions have exact draft KV (``<=
    num_computed_tokens``; reset with it), and ``spec_decode_stats`` counts its drafts (None
    before its first).

    Invariants:
        - ``prompt_token_ids`` is non-empty and never changes.
        - ``0 <= num_computed_tokens <= num_tokens``: positions ``0 .. num_computed_tokens-1``
          have their KV in the cache, in the blocks of ``block_table``.
        - ``finish_reason is not None`` exactly when ``status is SequenceStatus.FINISHED``.
    """

    def __init__(
        self,
        seq_id: int,
        prompt_token_ids: Iterable[int],
        params: SamplingParams,
        seed: int,
    ) -> None:
        """Create a WAITING sequence with no output, no blocks and no computed KV.

        ``seed`` is the one the sampler uses: ``params.seed`` when the request set one.
        Raises ``ValueError`` for an empty prompt or negative token ids.
        """
        prompt = tuple(prompt_token_ids)
        if not prompt:
            raise ValueError(
                f"sequence {seq_id}: the prompt is empty; pass at least one token (e.g. BOS)"
            )
        if min(prompt) < 0:
            raise ValueError(f"sequence {seq_id}: prompt token ids must be >= 0")
        self.seq_id = seq_id
        self.prompt_token_ids: tuple[int, ...] = prompt
        self.output_token_ids: list[int] = []
        self.params = params
        self.seed = seed
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.block_table: list[int] = []
        self._block_table_tuple: tuple[tuple[int, ...], list[int]] = ((), self.block_table)
        self.num_computed_tokens = 0
        self.stop_reason: int | str | None = None
        self.block_hashes: list[bytes] = []
        self.num_published_blocks = 0
        self.cache_epoch = 0
        self.num_cached_tokens: int | None = None
        self.num_draft_computed_tokens = 0
        self.spec_decode_stats: SpecDecodeStats | None = None

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id}, status={self.status.name}, "
            f"num_prompt_tokens={self.num_prompt_tokens}, "
            f"num_output_tokens={self.num_output_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens}, "
            f"num_blocks={len(self.block_table)})"
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        """The token the next decode step feeds to the model."""
        if self.output_token_ids:
            return self.output_token_ids[-1]
        return self.prompt_token_ids[-1]

    @property
    def token_ids(self) -> list[int]:
        """A new list of the prompt followed by the output (O(num_tokens): not for per-step use)."""
        return [*self.prompt_token_ids, *self.output_token_ids]

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """The tokens at positions ``start .. end-1`` (prompt, then output), without copying
        the rest."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return list(self.prompt_token_ids[start:end])
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return [*self.prompt_token_ids[start:], *self.output_token_ids[: end - num_prompt]]

    def block_table_tuple(self) -> tuple[int, ...]:
        """``tuple(block_table)``, made again only when the table changed: a table only grows
        at its end, until ``clear_block_table`` empties it, so the one made last stays right
        while the same list has the same length."""
        made, table = self._block_table_tuple
        if table is not self.block_table or len(made) != len(table):
            made = tuple(self.block_table)
            self._block_table_tuple = made, self.block_table
        return made

    def clear_block_table(self) -> None:
        """Empty ``block_table`` (its blocks were freed), and forget the tuple made of it."""
        self.block_table.clear()
        self._block_table_tuple = (), self.block_table

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        """Append one sampled token. Precondition: the sequence is not finished."""
        if self.is_finished:
            raise SequenceFinishedError(
                f"cannot append token {token_id} to finished {self!r} "
                f"(finish_reason={self.finish_reason})"
            )
        self.output_token_ids.append(token_id)

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        """Mark the sequence FINISHED. The caller frees its blocks."""
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason


class SequenceFinishedError(EngineError):
    """An operation needs an unfinished sequence but got a finished one."""


class SequenceFactory:
    """Creates sequences with unique ids and, for unseeded requests, fresh random seeds.

    Whoever creates requests owns one factory; ids are unique per factory, starting at
    ``first_seq_id``. Pass ``rng`` (e.g. ``random.Random(0)``) to make drawn seeds
    reproducible; by default they come from OS entropy.
    """

    def __init__(self, rng: random.Random | None = None, first_seq_id: int = 0) -> None:
        self._seq_ids = itertools.count(first_seq_id)
        self._rng = rng if rng is not None else random.Random()

    def create(
        self, prompt_token_ids: Iterable[int], params: SamplingParams, index: int = 0
    ) -> Sequence:
        """A new WAITING sequence for sample ``index`` of a request; its seed is
        ``params.seed + index`` (vLLM's child seeds) or a freshly drawn one."""
        if params.seed is not None:
            seed = params.seed + index
        else:
            seed = self._rng.getrandbits(_NUM_SEED_BITS)
        return Sequence(next(self._seq_ids), prompt_token_ids, params, seed)
