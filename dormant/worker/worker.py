"""One rank of the engine: its memory manager, model, KV cache and model runner.

Lifecycle: ``load_model`` → ``num_available_blocks`` (the engine takes the MIN over ranks) →
``init_kv_cache`` → ``execute`` / ``sleep`` / ``wake_up`` / weight updates → ``shutdown``.

Sleep and wake (``rank_sleep.py``) only ever touch memory: no model-runner state is rebuilt on
wake (DESIGN §3 invariant 2). Every tensor a graph can see is guarded, so a violation raises
instead of replaying against stale addresses.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, ClassVar, cast

import torch

from dormant.core.commands import Command
from dormant.core.config import EngineConfig
from dormant.core.sleep_state import RankSleepState
from dormant.core.step_input import StepInput
from dormant.core.step_output import StepOutput
from dormant.distributed.comm_sleep import CommunicatorSleep
from dormant.distributed.communicator import create_communicator
from dormant.distributed.parallel_state import all_reduce_min, get_tp_group
from dormant.memory import (
    RUNTIME,
    WEIGHTS,
    AuditReport,
    MemoryManager,
    MemoryStatus,
)
from dormant.models import CausalLM, ModelConfig, build_model
from dormant.worker.devices import memory_device
from dormant.worker.draft_model import DraftModel, create_draft
from dormant.worker.extension import call_extension, extended_worker_class
from dormant.worker.ipc_receiver import IPC_REFIT_COMMANDS
from dormant.worker.kv_cache import allocate_kv_cache, kv_cache_spec, num_local_blocks
from dormant.worker.model_runner import ModelRunner
from dormant.worker.mtp_draft import MTPDraftModel
from dormant.worker.pending_step import PendingStep
from dormant.worker.rank_sleep import RankSleep, captures_collectives
from dormant.worker.rank_steps import RankSteps
from dormant.worker.refit import Refitter, TensorPayload, check_awake
from dormant.worker.refit_record import RefitRecord, RefitReport


class Worker:
    """One rank. Inside it, vLLM's worker extensions find what vLLM's workers have:
    ``self.model_runner.model``, ``self.device``, ``self.rank``, ``self.local_rank``."""

    extension_cls: ClassVar[type | None] = None  # set on classes built by create_worker

    def __init__(
        self,
        config: EngineConfig,
        rank: int = 0,
        world_size: int = 1,
        local_rank: int | None = None,
    ) -> None:
        self.config = config
        self.rank, self.world_size = rank, world_size
        self.local_rank = rank if local_rank is None else local_rank
        self.mm = MemoryManager(
            memory_device(config.device, self.local_rank),
            poison=config.memory_poison,
            strict=config.memory_strict,
        )
        self.device = self.mm.backend.device
        create_communicator(get_tp_group(), self.mm.residual)  # its memory measured, as its own
        self._model: CausalLM | None = None
        self._steps: RankSteps | None = None
        self.draft: DraftModel | MTPDraftModel | None = None  # speculative decoding's draft
        self.refits = RefitRecord(())  # replaced once the model is built
        self.refitter = Refitter(config, self.mm, lambda: self.model, rank, lambda: self.draft)
        self.comm_sleep = CommunicatorSleep(
            get_tp_group(),
            config.comm_sleep,
            captures_collectives=captures_collectives(self.device, config, world_size),
            ledger=self.mm.residual,
        )
        self.rank_sleep = RankSleep(self.mm, self.comm_sleep, lambda: self.refits, rank, world_size)
        self._handlers: dict[Command, Callable[..., Any]] = {
            Command.LOAD_MODEL: self.load_model,
            Command.NUM_AVAILABLE_BLOCKS: self.num_available_blocks,
            Command.INIT_KV_CACHE: self.init_kv_cache,
            Command.EXECUTE: self.execute,
            Command.EXECUTE_MULTI_STEP: self.execute_multi_step,
            Command.SLEEP: self.sleep,
            Command.CHECK_RELEASE_CONTEXT: self.check_release_context,
            Command.WAKE_UP: self.wake_up,
            Command.SLEEP_STATE: self.sleep_state,
            Command.RELOAD_WEIGHTS: self.refitter.reload_weights,
            Command.UPDATE_WEIGHTS: self.refitter.update_weights,
            Command.UPDATE_WEIGHTS_FROM_TENSOR: self._refit_from_tensor,
            Command.INIT_WEIGHTS_UPDATE_GROUP: self.refitter.init_weights_update_group,
            Command.UPDATE_WEIGHTS_FROM_DISTRIBUTED: self.refitter.update_weights_from_distributed,
            Command.DESTROY_WEIGHTS_UPDATE_GROUP: self.refitter.destroy_weights_update_group,
            Command.MEMORY_STATUS: self.memory_status,
            Command.KV_CACHE_SCALES: self.kv_cache_scales,
            Command.AUDIT: self.audit,
            Command.VERIFY_GUARDS: self.verify_guards,
            Command.CHECK_HEALTH: self.check_health,
            Command.CALL_EXTENSION: partial(call_extension, self),
            Command.CALL_FUNCTION: self.call_function,
            Command.SHUTDOWN: self.shutdown,
        }

    def handle(self, command: Command, *args: Any, **kwargs: Any) -> Any:
        if command not in IPC_REFIT_COMMANDS:  # the refit ended: close the handles it held
            self.refitter.end_ipc_refit()
        return self._handlers[command](*args, **kwargs)

    @property
    def model(self) -> CausalLM:
        if self._model is None:
            raise RuntimeError("the model is not loaded yet")
        return self._model

    @property
    def steps(self) -> RankSteps:
        if self._steps is None:
            raise RuntimeError("the KV cache is not initialised yet")
        return self._steps

    @property
    def runner(self) -> ModelRunner:
        return self.steps.runner

    @property
    def model_config(self) -> ModelConfig:
        """vLLM's name: the model's config (``dtype``, ``vocab_size``...), as extensions read
        it (OpenRLHF's ``WorkerWrap`` checks the dtype of every weight it receives)."""
        return self.config.model_config

    @property
    def model_runner(self) -> ModelRunner:
        """vLLM's name: worker extensions reach the model as ``self.model_runner.model``."""
        return self.runner

    def call_function(
        self, function: bytes | Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """``collective_rpc(fn)``: runs ``fn(self, *args, **kwargs)``; ``fn`` arrives pickled by
        value (cloudpickle) from another process, or as itself in-process."""
        if isinstance(function, bytes):
            import cloudpickle

            function = cast(Callable[..., Any], cloudpickle.loads(function))
        return function(self, *args, **kwargs)

    def load_model(self) -> tuple[str, ...]:
        """Builds the model on ``meta``, materialises it into ``weights``/``runtime``, loads it.

        Returns every checkpoint name the model has (what a full refit must write), with a
        draft model's under ``draft.`` (``worker/draft_model.py``).
        """
        with torch.device("meta"):
            model = build_model(self.config.model_config)
        self.mm.adopt(model, tag=WEIGHTS)  # parameters → weights, buffers (RoPE, scales) → runtime
        model.init_buffers()
        model.reset_kv_scales()
        self._model = model
        draft = self.draft = create_draft(self.config, self.mm, model)
        names = (*model.expected_weight_shapes(), *(draft.weight_names if draft else ()))
        self.refits = RefitRecord(names, self._check_weights_writable)
        model.weight_observer = self.refits
        self.refitter.load_checkpoint(self.config.model)
        if draft is not None:
            draft.attach(self.refits)
            draft.load()
            self.mm.guard_addresses("draft.weights", lambda: list(draft.model.parameters()))
        self.mm.guard_addresses("weights", lambda: list(model.parameters()))
        self.mm.residual.mark("the model was loaded")
        return names

    def _check_weights_writable(self) -> None:
        """Every weight write, by any path (a framework's ``model.load_weights`` included),
        needs the weights and the runtime buffers (checkpoint k/v scales) awake."""
        check_awake(self.mm, "model.load_weights", WEIGHTS, RUNTIME)

    def num_available_blocks(self) -> int:
        """KV blocks that fit on this device, all-reduced MIN over the ranks (DESIGN §3 inv. 6)."""
        return all_reduce_min(self._local_num_blocks())

    def _local_num_blocks(self) -> int:
        """A block's bytes are the target's and the draft's: both index the same blocks."""
        per_block = kv_cache_spec(self.model, self.config).bytes_per_block
        per_block += self.draft.kv_bytes_per_block() if self.draft is not None else 0
        return num_local_blocks(self.config, self.mm.backend.device, per_block)

    def init_kv_cache(self, num_blocks: int) -> int:
        """Allocates ``num_blocks`` KV blocks plus one null block (id ``num_blocks``, owned by
        no sequence: padded graph rows write there), then captures the decode graphs.

        Returns the largest batch the fused multi-step graph takes (0: none was captured).
        """
        model = self.model
        allocate_kv_cache(self.mm, model, kv_cache_spec(model, self.config), num_blocks + 1)
        self.mm.guard_addresses(
            "kv_cache", lambda: [a.checked_cache() for a in model.attention_layers()]
        )
        self._steps = RankSteps(self.config, self.mm, model, self.draft, num_blocks)
        if self.config.enable_sleep_mode and self.config.prepare_sleep_arena:
            self.mm.prepare_arena(level=1)  # in the background: the first sleep then only copies
        return self._steps.max_multi_step_rows

    def execute(self, step: StepInput) -> StepOutput:
        return self.steps.execute(step)

    def execute_multi_step(self, step: StepInput) -> StepOutput:
        """``cuda_graph_multi_steps`` decode steps, or speculative rounds, in one call."""
        return self.steps.execute_multi_step(step)

    def launch(self, step: StepInput, multi_step: bool = False) -> PendingStep:
        """Queues ``step`` without waiting for its results: async scheduling (``RankSteps``)."""
        return self.steps.launch(step, multi_step)

    def sleep(
        self, level: int, tags: Sequence[str] | None = None, release_context: bool = False
    ) -> RankSleepState:
        """Puts this rank's memory to sleep (``RankSleep.sleep``); returns the state after."""
        return self.rank_sleep.sleep(level, tags, release_context)

    def check_release_context(self) -> None:
        """Raises, changing nothing, if this rank cannot release its process's CUDA context
        (``RankSleep.check_release_context``)."""
        self.rank_sleep.check_release_context()

    def wake_up(self, tags: Sequence[str] | None = None) -> RankSleepState:
        """Wakes ``tags`` (all when None); returns the state after the wake."""
        return self.rank_sleep.wake_up(tags)

    def sleep_state(self) -> RankSleepState:
        """This rank's memory state per tag and its stale weights, derived now."""
        return self.rank_sleep.state()

    def _refit_from_tensor(
        self, tensors: TensorPayload, load_format: str | None = None
    ) -> RefitReport:
        """A bucket's refit (``Refitter``'s), answered with the record after it (private: an
        extension's ``update_weights_from_tensor`` would otherwise conflict)."""
        return self.refits.report(self.refitter.update_weights_from_tensor(tensors, load_format))

    @property
    def num_kv_discards(self) -> int:
        """Sleeps of the KV cache: its contents are gone after each."""
        return self.rank_sleep.num_kv_discards

    def kv_cache_scales(self) -> list[tuple[float, float]]:
        """Every attention layer's (k_scale, v_scale): calibrated state that must survive sleep."""
        check_awake(self.mm, "kv_cache_scales", RUNTIME)  # the scales live in runtime memory
        layers = self.model.attention_layers()
        return [(float(a.k_scale), float(a.v_scale)) for a in layers]

    def memory_status(self) -> MemoryStatus:
        return self.mm.status()

    def audit(self) -> AuditReport:
        return self.mm.audit()

    def verify_guards(self) -> None:
        self.mm.verify_guards()

    def check_health(self) -> bool:
        return self._model is not None

    def shutdown(self) -> None:
        """Drops the model, KV cache and runner so their memory returns now, then closes the
        memory manager (the device can host another engine afterwards)."""
        self.mm.context.restore()  # the frees below need the device
        owners = (self._model, None if self.draft is None else self.draft.model)
        for layer in (layer for o in owners if o is not None for layer in o.attention_layers()):
            layer.kv_cache = None
        self._model, self._steps, self.draft = None, None, None
        self.refitter.groups.destroy_all()
        gc.collect()
        if self.mm.backend.device.type == "cuda":
            torch.cuda.empty_cache()
        self.mm.close()


def create_worker(
    config: EngineConfig, rank: int = 0, world_size: int = 1, local_rank: int | None = None
) -> Worker:
    """A worker of ``config``'s class: ``Worker``, with ``worker_extension_cls`` mixed in."""
    qualname = config.worker_extension_cls
    cls = Worker if qualname is None else extended_worker_class(Worker, qualname)
    # Keywords only, as vLLM builds its workers: an extension may define __new__(cls, **kwargs)
    return cls(config=config, rank=rank, world_size=world_size, local_rank=local_rank)
