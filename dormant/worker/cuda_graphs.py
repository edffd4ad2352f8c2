"""CUDA graphs of the decode step, captured once into the ``cuda_graph`` pool and never again.

Two kinds, one per captured batch size (a batch is padded up to the next size):

- ``full``: one decode step, attention included: inputs → logits.
- ``multi_step``: ``num_steps`` greedy decode steps in one replay, sampling and KV append
  included, and each step's logprobs (the sampled token's value and rank and a fixed number of
  top tokens, packed as ``worker/logprobs.py`` describes). Between steps the graph feeds each
  sampled token back, advances the positions and sequence lengths, and recomputes the slot
  mapping from the block tables, all on the device.
  This is the shape of graph that crashed in the prior art when block tables and their layout
  tensors were rebuilt on wake: it reads them at captured addresses, again and again.

Every tensor a graph reads lives in ``runtime`` (inputs, block tables, scales) or ``weights`` /
``kv_cache``, allocated once; the graph's own intermediates live in the ``cuda_graph`` pool. So a
sleep/wake cycle at any level leaves every captured address valid and nothing is recaptured.

Nothing a capture leaves behind lives outside the tags (the residual, ``memory/residual.py``):

| what                               | where                                                    |
|------------------------------------|----------------------------------------------------------|
| full graph outputs (logits)        | allocated in capture: the ``cuda_graph`` pool            |
| multi-step tokens and logprobs     | ``runtime``, explicit                                    |
| the capture's cuBLAS workspace     | the ``cuda_graph`` pool: the workspaces are cleared      |
|                                    | before capturing, so cuBLAS allocates one in capture     |
| the warm-ups' intermediates        | torch's cache, returned at sleep                         |
| the warm-up stream's workspace     | cleared after capturing (one stream for every warm-up:   |
|                                    | torch keeps a workspace per stream, 32 MiB on Hopper)    |

The warm-ups all run first, then the captures, and the manager samples the device after each
phase, so the residual tells modules loaded (warm-up) from graph executables (capture).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import torch

from dormant.layers.context import AttentionMetadata, forward_context
from dormant.memory import RUNTIME, MemoryManager
from dormant.memory.torch_usage import clear_cublas_workspaces
from dormant.models import CausalLM
from dormant.worker.input_buffers import InputBuffers
from dormant.worker.logprobs import LogprobsMode, packed_logprobs, packed_width


@dataclass(frozen=True)
class CapturedGraph:
    graph: torch.cuda.CUDAGraph
    output: torch.Tensor  # full: logits [bs, vocab]; multi_step: tokens [num_steps, bs]
    logprobs: torch.Tensor | None = None  # multi_step: int32 [num_steps, bs, packed width]


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        inputs: InputBuffers,
        mm: MemoryManager,
        batch_sizes: list[int],
        num_steps: int,
        max_model_len: int,
        logprobs_mode: LogprobsMode,
        num_top_logprobs: int,
    ) -> None:
        """``num_top_logprobs``: the top tokens each multi-step logprobs row carries. Greedy
        rows' processed logits are their logits, so ``logprobs_mode`` only picks logprobs
        (log-softmax) or logits."""
        self.model, self.inputs, self.mm = model, inputs, mm
        self.batch_sizes = sorted(batch_sizes)
        self.num_steps = num_steps
        self.max_model_len = max_model_len
        self.logprobs_mode = logprobs_mode
        self.num_top_logprobs = num_top_logprobs
        self.full: dict[int, CapturedGraph] = {}
        self.multi_step: dict[int, CapturedGraph] = {}

    def padded_size(self, num_seqs: int) -> int | None:
        return next((bs for bs in self.batch_sizes if bs >= num_seqs), None)

    def capture(self) -> None:
        """Warms up, then captures, every batch size, largest first (smaller graphs reuse the
        pool's memory)."""
        self.inputs.fill_padding()
        bodies: list[tuple[int, Callable[[], torch.Tensor], tuple[torch.Tensor, ...]]] = []
        for bs in reversed(self.batch_sizes):
            bodies.append((bs, partial(self._forward, bs), ()))
            if self.num_steps > 1:
                shapes = [
                    ((self.num_steps, bs), torch.int64),
                    ((self.num_steps, bs, packed_width(self.num_top_logprobs)), torch.int32),
                ]
                tokens, logprobs = self.mm.empty_many(shapes, RUNTIME)
                steps = partial(self._steps, bs, tokens, logprobs)
                bodies.append((bs, steps, (tokens, logprobs)))
        self._warm_up([body for _, body, _ in bodies])
        self.mm.residual.mark("the decode graphs warmed up (kernels loaded)")
        clear_cublas_workspaces()  # capture allocates its own, in the graph pool
        for bs, body, outputs in bodies:
            captured = self._capture(body)
            if outputs:
                tokens, logprobs = outputs
                self.multi_step[bs] = CapturedGraph(captured.graph, tokens, logprobs)
            else:
                self.full[bs] = captured
        torch.cuda.synchronize()
        clear_cublas_workspaces()  # the warm-up stream's: nothing outlives capture untagged
        self.mm.residual.mark("the decode graphs were captured (graph executables)")

    def _warm_up(self, bodies: list[Callable[[], torch.Tensor]]) -> None:
        """Runs every body once on one side stream: compiles and loads the kernels, creates the
        cuBLAS handle, so that none of it happens inside a capture."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        for body in bodies:
            with torch.cuda.stream(stream):
                body()
            torch.cuda.current_stream().wait_stream(stream)
            self.inputs.fill_padding()  # the warm-up advanced the multi-step inputs
            stream.wait_stream(torch.cuda.current_stream())

    def _capture(self, body: Callable[[], torch.Tensor]) -> CapturedGraph:
        graph = torch.cuda.CUDAGraph()
        pool = cast(Any, self.mm.graph_pool().id)  # torch types the handle loosely
        with torch.cuda.graph(graph, pool=pool):
            output = body()
        self.inputs.fill_padding()
        return CapturedGraph(graph, output)

    def _meta(self, bs: int) -> AttentionMetadata:
        i = self.inputs
        return AttentionMetadata(
            slot_mapping=i.slot_mapping[:bs],
            block_tables=i.block_tables[:bs],
            seq_lens=i.seq_lens[:bs],
            query_start_loc=i.query_start_loc[: bs + 1],
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )

    def _forward(self, bs: int) -> torch.Tensor:
        with forward_context(self._meta(bs)):
            hidden = self.model(self.inputs.input_ids[:bs], self.inputs.positions[:bs])
        return self.model.compute_logits(hidden)

    def _steps(self, bs: int, tokens: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
        i, block_size = self.inputs, self.inputs.block_size
        ids, positions, slots = i.input_ids[:bs], i.positions[:bs], i.slot_mapping[:bs]
        seq_lens, tables = i.seq_lens[:bs], i.block_tables[:bs]
        for step in range(self.num_steps):
            logits = self._forward(bs)
            token = logits.argmax(dim=-1)
            tokens[step].copy_(token)
            packed = packed_logprobs(logits, token, self.num_top_logprobs, self.logprobs_mode)
            logprobs[step].copy_(packed)
            if step + 1 == self.num_steps:
                break
            ids.copy_(token)
            positions.add_(1)
            seq_lens.add_(1)
            blocks = tables.gather(1, (positions // block_size).unsqueeze(1)).squeeze(1)
            slots.copy_(blocks.long() * block_size + positions % block_size)
        return tokens
