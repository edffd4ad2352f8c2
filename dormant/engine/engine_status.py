"""What ``LLM.memory_status()`` returns for one rank: the rank's ``MemoryStatus`` (the memory
layer's report, every field and method of it) and the engine's prefix-cache and speculative
decoding statistics, which only the driver knows."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from dormant.engine.prefix_cache import PrefixCacheStats
from dormant.engine.spec_stats import SpecDecodeStats
from dormant.memory import MemoryStatus


@dataclass(frozen=True)
class EngineMemoryStatus(MemoryStatus):
    prefix_cache: PrefixCacheStats = field(
        default_factory=lambda: PrefixCacheStats(is_enabled=False)
    )
    spec_decode: SpecDecodeStats | None = None  # None without speculative decoding

    @classmethod
    def of(
        cls,
        status: MemoryStatus,
        prefix_cache: PrefixCacheStats,
        spec_decode: SpecDecodeStats | None = None,
    ) -> EngineMemoryStatus:
        values = {f.name: getattr(status, f.name) for f in fields(MemoryStatus)}
        return cls(**values, prefix_cache=prefix_cache, spec_decode=spec_decode)

    def table(self) -> str:
        """The memory layer's report, then a line on the prefix cache."""
        cache = self.prefix_cache
        if not cache.is_enabled:
            line = "  prefix cache: off"
        else:
            line = (
                f"  prefix cache: {cache.num_cached_blocks} blocks cached "
                f"({cache.num_evictable_blocks} evictable), hit rate {cache.hit_rate:.1%} "
                f"({cache.num_hit_tokens:,} of {cache.num_query_tokens:,} tokens), "
                f"{cache.num_evictions:,} evictions, {cache.num_resets} resets"
            )
        spec = self.spec_decode
        if spec is not None:
            rate = spec.acceptance_rate
            line += (
                f"\n  speculative decoding: {spec.num_drafts:,} drafts, "
                f"{spec.num_accepted_tokens:,} of {spec.num_draft_tokens:,} tokens accepted"
                + ("" if rate is None else f" ({rate:.1%})")
            )
        return f"{super().table()}\n{line}"
