"""A refit under a policy, so that no completion mixes two weight versions.

A refit (``update_weights``, ``reload_weights``, ...) runs on the engine loop between two steps.
By policy it first waits for the running requests to finish (``"wait"``, ``AsyncLLM``'s
default) or aborts them (``"abort"``). A request that is paused or kept asleep with tokens
already generated cannot be drained, so a refit aborts it under both policies; kept requests
with no output yet simply run on the new weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dormant.engine.engine_loop import EngineLoop
from dormant.engine.llm_engine import LLMEngine
from dormant.engine.request_tracker import RequestTracker

REFIT_POLICIES = ("wait", "abort")


def check_refit_policy(policy: str, name: str = "refit policy") -> None:
    """Raises ``ValueError`` unless ``policy`` is one of ``REFIT_POLICIES``."""
    if policy not in REFIT_POLICIES:
        raise ValueError(f"{name} must be one of {REFIT_POLICIES}, got {policy!r}")


async def refit_between_steps(
    engine_loop: EngineLoop,
    requests: RequestTracker,
    engine: LLMEngine,
    write: Callable[[], Any],
    policy: str,
    weight_version: str | None,
) -> Any:
    """Runs ``write`` (anything that changes weights) on the loop once no request could mix
    versions, under ``policy`` (checked first: ``ValueError``, nothing runs); returns what it
    returns. Sets the engine's ``weight_version`` after ``write`` succeeded, when given."""
    check_refit_policy(policy)

    def apply() -> Any:
        requests.abort_engine_ids(requests.ids_with_tokens() if policy == "wait" else None)
        result = write()
        if weight_version is not None:
            engine.refits.weight_version = weight_version
        return result

    return await engine_loop.settled(policy, apply)
