"""What ``AsyncLLM`` tells without going through its loop, for vLLM's ``EngineClient`` callers,
the server and metrics: its state (weight version, tokenizer, sizes, request counts, vLLM's
metric records, ``output_processor`` and ``engine_core`` as frameworks reach into them), its
health (whether its loop stopped, shut down or failed by itself, and the error every request
and call got then), and the vLLM calls it answers without an engine feature behind them
(multimodal and encoder caches, LoRA adapters, profiler)."""

from __future__ import annotations

from typing import Any

from dormant.core.errors import EngineDeadError, UnsupportedOptionError
from dormant.engine.engine_loop import EngineLoop
from dormant.engine.llm import LLM
from dormant.engine.llm_engine import LLMEngine
from dormant.engine.request_tracker import RequestTracker
from dormant.engine.vllm_internals import EngineCoreView, OutputProcessorView
from dormant.engine.vllm_metrics import Metric, engine_metrics


class EngineClientState:
    """Mixed into ``AsyncLLM``, which sets these four."""

    llm: LLM
    engine: LLMEngine
    _requests: RequestTracker
    _engine_loop: EngineLoop

    # ── state ────────────────────────────────────────────────────────────────────────────────

    @property
    def weight_version(self) -> str:
        """The served weights' version: the engine's one record (``LLM.get_weight_version``)."""
        return self.engine.refits.weight_version

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer (``dormant.engine.tokenizer.Tokenizer``), or None."""
        return self.engine.tokenizer

    def get_tokenizer(self) -> Any:
        """vLLM's: the ``transformers`` tokenizer (``LLM.get_tokenizer``)."""
        return self.llm.get_tokenizer()

    @property
    def device(self) -> str:
        """The device the weights live on ("cuda" or "cpu")."""
        device = str(self.engine.config.device)
        if device == "auto":
            import torch

            return "cuda" if torch.cuda.is_available() else "cpu"
        return device

    @property
    def max_model_len(self) -> int:
        return int(self.engine.config.max_model_len)

    @property
    def vocab_size(self) -> int:
        return int(self.engine.config.model_config.vocab_size)

    @property
    def num_requests(self) -> int:
        """Requests being generated or held (read without the loop: an instant's count)."""
        return self._requests.num_tracked + self._engine_loop.num_held

    @property
    def output_processor(self) -> OutputProcessorView:
        """vLLM's ``AsyncLLM.output_processor``: its request counts (OpenRLHF balances prompts
        over its engines by ``get_num_unfinished_requests()``), ``request_states`` and
        ``abort_requests`` (verl's abort path; ``vllm_internals.py``)."""
        return OutputProcessorView(self._requests, self._engine_loop)

    def get_metrics(self) -> list[Metric]:
        """``LLM.get_metrics`` (vLLM's ``AsyncLLM`` has none: NeMo-RL then reads vLLM's
        process-wide registry, which dormant has not); built between two steps, so this waits
        at most for the step in progress."""
        return self._engine_loop.call_blocking(lambda: engine_metrics(self.engine))

    @property
    def engine_core(self) -> EngineCoreView:
        """vLLM's ``AsyncLLM.engine_core``, for ``abort_requests_async`` (verl's abort path)."""
        return EngineCoreView(self._engine_loop, self._requests)

    # ── health ───────────────────────────────────────────────────────────────────────────────

    @property
    def errored(self) -> bool:
        """Whether the engine stopped: shut down, or its loop failed (then every request and
        call got ``dead_error``)."""
        return self._engine_loop.is_stopped

    @property
    def is_running(self) -> bool:
        return not self.errored

    @property
    def is_stopped(self) -> bool:
        return self.errored

    @property
    def dead_error(self) -> BaseException:
        return self._engine_loop.dead_error or EngineDeadError("the engine is running")

    async def check_health(self) -> None:
        """Raises ``dead_error`` once the engine stopped."""
        if self.errored:
            raise self.dead_error

    # ── vLLM calls with no engine feature behind them ────────────────────────────────────────

    async def reset_mm_cache(self) -> None:
        """vLLM's (verl calls it once the engine is up). dormant serves text-only models, so
        there is no multimodal cache to clear."""

    async def reset_encoder_cache(self) -> None:
        """vLLM's (NeMo-RL calls it after a refit with ``reset_encoder_cache_after_weight_update``):
        the multimodal encoder outputs it drops do not exist in a text-only engine."""

    async def list_loras(self) -> set[int]:
        """vLLM's, on an engine built without LoRA, raises: dormant has no LoRA adapters."""
        raise UnsupportedOptionError(
            "list_loras: LoRA is not enabled (dormant has no LoRA adapters); merge the adapter "
            "into the weights before each refit (verl: actor_rollout_ref.model.lora.merge=True) "
            "and generate with lora_request=None"
        )

    async def start_profile(self, profile_prefix: str | None = None) -> None:
        """vLLM's, with no profiler configured, raises: dormant has no profiler hooks."""
        raise _no_profiler("start_profile")

    async def stop_profile(self) -> None:
        """vLLM's; raises as ``start_profile`` does."""
        raise _no_profiler("stop_profile")


def _no_profiler(call: str) -> UnsupportedOptionError:
    return UnsupportedOptionError(
        f"{call}: dormant has no vLLM profiler; turn the framework's rollout profiler off "
        "(verl: no discrete torch profiler on the rollout), or wrap the calls in "
        "torch.profiler.profile yourself"
    )
