"""A draft model's single-token passes from static input buffers, replayed from CUDA graphs.

Every chained draft pass (and the catch-up of a step whose rows each have one token) is a
decode step of the draft: one token per row at known positions. ``DraftDecoder`` copies such a
pass's metadata (staged by ``spec_inputs.py``) and its input ids (the previous drafts, on the
device) into its own ``InputBuffers`` (in ``runtime``, never replaced), pads the batch up to a
captured size with dummy rows that write the null block, and replays the draft's ``full``
decode graph (``DecodeGraphs``, the target's machinery: captured once into the ``cuda_graph``
pool, valid across every sleep). Without graphs (the CPU, ``enforce_eager``, a batch larger
than any graph) the same buffers feed an eager pass, so the CPU tests run this very path.

Padding rows, as ``InputBuffers`` pads the target's graphs:

| buffer          | rows ``n .. bs``                         |
|-----------------|------------------------------------------|
| input_ids       | 0                                        |
| positions       | 0                                        |
| slot_mapping    | the null block's first slot              |
| seq_lens        | 1                                        |
| query_start_loc | ``n + 1 .. bs`` (one token each)         |
| block_tables    | the null block                           |
"""

from __future__ import annotations

import torch

from dormant.core.config import EngineConfig
from dormant.layers.context import AttentionMetadata
from dormant.memory import MemoryManager
from dormant.models import CausalLM
from dormant.worker.cuda_graphs import DecodeGraphs
from dormant.worker.input_buffers import InputBuffers


class DraftDecoder:
    def __init__(
        self, model: CausalLM, mm: MemoryManager, config: EngineConfig, null_block: int
    ) -> None:
        self.model, self.mm, self.config = model, mm, config
        self.inputs = InputBuffers(mm, config, null_block)
        self.null_block = null_block
        self.graphs = DecodeGraphs(
            model, self.inputs, mm, [config.max_num_seqs], 1, config.max_model_len,
            "raw_logprobs", 0,
        )  # fmt: skip
        self.is_captured = False

    def capture(self, batch_sizes: list[int]) -> None:
        """Captures a ``full`` decode graph of the draft per batch size (GPU only), once."""
        self.graphs.batch_sizes = sorted(batch_sizes)
        with torch.inference_mode():
            self.graphs.capture()
        self.is_captured = True

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The draft's logits (float32 [n, V]) of a one-token-per-row pass with ``meta``."""
        n = input_ids.shape[0]
        padded = self.graphs.padded_size(n) if self.is_captured else None
        size = padded or n
        self._load(input_ids, positions, meta, size)
        if padded is not None:
            captured = self.graphs.full[padded]
            captured.graph.replay()
            return captured.output[:n]
        return self.graphs._forward(size)[:n]

    def _load(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, size: int
    ) -> None:
        i, n = self.inputs, input_ids.shape[0]
        width = meta.block_tables.shape[1]
        i.input_ids[:n].copy_(input_ids)
        i.positions[:n].copy_(positions)
        i.slot_mapping[:n].copy_(meta.slot_mapping)
        i.seq_lens[:n].copy_(meta.seq_lens)
        i.query_start_loc[: n + 1].copy_(meta.query_start_loc)
        i.block_tables[:n, :width].copy_(meta.block_tables)
        if size > n:
            i.input_ids[n:size].zero_()
            i.positions[n:size].zero_()
            i.slot_mapping[n:size].fill_(self.null_block * i.block_size)
            i.seq_lens[n:size].fill_(1)
            i.query_start_loc[n + 1 : size + 1].copy_(
                torch.arange(n + 1, size + 1, device=i.query_start_loc.device)
            )
            i.block_tables[n:size].fill_(self.null_block)
