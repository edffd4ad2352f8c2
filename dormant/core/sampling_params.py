"""Per-request sampling parameters (vLLM's names and defaults)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

# Temperatures below this are treated as greedy, as in vLLM: dividing logits by a
# vanishing temperature overflows float32 without changing which token wins.
GREEDY_TEMPERATURE_EPSILON = 1e-5


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each output token of one request, and when to stop.

    Attributes:
        temperature: logits are divided by it before sampling; ``0`` means greedy (argmax).
        top_p: nucleus sampling; keep the smallest set of most likely tokens whose
            probability mass reaches ``top_p``. ``1.0`` keeps every token.
        top_k: keep only the ``top_k`` most likely tokens; ``None`` keeps every token.
        max_tokens: the most output tokens to generate.
        seed: makes random sampling reproducible; ``None`` lets the engine draw one.
        stop_token_ids: generation stops after emitting any of these (the token is kept).
        ignore_eos: keep generating past the model's EOS tokens.

    Invariant: every field is valid once constructed (``__post_init__`` raises
    ``ValueError`` otherwise), and ``stop_token_ids`` is a tuple whatever sequence was given.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not _is_real(self.temperature) or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 keeps every token), got {self.top_p!r}")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            raise ValueError(f"top_k must be an int >= 1, or None to disable, got {self.top_k!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        # Normalising during construction, before anyone can observe the object.
        object.__setattr__(self, "stop_token_ids", _token_id_tuple(self.stop_token_ids))

    @property
    def is_greedy(self) -> bool:
        """Whether the sampler takes the argmax (temperature is zero or vanishingly small)."""
        return self.temperature < GREEDY_TEMPERATURE_EPSILON


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _token_id_tuple(token_ids: Iterable[int]) -> tuple[int, ...]:
    if isinstance(token_ids, str | bytes):
        raise ValueError(f"stop_token_ids must be a sequence of ints, got {token_ids!r}")
    try:
        ids = tuple(token_ids)
    except TypeError:
        raise ValueError(f"stop_token_ids must be a sequence of ints, got {token_ids!r}") from None
    bad = [t for t in ids if not _is_int(t) or t < 0]
    if bad:
        raise ValueError(f"stop_token_ids must be non-negative ints, got invalid ids {bad}")
    return ids
