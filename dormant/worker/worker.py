"""One rank of the engine: its memory manager, model, KV cache and model runner.

Lifecycle: ``load_model`` → ``num_available_blocks`` (the engine takes the MIN over ranks) →
``init_kv_cache`` → ``execute`` / ``sleep`` / ``wake_up`` / weight updates → ``shutdown``.

Sleep and wake only ever touch memory: no model-runner state is rebuilt on wake (DESIGN §3
invariant 2). Every tensor a graph can see is guarded, so a violation raises instead of
replaying against stale addresses.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from dormant.core.commands import Command
from dormant.core.config import EngineConfig
from dormant.core.errors import EngineAsleepError
from dormant.core.step_input import StepInput
from dormant.core.step_output import StepOutput
from dormant.distributed.parallel_state import all_reduce_min
from dormant.memory import RUNTIME, WEIGHTS, AuditReport, MemoryManager, MemoryStatus
from dormant.models import CausalLM, build_model, iterate_safetensors, iterate_safetensors_metadata
from dormant.worker.kv_cache import allocate_kv_cache, kv_cache_spec
from dormant.worker.model_runner import ModelRunner

DEFAULT_HOST_KV_BYTES = 64 << 20


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, world_size: int = 1) -> None:
        self.config = config
        self.rank, self.world_size = rank, world_size
        self.mm = MemoryManager(
            _device_for(config.device, rank),
            poison=config.memory_poison,
            strict=config.memory_strict,
        )
        self._model: CausalLM | None = None
        self._runner: ModelRunner | None = None
        self._handlers: dict[Command, Callable[..., Any]] = {
            Command.LOAD_MODEL: self.load_model,
            Command.NUM_AVAILABLE_BLOCKS: self.num_available_blocks,
            Command.INIT_KV_CACHE: self.init_kv_cache,
            Command.EXECUTE: self.execute,
            Command.EXECUTE_MULTI_STEP: self.execute_multi_step,
            Command.SLEEP: self.sleep,
            Command.WAKE_UP: self.wake_up,
            Command.RELOAD_WEIGHTS: self.reload_weights,
            Command.UPDATE_WEIGHTS: self.update_weights,
            Command.MEMORY_STATUS: self.memory_status,
            Command.KV_CACHE_SCALES: self.kv_cache_scales,
            Command.AUDIT: self.audit,
            Command.VERIFY_GUARDS: self.verify_guards,
            Command.CHECK_HEALTH: self.check_health,
            Command.SHUTDOWN: self.shutdown,
        }

    def handle(self, command: Command, *args: Any, **kwargs: Any) -> Any:
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

    def load_model(self) -> tuple[str, ...]:
        """Builds the model on ``meta``, materialises it into ``weights``/``runtime``, loads it.

        Returns every checkpoint name the model has (what a full refit must write).
        """
        with torch.device("meta"):
            model = build_model(self.config.model_config)
        self.mm.adopt(model, tag=WEIGHTS)  # parameters → weights, buffers (RoPE, scales) → runtime
        model.init_buffers()
        model.reset_kv_scales()
        self._model = model
        self._load_weights(self.config.model)
        self.mm.guard_addresses("weights", lambda: list(model.parameters()))
        return tuple(model.expected_weight_shapes())

    def num_available_blocks(self) -> int:
        """KV blocks that fit on this device, all-reduced MIN over the ranks (DESIGN §3 inv. 6)."""
        return all_reduce_min(self._local_num_blocks())

    def _local_num_blocks(self) -> int:
        spec = kv_cache_spec(self.model, self.config)
        config = self.config
        if config.num_gpu_blocks_override is not None:
            return config.num_gpu_blocks_override
        if config.kv_cache_memory_bytes is not None:
            return spec.num_blocks_for(config.kv_cache_memory_bytes)
        if self.mm.backend.device.type != "cuda":
            return spec.num_blocks_for(DEFAULT_HOST_KV_BYTES)
        free, total = torch.cuda.mem_get_info(self.mm.backend.device)
        budget = free - (1.0 - config.gpu_memory_utilization) * total - self._activation_bytes()
        return spec.num_blocks_for(int(budget))

    def init_kv_cache(self, num_blocks: int) -> int:
        """Allocates ``num_blocks`` KV blocks plus one null block (id ``num_blocks``, owned by
        no sequence: padded graph rows write there), then captures the decode graphs.

        Returns the largest batch the fused multi-step graph takes (0: none was captured).
        """
        model = self.model
        allocate_kv_cache(self.mm, model, kv_cache_spec(model, self.config), num_blocks + 1)
        self._runner = ModelRunner(self.config, model, self.mm, null_block=num_blocks)
        self.mm.guard_addresses("kv_cache", lambda: [a.kv_cache for a in model.attention_layers()])
        self.mm.guard_addresses("model_runner.inputs", self.runner.inputs.tensors)
        if self.mm.backend.device.type == "cuda" and not self.config.enforce_eager:
            self.runner.capture_graphs()
        graphs = self.runner.graphs
        return max(graphs.multi_step, default=0) if graphs is not None else 0

    def execute_multi_step(self, step: StepInput) -> StepOutput:
        return self.runner.execute_multi_step(step)

    def execute(self, step: StepInput) -> StepOutput:
        return self.runner.execute(step)

    def sleep(self, level: int | None, tags: dict[str, str] | None = None) -> dict[str, str]:
        """Puts this rank's memory to sleep at ``level`` (or ``{tag: policy}``); returns the
        asleep tags and their policies."""
        if tags is None:
            self.mm.sleep(level=level)
        else:
            self.mm.sleep(tags=tags)
        if self.mm.backend.device.type == "cuda":
            torch.cuda.empty_cache()  # hand torch's cached blocks back to the trainer too
        return self._asleep()

    def wake_up(self, tags: Sequence[str] | None = None) -> dict[str, str]:
        """Wakes ``tags`` (all when None); returns what is still asleep."""
        self.mm.wake_up(tags)
        return self._asleep()

    def reload_weights(self, path: str | None = None) -> tuple[str, ...]:
        """Re-reads the checkpoint (or re-runs the seeded init) into the existing tensors."""
        self._check_weights_awake("reload_weights")
        return self._load_weights(path or self.config.model)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> tuple[str, ...]:
        """Refits HF-named tensors in place, after validating every name, shape and dtype."""
        self._check_weights_awake("update_weights")
        items = list(weights)
        self.model.check_weights([(name, t.shape, t.dtype) for name, t in items], exact_dtype=True)
        return tuple(sorted(self.model.load_weights(items)))

    def kv_cache_scales(self) -> list[tuple[float, float]]:
        """Every attention layer's (k_scale, v_scale): calibrated state that must survive sleep."""
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
        if self._model is not None:
            for layer in self._model.attention_layers():
                layer.kv_cache = None
        self._model, self._runner = None, None
        gc.collect()
        if self.mm.backend.device.type == "cuda":
            torch.cuda.empty_cache()
        self.mm.close()

    def _load_weights(self, path: str | None) -> tuple[str, ...]:
        model = self.model
        if self.config.load_format == "dummy":
            model.init_random_weights(self.config.seed)
            return tuple(model.expected_weight_shapes())
        assert path is not None, "a checkpoint path is required unless load_format='dummy'"
        model.check_weights(list(iterate_safetensors_metadata(path)), require_complete=True)
        return tuple(sorted(model.load_weights(iterate_safetensors(path))))

    def _check_weights_awake(self, what: str) -> None:
        """A refit writes parameters (weights) and checkpoint k/v scales (runtime buffers)."""
        asleep = [tag for tag in (WEIGHTS, RUNTIME) if self.mm.is_sleeping(tag)]
        if asleep:
            raise EngineAsleepError(
                f"{what}: {asleep} asleep; wake_up(['weights']) first, then refit"
            )

    def _activation_bytes(self) -> int:
        """Headroom kept free for activations, logits and the reference attention's scores."""
        c, m = self.config, self.config.model_config
        tokens = c.max_num_batched_tokens
        per_token = (4 * m.hidden_size + 3 * m.intermediate_size) * m.dtype.itemsize * 2
        scores = tokens * m.num_attention_heads * c.max_model_len * 4 * 2
        logits = c.max_num_seqs * m.vocab_size * 4 * 4
        return tokens * per_token + scores + logits

    def _asleep(self) -> dict[str, str]:
        return {tag: policy.value for tag, policy in self.mm.asleep_tags.items()}


def _device_for(device: str, rank: int) -> str:
    if device == "auto":
        return f"cuda:{rank}" if torch.cuda.is_available() else "host"
    if device == "cpu":
        return "host"
    if device == "cuda":
        return f"cuda:{rank}"
    return device
