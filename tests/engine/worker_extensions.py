"""Worker extensions for the tests, importable by qualified name in every worker process (the
way verl, OpenRLHF and NeMo-RL ship theirs)."""

from __future__ import annotations

from typing import Any

import torch


class RefitExtension:
    """Refits from a state dict through vLLM's attribute path, as the frameworks' do."""

    model_runner: Any
    rank: int
    device: torch.device

    def refit_from_state_dict(self, state_dict: dict[str, torch.Tensor]) -> int:
        self.model_runner.model.load_weights(list(state_dict.items()))
        return self.rank

    def where_am_i(self) -> tuple[int, str]:
        return self.rank, self.device.type


class ConflictingExtension:
    def sleep(self) -> None:  # the worker has a sleep: the extension may not shadow it
        pass
