"""The worker's logprobs of each position in vLLM's shape: ``{token_id: Logprob}``, the chosen
token first (with its own rank), then the top ``k`` the request asked for, each with its text.

``logprobs=0``, what RL rollouts ask, is built inline: one entry, whose text is memoized per id
(a token's ``decode_each`` text is its own, whatever surrounds it).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

from dormant.core.step_output import TokenLogprobs
from dormant.engine.outputs import Logprob, LogprobsOnePosition
from dormant.engine.tokenizer import Tokenizer


class LogprobPositions:
    """Shapes positions; ``tokenizer`` None (``skip_tokenizer_init``) leaves texts None."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}  # ``_text``'s memo: at most one entry per id

    def sampled(
        self,
        request_id: int,
        num_logprobs: int | None,
        token_ids: SequenceOf[int],
        entries: SequenceOf[TokenLogprobs],
    ) -> list[LogprobsOnePosition]:
        """The positions of the tokens a sample appended, for its request's ``logprobs``.

        Raises ``RuntimeError`` if an entry is not for the token sampled there (a worker bug)."""
        k = as_count(num_logprobs)
        positions: list[LogprobsOnePosition] = []
        for token_id, entry in zip(token_ids, entries, strict=True):
            if entry.token_ids[0] != token_id:
                raise RuntimeError(
                    f"request {request_id}: the worker's logprobs are for token "
                    f"{entry.token_ids[0]} but token {token_id} was sampled"
                )
            if k == 0 or len(entry.token_ids) == 1:  # logprobs=0, as RL rollouts ask: built here
                text = self._text(token_id)
                positions.append({token_id: Logprob(entry.logprobs[0], entry.ranks[0], text)})
            else:
                positions.append(self._position(entry, k))
        return positions

    def sampled_first(
        self,
        request_id: int,
        token_ids: SequenceOf[int],
        entry_ids: SequenceOf[int],
        logprobs: SequenceOf[float],
        ranks: SequenceOf[int],
    ) -> list[LogprobsOnePosition]:
        """``sampled``'s positions of entries of which only the first token is reported
        (``logprobs=0``, or none carries top tokens), from their columns: each entry's token,
        logprob and rank. Raises ``RuntimeError`` as ``sampled`` does."""
        if entry_ids != token_ids:  # one comparison of the lists; the loop finds where
            for token_id, entry_id in zip(token_ids, entry_ids, strict=True):
                if entry_id != token_id:
                    raise RuntimeError(
                        f"request {request_id}: the worker's logprobs are for token "
                        f"{entry_id} but token {token_id} was sampled"
                    )
        texts = self._texts
        for token_id in token_ids:
            if token_id not in texts:
                self._text(token_id)  # memoizes it (without a tokenizer there is no text)
        text = texts.get
        return [
            {token_id: Logprob(logprob, rank, text(token_id))}
            for token_id, logprob, rank in zip(token_ids, logprobs, ranks, strict=True)
        ]

    def prompt(
        self, num_logprobs: int | None, entries: SequenceOf[TokenLogprobs]
    ) -> list[LogprobsOnePosition]:
        """The prompt's positions, for the request's ``prompt_logprobs``."""
        k = as_count(num_logprobs)
        return [self._position(entry, k) for entry in entries]

    def _position(self, entry: TokenLogprobs, k: int | None) -> LogprobsOnePosition:
        """The chosen token (its own rank), then the top ``k`` (all when None), as vLLM."""
        num = len(entry.token_ids) if k is None else min(1 + k, len(entry.token_ids))
        token_ids = entry.token_ids[:num]
        texts = (
            self.tokenizer.decode_each(token_ids) if self.tokenizer is not None else [None] * num
        )
        # The chosen token first; re-inserting it from the top-k keeps its position.
        return {
            token_id: Logprob(logprob, rank, text)
            for token_id, logprob, rank, text in zip(
                token_ids, entry.logprobs[:num], entry.ranks[:num], texts, strict=True
            )
        }

    def _text(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode_each((token_id,))[0]
        return text


def as_count(num_logprobs: int | None) -> int | None:
    """The top-k count of a ``logprobs`` value: None for -1 (every entry the worker sent)."""
    if num_logprobs is None or num_logprobs == -1:
        return None
    return int(num_logprobs)  # True counts as 1, as in vLLM
