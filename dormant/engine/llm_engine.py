"""The engine: requests in, tokens out, and the sleep state machine over its workers.

Sleep state (per engine; memory state per tag lives in each worker's MemoryManager)::

    request          awake                    asleep at level L          asleep at level L' ≠ L
    sleep(L)         handle in-flight (mode),  re-sleep woken tags        SleepLevelConflictError
                     sleep every rank at L     (idempotent)               (nothing changes)
    wake_up(tags)    no-op                     wake tags on every rank    wake tags on every rank
    step/generate    run                       EngineAsleepError          EngineAsleepError

After a level-2 sleep the weights are stale until every one of them was rewritten by
``reload_weights`` or ``update_weights``; stepping before that raises WeightsNotLoadedError.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dormant.core.commands import PUBLIC_RPC, Command
from dormant.core.config import EngineConfig
from dormant.core.errors import (
    EngineAsleepError,
    SleepLevelConflictError,
    SleepModeDisabledError,
    UnknownRpcMethodError,
    WeightsNotLoadedError,
)
from dormant.core.sampling_params import SamplingParams
from dormant.engine.batch import SchedulerConfig
from dormant.engine.block_manager import BlockManager
from dormant.engine.outputs import CompletionOutput, RequestOutput
from dormant.engine.scheduler import Scheduler
from dormant.engine.sequence import Sequence as Seq
from dormant.engine.sequence import SequenceFactory
from dormant.engine.tokenizer import Tokenizer, load_tokenizer
from dormant.executors import Executor, make_executor
from dormant.memory import CUDA_GRAPH, KV_CACHE, LEVELS, RUNTIME, WEIGHTS, WORKSPACE, Policy

SLEEP_LEVELS = (0, 1, 2)
# What waking one of vLLM's tags also wakes: a refit writes weights and checkpoint k/v scales
# (runtime buffers); generating needs the KV cache, the runtime state, graph pools and scratch.
WAKE_GROUPS: dict[str, tuple[str, ...]] = {
    WEIGHTS: (WEIGHTS, RUNTIME),
    KV_CACHE: (KV_CACHE, RUNTIME, CUDA_GRAPH, WORKSPACE),
}
SLEEP_MODES = ("abort", "wait", "keep")


@dataclass(frozen=True)
class EngineRuntime:
    """What the engine learned while starting: sizes and ids that are not configuration."""

    num_kv_blocks: int
    eos_token_ids: frozenset[int]
    weight_names: frozenset[str]


class LLMEngine:
    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        self.config = config
        self.executor = executor or make_executor(config)
        try:
            weight_names = self.executor.run(Command.LOAD_MODEL)[0]
            num_blocks = min(self.executor.run(Command.NUM_AVAILABLE_BLOCKS))  # MIN over ranks
            if num_blocks < 1:
                raise ValueError(
                    "no room for a single KV block; raise gpu_memory_utilization or "
                    "kv_cache_memory_bytes, or use a smaller model"
                )
            max_multi_step_seqs = min(self.executor.run(Command.INIT_KV_CACHE, num_blocks))
        except BaseException:
            self.executor.shutdown()
            raise
        model = config.model_config
        self.tokenizer: Tokenizer = load_tokenizer(
            config.tokenizer or config.model, model.vocab_size
        )
        eos = frozenset(model.eos_token_ids) | self.tokenizer.eos_token_ids
        self.runtime = EngineRuntime(num_blocks, eos, frozenset(weight_names))
        limits = SchedulerConfig(
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.max_model_len,
            num_decode_steps=config.cuda_graph_multi_steps if max_multi_step_seqs else 1,
            max_multi_step_seqs=max(max_multi_step_seqs, 1),
        )
        self.scheduler = Scheduler(limits, BlockManager(num_blocks, config.block_size), eos)
        self._sequences = SequenceFactory(random.Random(config.seed))
        self._prompts: dict[int, str | None] = {}
        self._sleep_level: int | None = None
        self._asleep: dict[str, str] = {}
        self._stale_weights: set[str] = set()

    # ── requests ──────────────────────────────────────────────────────────────────────────────

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams) -> int:
        """Queues a request; returns its id. Allowed while asleep (it runs after wake)."""
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
        seq = self._sequences.create(token_ids, params)
        self.scheduler.add(seq)
        self._prompts[seq.seq_id] = text
        return seq.seq_id

    def abort_request(self, request_ids: Iterable[int] | None = None) -> list[RequestOutput]:
        return [self._output(seq) for seq in self.scheduler.abort(request_ids)]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    def request_output(self, request_id: int) -> RequestOutput | None:
        """An unfinished request as it stands (its output so far), for streaming; None once it
        finished (``step`` returned it) or if it is unknown."""
        seq = self.scheduler.unfinished(request_id)
        return None if seq is None else self._output(seq)

    def check_can_generate(self) -> None:
        """Raises EngineAsleepError / WeightsNotLoadedError if a step cannot run now."""
        if self._sleep_level == 0:
            raise EngineAsleepError("scheduling is paused by sleep(level=0); call wake_up()")
        if self._asleep:
            raise EngineAsleepError(
                f"the engine is asleep (level {self._sleep_level}); tags still asleep: "
                f"{sorted(self._asleep)}. Call wake_up() (or wake_up([...]) for each) first."
            )
        if self._stale_weights:
            some = ", ".join(sorted(self._stale_weights)[:3])
            raise WeightsNotLoadedError(
                f"{len(self._stale_weights)} of {len(self.runtime.weight_names)} weights were "
                f"discarded by sleep(level=2) and not refit since (e.g. {some}). Call "
                "reload_weights() or update_weights(...) with all of them before generating."
            )

    def step(self) -> list[RequestOutput]:
        """Runs one scheduling step; returns the requests that finished in it."""
        if not self.scheduler.has_unfinished:
            return []
        self.check_can_generate()
        batch = self.scheduler.schedule()
        assert batch is not None
        step = batch.step_input(self.runtime.eos_token_ids)
        try:
            if batch.num_steps > 1:  # greedy decode: the fused multi-step graph
                output = self.executor.execute_multi_step(step)
            else:
                output = self.executor.execute(step)
        except BaseException:
            self.scheduler.preempt_all()  # the step is redone from recomputed KV
            raise
        tokens = [list(seq.token_ids) for seq in output.seqs]
        return [self._output(seq) for seq in self.scheduler.postprocess_steps(batch, tokens)]

    # ── sleep and wake ────────────────────────────────────────────────────────────────────────

    @property
    def sleep_level(self) -> int | None:
        return self._sleep_level

    def is_sleeping(self) -> bool:
        return self._sleep_level is not None

    def sleep(self, level: int = 1, mode: str = "abort") -> list[RequestOutput]:
        """Sleeps every rank at ``level`` after handling in-flight requests by ``mode``:
        ``abort`` finishes them (finish_reason "abort"), ``wait`` runs them to completion
        first, ``keep`` pauses them and resumes them after wake. Returns the requests that
        finished during the call (aborted or drained)."""
        if not self.config.enable_sleep_mode:
            raise SleepModeDisabledError("sleep() needs LLM(..., enable_sleep_mode=True)")
        if level not in SLEEP_LEVELS:
            raise ValueError(f"sleep level must be one of {SLEEP_LEVELS}, got {level!r}")
        if mode not in SLEEP_MODES:
            raise ValueError(f"sleep mode must be one of {SLEEP_MODES}, got {mode!r}")
        if self._sleep_level is not None and self._sleep_level != level:
            raise SleepLevelConflictError(
                f"the engine is asleep at level {self._sleep_level}; sleep(level={level}) "
                "conflicts. Nothing was changed: wake_up() first to sleep at another level."
            )
        finished: list[RequestOutput] = []
        if self._sleep_level is None and self.scheduler.has_unfinished:
            if mode == "abort":
                finished = self.abort_request()
            elif mode == "wait":
                while self.scheduler.has_unfinished:
                    finished += self.step()
            elif level > 0:  # keep: the KV cache is about to be discarded; recompute after wake
                self.scheduler.preempt_all()
        if level > 0:
            self._set_asleep(self.executor.run(Command.SLEEP, level)[0])
        self._sleep_level = level
        return finished

    def release(self, tags: Sequence[str] | None = None) -> None:
        """Tag-granular sleep (SGLang's ``release_memory_occupation``): each tag with its
        level-1 policy. Requests in flight are kept; they recompute their KV after wake."""
        if tags is None:
            self.sleep(level=1, mode="keep")
            return
        if not self.config.enable_sleep_mode:
            raise SleepModeDisabledError("release needs LLM(..., enable_sleep_mode=True)")
        if self._sleep_level not in (None, 1):
            raise SleepLevelConflictError(
                f"the engine is asleep at level {self._sleep_level}; wake_up() first"
            )
        policies = {tag: LEVELS[1].get(tag, Policy.HOST).value for tag in tags}
        if KV_CACHE in policies and self.scheduler.has_unfinished:
            self.scheduler.preempt_all()
        self._set_asleep(self.executor.run(Command.SLEEP, None, policies)[0])
        self._sleep_level = 1

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Wakes ``tags`` (all when None) on every rank. Unknown tags raise and change nothing.

        vLLM's two tags wake what goes with them (``WAKE_GROUPS``), so its RL sequence
        ``wake_up(["weights"])`` → refit → ``wake_up(["kv_cache"])`` leaves nothing asleep.
        """
        tag_list = None
        if tags is not None:
            named = [tags] if isinstance(tags, str) else list(tags)
            tag_list = list(dict.fromkeys(t for tag in named for t in WAKE_GROUPS.get(tag, (tag,))))
        self._set_asleep(self.executor.run(Command.WAKE_UP, tag_list)[0])
        if not self._asleep:
            self._sleep_level = None

    # ── weights ───────────────────────────────────────────────────────────────────────────────

    def reload_weights(self, path: str | None = None) -> list[tuple[str, ...]]:
        """Re-reads the checkpoint into the existing weight tensors, on every rank."""
        self._check_weights_awake("reload_weights")
        results = self.executor.run(Command.RELOAD_WEIGHTS, path)
        self._stale_weights -= set(results[0])
        return results

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, ...]]:
        """Refits HF-named tensors in place on every rank; validates all of them first."""
        self._check_weights_awake("update_weights")
        results = self.executor.run(Command.UPDATE_WEIGHTS, list(weights))
        self._stale_weights -= set(results[0])
        return results

    def collective_rpc(
        self, method: str, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """Calls an allowlisted worker method on every rank; returns the results in rank order."""
        command = PUBLIC_RPC.get(method)
        if command is None:
            raise UnknownRpcMethodError(
                f"collective_rpc: {method!r} is not an allowed worker method; allowed: "
                f"{sorted(PUBLIC_RPC)}"
            )
        kwargs = kwargs or {}
        routed = {
            Command.SLEEP: lambda: self.sleep(*args, **kwargs),
            Command.WAKE_UP: lambda: self.wake_up(*args, **kwargs),
            Command.RELOAD_WEIGHTS: lambda: self.reload_weights(*args, **kwargs),
            Command.UPDATE_WEIGHTS: lambda: self.update_weights(*args, **kwargs),
        }
        if command in routed:  # state-changing: through the engine, so its view stays right
            result = routed[command]()
            return result if isinstance(result, list) else [result] * self.executor.world_size
        return self.executor.run(command, *args, **kwargs)

    def shutdown(self) -> None:
        self.executor.shutdown()

    # ── internals ─────────────────────────────────────────────────────────────────────────────

    def _set_asleep(self, asleep: dict[str, str]) -> None:
        if asleep.get(WEIGHTS) == "discard" and self._asleep.get(WEIGHTS) != "discard":
            self._stale_weights = set(self.runtime.weight_names)
        self._asleep = asleep

    def _check_weights_awake(self, what: str) -> None:
        """A refit writes parameters (weights) and checkpoint k/v scales (runtime buffers)."""
        asleep = [tag for tag in (WEIGHTS, RUNTIME) if tag in self._asleep]
        if asleep:
            raise EngineAsleepError(
                f"{what}: {asleep} asleep; wake_up(['weights']) first, then refit"
            )

    def _output(self, seq: Seq) -> RequestOutput:
        """What ``seq`` has produced so far; its prompt text is forgotten once it finished."""
        text = self.tokenizer.decode(seq.output_token_ids)
        reason = None if seq.finish_reason is None else str(seq.finish_reason)
        completion = CompletionOutput(0, text, tuple(seq.output_token_ids), reason)
        prompts = self._prompts
        return RequestOutput(
            request_id=str(seq.seq_id),
            prompt=prompts.pop(seq.seq_id, None) if seq.is_finished else prompts.get(seq.seq_id),
            prompt_token_ids=tuple(seq.prompt_token_ids),
            outputs=(completion,),
            finished=seq.is_finished,
        )
