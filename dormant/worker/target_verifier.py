"""The target's verification pass of a step whose rows all draft, from static buffers, replayed
from CUDA graphs: every row computes ``K + 1`` positions (``K = num_speculative_tokens``), its
newest token then its drafts, padded past its ``j`` (``spec_inputs.SpecLayout``, ``pad_to``).

The pass reads its own ``InputBuffers`` (``runtime``, never replaced) and returns the logits of
all ``bs * (K + 1)`` positions; with MTP it also writes the target's hidden states into the
hidden cache at the pass's slot mapping, inside the graph. A batch is padded up to a captured
size with rows of ``K + 1`` tokens at positions ``0 .. K`` in the null block. Without graphs
(the CPU, ``enforce_eager``, a batch larger than any graph) the same buffers feed an eager pass.
Steps with a plain row (a prefill chunk, a row that cannot draft) verify eagerly instead
(``spec_step.py``).
"""

from __future__ import annotations

from functools import partial

import torch

from dormant.core.config import EngineConfig
from dormant.layers.context import AttentionMetadata, forward_context
from dormant.memory import MemoryManager
from dormant.models import CausalLM
from dormant.worker.graph_capture import capture_passes
from dormant.worker.input_buffers import InputBuffers


class TargetVerifier:
    def __init__(
        self,
        model: CausalLM,
        mm: MemoryManager,
        config: EngineConfig,
        null_block: int,
        num_drafts: int,
        hidden_cache: torch.Tensor | None,
    ) -> None:
        self.model, self.mm, self.config = model, mm, config
        self.width = num_drafts + 1
        self.inputs = InputBuffers(mm, config, null_block)
        self.null_block = null_block
        self.hidden_cache = hidden_cache
        self.max_rows = min(config.max_num_seqs, config.max_num_batched_tokens // self.width)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def fits(self, num_rows: int) -> bool:
        return num_rows <= self.max_rows

    def capture(self, batch_sizes: list[int]) -> None:
        """Captures one graph per batch size that fits, largest first (GPU only), once."""
        sizes = sorted((bs for bs in batch_sizes if bs <= self.max_rows), reverse=True)
        passes = [(partial(self._pad, 0, bs), partial(self._forward, bs)) for bs in sizes]
        captured = capture_passes(self.mm, passes, "the verification graphs were captured")
        self.graphs.update(zip(sizes, captured, strict=True))

    def run(
        self,
        views: list[torch.Tensor],
        block_width: int,
        drafts: torch.Tensor,
    ) -> torch.Tensor:
        """The logits (float32 [n, K + 1, V]) of the pass whose ``PassLayout`` device views
        and first token ids are ``views``; ``drafts`` (int64 [n, K]) fill the other ids."""
        positions, slots, seq_lens, query_start_loc, tables, first_ids = views
        n, width, i = first_ids.shape[0], self.width, self.inputs
        num_tokens = n * width
        ids = i.input_ids[:num_tokens].view(n, width)
        ids[:, 0].copy_(first_ids)
        ids[:, 1:].copy_(drafts)
        i.positions[:num_tokens].copy_(positions)
        i.slot_mapping[:num_tokens].copy_(slots)
        i.seq_lens[:n].copy_(seq_lens)
        i.query_start_loc[: n + 1].copy_(query_start_loc)
        i.block_tables[:n, :block_width].copy_(tables.view(n, block_width))
        size = next((bs for bs in sorted(self.graphs) if bs >= n), None)
        if size is None:
            return self._forward(n).view(n, width, -1)
        self._pad(n, size)
        graph, output = self.graphs[size]
        graph.replay()
        return output[:num_tokens].view(n, width, -1)

    def _pad(self, start: int, stop: int) -> None:
        """Rows ``start .. stop`` become dummy rows of ``K + 1`` tokens in the null block."""
        if stop <= start:
            return
        i, width, block_size = self.inputs, self.width, self.inputs.block_size
        first, last = start * width, stop * width
        offsets = torch.arange(width, device=i.positions.device).repeat(stop - start)
        i.input_ids[first:last].zero_()
        i.positions[first:last].copy_(offsets)
        i.slot_mapping[first:last].copy_(self.null_block * block_size + offsets % block_size)
        i.seq_lens[start:stop].fill_(width)
        i.query_start_loc[start + 1 : stop + 1].copy_(
            torch.arange(start + 1, stop + 1, device=i.positions.device) * width
        )
        i.block_tables[start:stop].fill_(self.null_block)

    def _forward(self, num_rows: int) -> torch.Tensor:
        i, num_tokens = self.inputs, num_rows * self.width
        meta = AttentionMetadata(
            slot_mapping=i.slot_mapping[:num_tokens],
            block_tables=i.block_tables[:num_rows],
            seq_lens=i.seq_lens[:num_rows],
            query_start_loc=i.query_start_loc[: num_rows + 1],
            max_query_len=self.width,
            max_seq_len=self.config.max_model_len,
        )
        with forward_context(meta):
            hidden = self.model(i.input_ids[:num_tokens], i.positions[:num_tokens])
        if self.hidden_cache is not None:  # MTP reads it in later steps
            cache = self.hidden_cache
            cache.view(-1, cache.shape[-1])[meta.slot_mapping] = hidden.to(cache.dtype)
        return self.model.compute_logits(hidden)
