"""Typed errors of the model layer."""

from __future__ import annotations

from collections.abc import Sequence

from dormant.errors import EngineError


class UnsupportedModelError(EngineError, ValueError):
    """The checkpoint's architecture or one of its features is not implemented."""


class WeightError(EngineError, ValueError):
    """Checkpoint tensors do not fit the model. ``problems`` lists one line per bad entry."""

    def __init__(self, problems: Sequence[str], hint: str) -> None:
        self.problems = tuple(problems)
        self.hint = hint
        lines = "\n".join(f"  - {p}" for p in self.problems)
        header = f"the checkpoint does not fit the model ({len(self.problems)} problems):"
        super().__init__(f"{header}\n{lines}\n{hint}")

    def __reduce__(self) -> tuple[type, tuple[tuple[str, ...], str]]:
        # Travels back from a tensor-parallel worker as itself.
        return type(self), (self.problems, self.hint)
