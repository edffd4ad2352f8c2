"""The engine: requests in, tokens out, over its workers.

Its sleep state has one owner, ``SleepControl`` (``sleep_control.py``, where the rules are
written down as a table); the memory state per tag lives in each worker's MemoryManager and
reaches the engine as each rank's ``RankSleepState``. ``EngineSleep`` (``engine_sleep.py``)
carries out sleep, pause and wake, in-flight requests first, by mode. Start-up, and what the
engine learns in it, is ``engine_start.py``.

A step (``engine/step_pipeline.py``) schedules, launches and reads back the workers' model
calls; with async scheduling it queues the next call before it reads the one in flight, and
every command to the workers first completes the calls in flight (the drain rule,
``engine/calls_in_flight.py``).

The prefix cache is never stale (DESIGN §3 invariant 10): before each schedule the engine drops
it if any rank's weights or KV changed since (``kv_epoch.py``). ``reset_prefix_cache()`` is for
vLLM's callers; correctness never depends on it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from dormant.core.commands import Command
from dormant.core.config import EngineConfig
from dormant.core.sampling_params import SamplingParams
from dormant.engine.block_manager import BlockManager
from dormant.engine.calls_in_flight import DrainingExecutor
from dormant.engine.engine_sleep import EngineSleep
from dormant.engine.engine_start import (
    EngineRuntime,
    engine_tokenizer,
    scheduler_config,
    start_workers,
)
from dormant.engine.engine_status import EngineMemoryStatus
from dormant.engine.gc_heap import FrozenHeap
from dormant.engine.kv_epoch import CachedKVEpoch
from dormant.engine.model_config_view import ModelConfigView
from dormant.engine.output_processor import OutputProcessor
from dormant.engine.outputs import RequestOutput
from dormant.engine.refits import WeightRefits
from dormant.engine.request_input import Prompt, RequestInput, RequestLimits
from dormant.engine.request_intake import RequestIntake
from dormant.engine.rpc_routes import RpcRoutes
from dormant.engine.scheduler import Scheduler
from dormant.engine.sleep_control import SleepControl
from dormant.engine.spec_stats import SpecDecodeStats
from dormant.engine.step_pipeline import StepPipeline
from dormant.engine.tokenizer import Tokenizer
from dormant.executors import Executor, UniprocExecutor, make_executor
from dormant.worker.refit_record import RefitReport


class LLMEngine:
    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        self.config = config
        self.executor = executor or make_executor(config)
        try:
            started = start_workers(self.executor)
            self.sleep_control = SleepControl(started.ranks)
            # Every command after start-up goes through here: it drains the calls in flight.
            self._commands = DrainingExecutor(self.executor, lambda: self._steps.drain())
            self.refits = WeightRefits(self._commands, self._refresh_sleep_state)
        except BaseException:
            self.executor.shutdown()
            raise
        model = config.model_config
        self.tokenizer: Tokenizer | None = engine_tokenizer(config)
        eos = frozenset(model.eos_token_ids)
        if self.tokenizer is not None:
            eos |= self.tokenizer.eos_token_ids
        num_blocks = started.num_blocks
        self.runtime = EngineRuntime(num_blocks, eos, frozenset(started.weight_names))
        limits = scheduler_config(config, started.max_multi_step_seqs)
        # Speculative decoding's counts over every request (None: off); per request on its
        # sequences (``CompletionOutput.spec_decode_stats``)
        self.spec_decode_stats = SpecDecodeStats() if config.speculative_config else None
        blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(limits, blocks, eos)
        self._kv_epoch = CachedKVEpoch(self.sleep_control, lambda: self.scheduler)
        self.outputs = OutputProcessor(
            self.tokenizer,
            lambda: self.refits.weight_version,
            lambda: tuple(rank.num_weight_writes for rank in self.sleep_control.ranks),
        )
        self._requests = RequestIntake(
            self.tokenizer,
            RequestLimits(model.vocab_size, config.max_model_len, config.max_logprobs),
            config.seed,
            lambda: self.scheduler,
            self.outputs,
        )
        self.model_config = ModelConfigView.of(config)
        self._steps = StepPipeline(
            self.executor,
            config.overlaps_steps,
            lambda: self.scheduler,
            self.outputs,
            self.runtime.eos_token_ids,
            lambda: self.spec_decode_stats,
            prepare=self._prepare_schedule,
        )
        self._sleep = EngineSleep(
            config,
            self._commands,
            self.sleep_control,
            scheduler=lambda: self.scheduler,
            abort_all=lambda: self.abort_request(),
            step=lambda: self.step(),
            refresh=lambda: self._refresh_sleep_state(),
            drain=lambda: self._steps.drain(),
        )
        self._rpc = RpcRoutes(
            self._commands, self.refits, self.sleep_control, self.sleep, self.wake_up,
            self.reload_weights, self.update_weights, self.reset_prefix_cache,
        )  # fmt: skip
        self._heap = FrozenHeap()
        self._heap.freeze()  # last: the start-up's objects are never traversed again

    # ── requests ──────────────────────────────────────────────────────────────────────────────

    def add_request(self, prompt: Prompt, params: SamplingParams) -> int:
        """Queues a request (text, token ids, or ``{"prompt_token_ids": [...]}``); returns its
        id. Bad parameters raise (``InvalidSamplingParamsError``...) and queue nothing.
        Allowed while asleep (it runs after wake)."""
        return self.add_request_input(self.make_request_input(prompt, params))

    def make_request_input(self, prompt: Prompt, params: SamplingParams) -> RequestInput:
        """Tokenizes and validates a request without queuing it (see ``make_request_input``)."""
        return self._requests.make(prompt, params)

    def add_request_input(self, request: RequestInput) -> int:
        """Queues a validated request: ``params.n`` sequences (``RequestIntake.add``)."""
        return self._requests.add(request)

    def abort_request(self, request_ids: Iterable[int] | None = None) -> list[RequestOutput]:
        """Finishes the given requests (all when None) with finish_reason "abort"; returns
        their outputs. Unknown or finished ids are ignored."""
        return self._requests.abort(request_ids)

    def has_unfinished_requests(self) -> bool:
        """Whether ``step`` has work: requests to run, a call in flight to read back, or
        requests a drained call finished that it has yet to return."""
        return self.scheduler.has_unfinished or self._steps.has_work

    @property
    def async_scheduling(self) -> bool:
        """Whether steps overlap: the next call is queued before the host reads one. Settable
        (benchmarks compare both on one engine): it applies from the next step on; True
        raises ``ValueError`` where the calls cannot overlap (Ray actors, ``torchrun`` ranks,
        speculative decoding)."""
        return self._steps.overlaps

    @async_scheduling.setter
    def async_scheduling(self, value: bool) -> None:
        self._steps.overlaps = value

    @property
    def num_calls_in_flight(self) -> int:
        """Model calls launched and not yet read back (at most one between steps, with async
        scheduling; none without)."""
        return len(self._steps)

    def pop_drained_outputs(self) -> list[RequestOutput]:
        """The requests finished by calls that a command drained, once (the drain rule,
        ``engine/calls_in_flight.py``); ``step`` returns them too."""
        return self._steps.pop_drained()

    def request_output(self, request_id: int) -> RequestOutput | None:
        """An unfinished request as it stands (its output so far), for streaming; None once it
        finished (``step`` returned it) or if it is unknown."""
        return self.outputs.output(request_id)

    def check_can_generate(self) -> None:
        """Raises EngineAsleepError / WeightsNotLoadedError if a step cannot run now.

        An in-process worker is asked afresh: its model object is reachable without the engine
        (TRL's ``model.load_weights``), and asking costs a function call. Workers in other
        processes are reached only through commands, which report their state themselves."""
        if isinstance(self.executor, UniprocExecutor):
            self._refresh_sleep_state()
        self.sleep_control.check_can_generate()

    def step(self) -> list[RequestOutput]:
        """Runs one scheduling step; returns the requests that finished in it (and those that
        calls a command drained finished before it: ``pop_drained_outputs``).

        With async scheduling the step reads back the call in flight (launching one first if
        none is) and, before applying its tokens, queues the call after it where its plan
        cannot depend on them (``StepPipeline.step``)."""
        return self._steps.step()

    def _prepare_schedule(self) -> None:
        """Before a batch is scheduled from scratch: the engine can generate, no running
        sequence's KV was discarded, and the prefix cache holds no KV of weights or memory
        since changed."""
        self.check_can_generate()
        self._kv_epoch.recompute_if_discarded()
        self._kv_epoch.invalidate_if_stale()

    # ── sleep and wake ────────────────────────────────────────────────────────────────────────

    @property
    def sleep_level(self) -> int | None:
        return self.sleep_control.level

    def is_sleeping(self) -> bool:
        return self.sleep_control.is_sleeping

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """vLLM's ``LLMEngine.reset_prefix_cache`` (NeMo-RL calls it on ``llm.llm_engine``
        before every sleep): drops every cached block; blocks held by running requests stay
        held and are not cached again. Never needed for correctness (the engine drops cached
        KV itself, see the module docstring); always succeeds."""
        self.scheduler.block_manager.reset_prefix_cache()
        return True

    def sleep(
        self, level: int = 1, mode: str = "abort", release_context: bool = False
    ) -> list[RequestOutput]:
        """Sleeps every rank at ``level`` after handling in-flight requests by ``mode``;
        returns the requests that finished during the call (``EngineSleep.sleep``)."""
        finished = self._sleep.sleep(level, mode, release_context)
        return self.pop_drained_outputs() + finished

    def pause(self, mode: str = "abort") -> list[RequestOutput]:
        """vLLM's ``pause_generation``: stops scheduling, memory untouched (``EngineSleep``)."""
        finished = self._sleep.pause(mode)
        return self.pop_drained_outputs() + finished

    def resume(self) -> None:
        """vLLM's ``resume_generation``: scheduling runs again (kept requests continue).
        Memory that is asleep stays asleep: wake it with ``wake_up``."""
        self.sleep_control.is_paused = False

    def release(self, tags: Sequence[str] | None = None) -> None:
        """Tag-granular sleep (SGLang's ``release_memory_occupation``; ``EngineSleep``)."""
        self._sleep.release(tags)

    def wake_up(self, tags: Sequence[str] | None = None) -> bool:
        """Wakes ``tags`` (all when None) on every rank, each with its group; returns whether
        the engine is now fully awake (``EngineSleep.wake_up``)."""
        return self._sleep.wake_up(tags)

    # ── weights ───────────────────────────────────────────────────────────────────────────────

    def reload_weights(
        self, path: str | None = None, weight_version: str | None = None
    ) -> list[tuple[str, ...]]:
        """Re-reads the checkpoint into the existing weight tensors, on every rank; returns the
        names each rank wrote. The other refit paths are on ``refits`` (``WeightRefits``)."""
        return self.refits.reload_weights(path, weight_version)

    def update_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], weight_version: str | None = None
    ) -> list[tuple[str, ...]]:
        """Refits HF-named tensors in place on every rank (floats cast); validates all of them
        before writing any."""
        return self.refits.update_weights(weights, weight_version)

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """Calls ``method`` on every rank; returns one result per rank, in rank order (vLLM's
        shape). Where each kind of method goes is ``rpc_routes.py``. ``timeout`` is accepted
        for vLLM's callers; commands are bounded by the executor's own timeout."""
        return self._rpc.route(method, tuple(args), kwargs or {})

    # ── the prefix cache ──────────────────────────────────────────────────────────────────────

    def memory_status(self) -> list[EngineMemoryStatus]:
        """Per rank: its ``MemoryStatus``, with the engine's prefix-cache statistics."""
        statuses = self._commands.run(Command.MEMORY_STATUS)
        if isinstance(self.executor, UniprocExecutor):
            self._refresh_sleep_state()
        self._kv_epoch.invalidate_if_stale()
        stats = self.scheduler.block_manager.prefix_cache_stats()
        spec = None if self.spec_decode_stats is None else self.spec_decode_stats.copy()
        return [EngineMemoryStatus.of(status, stats, spec) for status in statuses]

    @property
    def model_executor(self) -> Executor:
        """vLLM's name for the executor (TRL reaches the model through it)."""
        return self.executor

    def shutdown(self) -> None:
        self._heap.unfreeze()  # first: the workers' frees may need cycles collected
        try:
            self._steps.drain()  # no rank frees memory a call in flight still uses
        finally:
            self.executor.shutdown()

    # ── internals ─────────────────────────────────────────────────────────────────────────────

    def _refresh_sleep_state(self, reports: Sequence[RefitReport] | None = None) -> None:
        """Asks every rank for its sleep state, or records what a refit that succeeded on every
        rank reported (``SleepControl.refitted``: only the weight record can have changed)."""
        if reports is None:
            self.sleep_control.update(self.executor.run(Command.SLEEP_STATE))
        else:
            self.sleep_control.refitted(reports)
