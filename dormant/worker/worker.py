"""One rank of the engine: its memory manager, model, KV cache and model runner.

Lifecycle: ``load_model`` → ``num_available_blocks`` (the engine takes the MIN over ranks) →
``init_kv_cache`` → ``execute`` / ``sleep`` / ``wake_up`` / weight updates → ``shutdown``.

Sleep and wake only ever touch memory: no model-runner state is rebuilt on wake (DESIGN §3
invariant 2). Every tensor a graph can see is guarded, so a violation raises instead of
replaying against stale addresses.
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
from dormant.distributed.parallel_state import all_reduce_min, get_tp_group
from dormant.memory import (
    KV_CACHE,
    LEVELS,
    RUNTIME,
    WEIGHTS,
    AuditReport,
    MemoryManager,
    MemoryStatus,
    Policy,
    TagState,
)
from dormant.memory.process_checkpoint import CommunicatorActiveError
from dormant.models import CausalLM, ModelConfig, build_model
from dormant.worker.draft_model import DraftModel, create_draft
from dormant.worker.extension import call_extension, extended_worker_class
from dormant.worker.ipc_receiver import IPC_REFIT_COMMANDS
from dormant.worker.kv_cache import allocate_kv_cache, kv_cache_spec
from dormant.worker.model_runner import ModelRunner
from dormant.worker.mtp_draft import MTPDraftModel
from dormant.worker.refit import Refitter, check_awake
from dormant.worker.refit_record import RefitRecord
from dormant.worker.spec_step import SpecStep

DEFAULT_HOST_KV_BYTES = 64 << 20


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
            _device_for(config.device, self.local_rank),
            poison=config.memory_poison,
            strict=config.memory_strict,
        )
        self.device = self.mm.backend.device
        self._model: CausalLM | None = None
        self._runner: ModelRunner | None = None
        self.draft: DraftModel | MTPDraftModel | None = None  # speculative decoding's draft
        self._spec_step: SpecStep | None = None
        self.refits = RefitRecord(())  # replaced once the model is built
        self.num_kv_discards = 0  # sleeps of the KV cache: its contents are gone after each
        self.refitter = Refitter(config, self.mm, lambda: self.model, rank, lambda: self.draft)
        self.comm_sleep = CommunicatorSleep(
            get_tp_group(), config.comm_sleep, captures_collectives=self._captures_collectives()
        )
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
            Command.UPDATE_WEIGHTS_FROM_TENSOR: self.refitter.update_weights_from_tensor,
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
    def runner(self) -> ModelRunner:
        if self._runner is None:
            raise RuntimeError("the KV cache is not initialised yet")
        return self._runner

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
        config = self.config
        if config.num_gpu_blocks_override is not None:
            return config.num_gpu_blocks_override
        if config.kv_cache_memory_bytes is not None:
            return max(config.kv_cache_memory_bytes, 0) // per_block
        if self.mm.backend.device.type != "cuda":
            return DEFAULT_HOST_KV_BYTES // per_block
        free, total = torch.cuda.mem_get_info(self.mm.backend.device)
        budget = free - (1.0 - config.gpu_memory_utilization) * total - self._activation_bytes()
        return max(int(budget), 0) // per_block

    def init_kv_cache(self, num_blocks: int) -> int:
        """Allocates ``num_blocks`` KV blocks plus one null block (id ``num_blocks``, owned by
        no sequence: padded graph rows write there), then captures the decode graphs.

        Returns the largest batch the fused multi-step graph takes (0: none was captured).
        """
        model = self.model
        allocate_kv_cache(self.mm, model, kv_cache_spec(model, self.config), num_blocks + 1)
        self._runner = ModelRunner(self.config, model, self.mm, null_block=num_blocks)
        self.mm.guard_addresses(
            "kv_cache", lambda: [a.checked_cache() for a in model.attention_layers()]
        )
        self.mm.guard_addresses("model_runner.inputs", self.runner.inputs.tensors)
        if self.draft is not None:  # its KV, guarded, and the step that drafts and verifies
            self._spec_step = SpecStep.create(self.runner, self.draft, num_blocks)
        if self.mm.backend.device.type == "cuda" and not self.config.enforce_eager:
            self.runner.capture_graphs()
            if self._spec_step is not None:
                self._spec_step.capture_graphs()
        if self.config.enable_sleep_mode and self.config.prepare_sleep_arena:
            self.mm.prepare_arena(level=1)  # in the background: the first sleep then only copies
        graphs = self.runner.graphs
        return max(graphs.multi_step, default=0) if graphs is not None else 0

    def execute_multi_step(self, step: StepInput) -> StepOutput:
        return self.runner.execute_multi_step(step)

    def execute(self, step: StepInput) -> StepOutput:
        if self._spec_step is not None:
            return self._spec_step.execute(step)
        return self.runner.execute(step)

    def sleep(
        self, level: int, tags: Sequence[str] | None = None, release_context: bool = False
    ) -> RankSleepState:
        """Puts this rank's memory to sleep with ``level``'s policies: every tag, or only
        ``tags``. Discarding the weights marks every weight stale, even if the sleep fails
        after discarding some of them. Then torch's cuBLAS workspaces and cache go back to the
        driver, and with ``release_context`` the driver checkpoints the rest of the process's
        device state, its CUDA context included (``check_release_context`` says when it
        cannot, before anything changes); ``wake_up`` restores it. Returns the state after."""
        policies = dict(LEVELS[level])
        if tags is not None:
            policies = {tag: policies[tag] for tag in tags}
        if self.mm.context.is_released:
            return self._sleep_while_released(policies)
        if release_context:
            self.check_release_context()
        was_awake = self.mm.tag_states()[WEIGHTS] is TagState.AWAKE
        if KV_CACHE in policies:  # counted first: a sleep that fails may have discarded some
            self.num_kv_discards += 1
        try:
            self.mm.sleep(tags=policies)
        finally:
            discards = policies.get(WEIGHTS) is Policy.DISCARD
            if discards and was_awake and self.mm.tag_states()[WEIGHTS] is not TagState.AWAKE:
                self.refits.discarded()
        self.mm.residual.release_torch_memory()  # back to the driver, and to a trainer
        if tags is None and not self.comm_sleep.released:  # the whole engine sleeps
            self.comm_sleep.release()  # its communicator's memory goes too
        if release_context:
            self.mm.context.release()
        return self.sleep_state()

    def check_release_context(self) -> None:
        """Raises, changing nothing, if this rank cannot release its process's CUDA context:
        NCCL communicators (a tensor-parallel rank, a weight-update group over NCCL:
        CommunicatorActiveError), a driver without the checkpoint API
        (CheckpointUnsupportedError)."""
        if self.world_size > 1:
            raise CommunicatorActiveError(
                f"rank {self.rank} of {self.world_size}: a tensor-parallel engine's NCCL "
                "communicator cannot be checkpointed; release_context is for one GPU"
            )
        self.mm.context.check()

    def _sleep_while_released(self, policies: dict[str, Policy]) -> RankSleepState:
        """A sleep that would change nothing is a no-op while the CUDA state is checkpointed
        (callers sleep defensively); any other needs the device and raises."""
        tags = {t.tag: t for t in self.mm.status().tags}
        if any(tags[tag].num_allocations and tags[tag].asleep_policy is not p
               for tag, p in policies.items() if p is not Policy.KEEP):  # fmt: skip
            self.mm.context.check_usable(f"sleep with {policies}")
        return self.sleep_state()

    def wake_up(self, tags: Sequence[str] | None = None) -> RankSleepState:
        """Wakes ``tags`` (all when None); returns the state after the wake."""
        self.comm_sleep.restore()  # first: waking may run collectives
        self.mm.wake_up(tags)
        return self.sleep_state()

    def _captures_collectives(self) -> bool:
        """Whether the decode graphs will capture the TP group's collectives."""
        on_gpu = torch.device(self.device).type == "cuda"
        return on_gpu and not self.config.enforce_eager and self.world_size > 1

    def sleep_state(self) -> RankSleepState:
        """This rank's memory state per tag and its stale weights, derived now."""
        return RankSleepState(
            tags=tuple(self.mm.tag_states().items()),
            stale_weights=frozenset(self.refits.stale),
            num_weights=len(self.refits.names),
            num_weight_writes=self.refits.num_writes,
            num_kv_discards=self.num_kv_discards,
        )

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
        draft_model = None if self.draft is None else self.draft.model
        for owner in (self._model, draft_model):
            for layer in owner.attention_layers() if owner is not None else ():
                layer.kv_cache = None
        self._model, self._runner, self.draft, self._spec_step = None, None, None, None
        self.refitter.groups.destroy_all()
        gc.collect()
        if self.mm.backend.device.type == "cuda":
            torch.cuda.empty_cache()
        self.mm.close()

    def _activation_bytes(self) -> int:
        """Headroom kept free for activations, logits and the reference attention's scores."""
        c, m = self.config, self.config.model_config
        tokens = c.max_num_batched_tokens
        per_token = (4 * m.hidden_size + 3 * m.intermediate_size) * m.dtype.itemsize * 2
        scores = tokens * m.num_attention_heads * c.max_model_len * 4 * 2
        logits = c.max_num_seqs * m.vocab_size * 4 * 4
        return tokens * per_token + scores + logits


def create_worker(
    config: EngineConfig, rank: int = 0, world_size: int = 1, local_rank: int | None = None
) -> Worker:
    """A worker of ``config``'s class: ``Worker``, with ``worker_extension_cls`` mixed in."""
    qualname = config.worker_extension_cls
    cls = Worker if qualname is None else extended_worker_class(Worker, qualname)
    return cls(config, rank, world_size, local_rank)


def _device_for(device: str, rank: int) -> str:
    if device == "auto":
        return f"cuda:{rank}" if torch.cuda.is_available() else "host"
    if device == "cpu":
        return "host"
    if device == "cuda":
        return f"cuda:{rank}"
    return device
