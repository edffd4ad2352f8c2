"""MTP's draft passes of a padded step (``spec_inputs.py``: padded MTP drafting) from static
buffers, replayed from CUDA graphs.

A step whose rows all draft, and whose catch-ups are at most ``W = K + 1`` positions each (every
decode step but a prompt's first), drafts with passes of static shapes:

- **catch-up**: ``W`` positions per row; the previous hidden state of each real position is the
  hidden cache's entry at its slot (read inside the graph: the cache never moves), 0 at padding
  positions (``valid``); the row's newest MTP hidden state, at ``last``, goes to ``previous``.
  Returns the logits there (``d_1``'s).
- **chained pass i** (one per draft after the first, layer ``i % num_layers``): one token per
  row, the previous draft, at ``start + i - 1``, reading ``previous`` and writing its own hidden
  state back there. Returns the logits (``d_{i+1}``'s).

So the graphs' inputs are the ``InputBuffers`` (ids, positions, slots, sequence lengths, query
starts, block tables), ``valid``, ``last`` and ``previous``: all in ``runtime``, allocated once
and guarded, never replaced on wake (DESIGN §3 invariant 2), as the hidden cache and the MTP
layers' KV (``kv_cache``) and weights (``weights``). Sampling runs outside, so greedy and
probabilistic drafts both replay.

A batch pads up to a captured size with dummy rows in the null block (catch-up: ``W`` tokens at
positions ``0 .. W - 1``, nothing valid; chained: one token at position 0). Without graphs (the
CPU, ``enforce_eager``, a batch past the graphs) the same buffers feed the same bodies eagerly,
so the CPU tests run this very path. ``num_graph_replays`` counts replays.
"""

from __future__ import annotations

from functools import partial

import torch

from dormant.core.config import EngineConfig
from dormant.layers.context import AttentionMetadata, forward_context
from dormant.memory import RUNTIME, MemoryManager
from dormant.worker.graph_capture import capture_passes
from dormant.worker.input_buffers import InputBuffers
from dormant.worker.mtp_draft import MTPDraftModel

Graphs = dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]]  # batch size -> graph, logits


class MTPDecoder:
    def __init__(
        self,
        draft: MTPDraftModel,
        mm: MemoryManager,
        config: EngineConfig,
        null_block: int,
        num_drafts: int,
    ) -> None:
        self.draft, self.mm, self.config = draft, mm, config
        self.width = num_drafts + 1
        self.num_drafts = num_drafts
        self.inputs = InputBuffers(mm, config, null_block)
        self.null_block = null_block
        self.max_rows = min(config.max_num_seqs, config.max_num_batched_tokens // self.width)
        hidden_size, dtype = draft.model.config.hidden_size, draft.model.config.dtype
        self.valid, self.last, self.previous = mm.empty_many(
            [
                ((config.max_num_batched_tokens,), torch.int64),
                ((config.max_num_seqs,), torch.int64),
                ((config.max_num_seqs, hidden_size), dtype),
            ],
            RUNTIME,
        )
        for tensor in (self.valid, self.last, self.previous):
            tensor.zero_()
        self.catch_up_graphs: Graphs = {}
        self.step_graphs: dict[int, Graphs] = {}  # layer -> its chained passes' graphs
        self.num_graph_replays = 0

    def tensors(self) -> list[torch.Tensor]:
        """Every static buffer a graph reads (what the pointer guard watches)."""
        return [*self.inputs.tensors(), self.valid, self.last, self.previous]

    def fits(self, num_rows: int) -> bool:
        return num_rows <= self.max_rows

    def capture(self, batch_sizes: list[int]) -> None:
        """Captures the catch-up's graph and each layer's chained pass's per batch size that
        fits, largest first (GPU only), once: warm-ups first, then the captures."""
        sizes = sorted((bs for bs in batch_sizes if bs <= self.max_rows), reverse=True)
        passes: list[tuple[Graphs, int, int | None]] = []
        for bs in sizes:
            passes.append((self.catch_up_graphs, bs, None))
            for chained in self._chained_layers():
                passes.append((self.step_graphs.setdefault(chained, {}), bs, chained))
        bodies = [
            (partial(self._pad, 0, bs, layer), partial(self._body, bs, layer))
            for _, bs, layer in passes
        ]
        captured = capture_passes(self.mm, bodies, "the MTP draft graphs were captured")
        for (graphs, bs, _), graph_and_output in zip(passes, captured, strict=True):
            graphs[bs] = graph_and_output

    def catch_up(
        self,
        views: list[torch.Tensor],
        input_ids: torch.Tensor,
        last: torch.Tensor,
        valid: torch.Tensor,
        block_width: int,
    ) -> torch.Tensor:
        """The catch-up of ``n`` rows (its ``PassLayout`` device views, its padded ids, each
        row's last real index and the valid flags): the logits at each row's last real
        position (float32 [n, V]); each row's hidden state there is in ``previous``."""
        n = views[2].shape[0]
        self._load(views, input_ids, block_width)
        self.valid[: n * self.width].copy_(valid)
        self.last[:n].copy_(last)
        return self._run(self.catch_up_graphs, n, None)

    def step(
        self, input_ids: torch.Tensor, views: list[torch.Tensor], block_width: int, step: int
    ) -> torch.Tensor:
        """Chained pass ``step`` over ``n`` rows (one token each, after the catch-up or the
        pass before): the logits (float32 [n, V]); the new hidden states are in ``previous``."""
        self._load(views, input_ids, block_width)
        layer = step % self.draft.model.num_layers
        return self._run(self.step_graphs.get(layer, {}), input_ids.shape[0], layer)

    def _chained_layers(self) -> list[int]:
        num_layers = self.draft.model.num_layers
        return sorted({i % num_layers for i in range(1, self.num_drafts)})

    def _run(self, graphs: Graphs, n: int, layer: int | None) -> torch.Tensor:
        size = next((bs for bs in sorted(graphs) if bs >= n), None)
        if size is None:
            return self._body(n, layer)
        self._pad(n, size, layer)
        graph, output = graphs[size]
        graph.replay()
        self.num_graph_replays += 1
        return output[:n]

    def _load(self, views: list[torch.Tensor], input_ids: torch.Tensor, block_width: int) -> None:
        positions, slots, seq_lens, query_start_loc, tables = views
        i, n, num_tokens = self.inputs, seq_lens.shape[0], input_ids.shape[0]
        i.input_ids[:num_tokens].copy_(input_ids)
        i.positions[:num_tokens].copy_(positions)
        i.slot_mapping[:num_tokens].copy_(slots)
        i.seq_lens[:n].copy_(seq_lens)
        i.query_start_loc[: n + 1].copy_(query_start_loc)
        i.block_tables[:n, :block_width].copy_(tables.view(n, block_width))

    def _pad(self, start: int, stop: int, layer: int | None) -> None:
        """Rows ``start .. stop`` become dummy rows in the null block: ``W`` tokens at
        positions ``0 .. W - 1`` (the catch-up, ``layer`` None, nothing valid) or one."""
        if stop <= start:
            return
        i = self.inputs
        width = self.width if layer is None else 1
        first, end = start * width, stop * width
        offsets = torch.arange(width, device=i.positions.device).repeat(stop - start)
        i.input_ids[first:end].zero_()
        i.positions[first:end].copy_(offsets)
        i.slot_mapping[first:end].copy_(self.null_block * i.block_size + offsets % i.block_size)
        i.seq_lens[start:stop].fill_(width)
        i.query_start_loc[start + 1 : stop + 1].copy_(
            torch.arange(start + 1, stop + 1, device=i.positions.device) * width
        )
        i.block_tables[start:stop].fill_(self.null_block)
        if layer is None:
            self.valid[first:end].zero_()
            self.last[start:stop].copy_(
                torch.arange(start, stop, device=i.positions.device) * width
            )

    def _body(self, num_rows: int, layer: int | None) -> torch.Tensor:
        """The pass over the buffers' first ``num_rows`` rows: the catch-up (``layer`` None)
        or a chained pass of ``layer``. What a graph captures."""
        i = self.inputs
        width = self.width if layer is None else 1
        num_tokens = num_rows * width
        meta = AttentionMetadata(
            slot_mapping=i.slot_mapping[:num_tokens],
            block_tables=i.block_tables[:num_rows],
            seq_lens=i.seq_lens[:num_rows],
            query_start_loc=i.query_start_loc[: num_rows + 1],
            max_query_len=width,
            max_seq_len=self.config.max_model_len,
        )
        ids, positions = i.input_ids[:num_tokens], i.positions[:num_tokens]
        previous = self.previous[:num_rows]
        model = self.draft.model
        if layer is None:
            cache = self.draft.hidden_cache
            assert cache is not None
            cached = cache.view(-1, cache.shape[-1])[meta.slot_mapping]
            is_real = self.valid[:num_tokens, None] != 0
            with forward_context(meta):
                hidden = model(ids, positions, torch.where(is_real, cached, 0.0), 0)
            previous.copy_(hidden[self.last[:num_rows]])
        else:
            with forward_context(meta):
                hidden = model(ids, positions, previous, layer)
            previous.copy_(hidden)
        return model.compute_logits(previous)
