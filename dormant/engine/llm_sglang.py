"""SGLang's names for ``LLM``'s memory and refit calls (``release_memory_occupation``, the
weight-update group, ``update_weights_from_tensor``, the weight version), mixed into ``LLM``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dormant.engine.llm_engine import LLMEngine


class SGLangCalls:
    """SGLang's ``Engine`` calls, over ``llm_engine`` (``LLM``'s)."""

    llm_engine: LLMEngine

    def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """SGLang's name: releases ``tags`` (all when None) with their level-1 policies: the KV
        cache is discarded, everything else is offloaded to host memory. Running requests are
        kept and resume (recomputing their KV) after ``resume_memory_occupation``."""
        self.llm_engine.release(tags)

    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """SGLang's name for ``wake_up``."""
        self.llm_engine.wake_up(tags)

    def update_weights_from_tensor(
        self,
        named_tensors: Any,
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> None:
        """SGLang's: (name, tensor) pairs, or serialized CUDA IPC entries (one per TP rank, or
        one for all; ``load_format="flattened_bucket"`` for one flat buffer plus metadata),
        copied in place device to device. See ``dormant.worker.ipc_weights`` for the formats."""
        self.llm_engine.refits.update_weights_from_tensor(
            named_tensors, load_format, flush_cache, weight_version
        )

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> None:
        """SGLang's: joins the trainer's process group (the trainer is its rank 0; rank r of
        this engine is ``rank_offset + r``), NCCL on GPUs or gloo."""
        self.llm_engine.refits.init_weights_update_group(
            master_address, master_port, rank_offset, world_size, group_name, backend
        )

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[Any],
        shapes: Sequence[Sequence[int]],
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        weight_version: str | None = None,
        load_format: str | None = None,
    ) -> None:
        """SGLang's: receives the trainer's broadcast of each named tensor, in order, or with
        ``load_format="flattened_bucket"`` one uint8 buffer holding their bytes back to back."""
        self.llm_engine.refits.update_weights_from_distributed(
            names, dtypes, shapes, group_name, flush_cache, weight_version, load_format
        )

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        self.llm_engine.refits.destroy_weights_update_group(group_name)

    def get_weight_version(self) -> str:
        """The version the last successful refit was given (SGLang's; ``"default"`` before)."""
        return self.llm_engine.refits.weight_version
