"""CUDA graphs of the decode step, captured once into the ``cuda_graph`` pool and never again.

Two kinds, one per captured batch size (a batch is padded up to the next size):

- ``full``: one decode step, attention included: inputs → logits.
- ``multi_step``: ``num_steps`` decode steps in one replay, sampling and KV append included,
  and each step's logprobs (the sampled token's value and rank and a fixed number of top
  tokens, packed as ``worker/logprobs.py`` describes). Each step samples with the single
  step's sampler (``sampler.sample_and_process``), greedy rows and unfiltered random rows
  alike, from static per-step sampling rows (``worker/graph_sampling.py``), so its tokens are
  those of ``num_steps`` single steps. Between steps the graph feeds each sampled token back,
  advances the positions and sequence lengths, and recomputes the slot mapping from the block
  tables, all on the device.
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
| multi-step sampling rows           | ``runtime``, explicit (``GraphSampling``)                |
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

from dormant.core.step_input import StepInput
from dormant.layers.context import AttentionMetadata, forward_context
from dormant.memory import RUNTIME, MemoryManager
from dormant.memory.torch_usage import clear_cublas_workspaces
from dormant.models import CausalLM
from dormant.worker.graph_sampling import GraphSampling
from dormant.worker.input_buffers import InputBuffers
from dormant.worker.logprobs import LogprobsMode, packed_logprobs, packed_width
from dormant.worker.sampler import sample_and_process


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
        """``num_top_logprobs``: the top tokens each multi-step logprobs row carries, of the
        raw logits (``raw_*`` modes) or of the sampler's processed ones (``processed_*``),
        as a single step reports them. The multi-step graphs' sampling rows are allocated
        here (``runtime``), so the body also runs eagerly, without a capture."""
        self.model, self.inputs, self.mm = model, inputs, mm
        self.batch_sizes = sorted(batch_sizes)
        self.num_steps = num_steps
        self.max_model_len = max_model_len
        self.logprobs_mode = logprobs_mode
        self.num_top_logprobs = num_top_logprobs
        self.full: dict[int, CapturedGraph] = {}
        self.multi_step: dict[int, CapturedGraph] = {}
        self.sampling: GraphSampling | None = None
        # The top logprobs a multi-step replay computes, of the num_top_logprobs it carries:
        # the most its batch asks for (``load_multi_step``), read by the kernel at run time
        self.live_top: torch.Tensor | None = None
        self._live_top = num_top_logprobs
        if num_steps > 1:
            vocab_size = model.config.vocab_size
            self.sampling = GraphSampling(mm, self.batch_sizes[-1], num_steps, vocab_size)
            (self.live_top,) = mm.empty_many([((1,), torch.int32)], RUNTIME)
            self.live_top.fill_(num_top_logprobs)

    def padded_size(self, num_seqs: int) -> int | None:
        return next((bs for bs in self.batch_sizes if bs >= num_seqs), None)

    def load_multi_step(
        self, step: StepInput, bs: int, previous_tokens: torch.Tensor | None = None
    ) -> None:
        """Writes what a replay of the ``bs``-row multi-step graph reads for ``step`` (a
        decode batch of at most ``bs`` rows, each ``graph_sampling.is_unfiltered``): the
        step's input buffers, every step's sampling rows, padded to ``bs``, and the top
        logprobs its rows ask for (at most ``num_top_logprobs``: ``fits_multi_step_graph``).
        ``previous_tokens``: as ``InputBuffers.load`` takes them."""
        assert self.sampling is not None and self.live_top is not None, "num_steps is 1"
        self.inputs.load(step, pad_to=bs, previous_tokens=previous_tokens)
        self.sampling.load(step.seqs, bs)
        asked = {int(s.params.logprobs) for s in step.seqs if s.params.logprobs is not None}
        cap = self.num_top_logprobs
        live = min(max((n if n >= 0 else cap for n in asked), default=0), cap)  # -1: all
        if live != self._live_top:  # a fill only when it changes
            self.live_top.fill_(live)
            self._live_top = live

    def capture(self) -> None:
        """Warms up, then captures, every batch size, largest first (smaller graphs reuse the
        pool's memory)."""
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
        self._warm_up([(bs, body) for bs, body, _ in bodies])
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

    def _warm_up(self, bodies: list[tuple[int, Callable[[], torch.Tensor]]]) -> None:
        """Runs every body once on one side stream, on padding rows: compiles and loads the
        kernels, creates the cuBLAS handle, so that none of it happens inside a capture."""
        stream = torch.cuda.Stream()
        for bs, body in bodies:
            self._fill_padding(bs)  # the last warm-up advanced the multi-step inputs
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                body()
            torch.cuda.current_stream().wait_stream(stream)
        self._fill_padding(self.batch_sizes[-1])

    def _fill_padding(self, bs: int) -> None:
        """Makes every row a dummy sequence, the sampling rows of a ``bs``-row graph too."""
        self.inputs.fill_padding()
        if self.sampling is not None:
            self.sampling.fill_padding(bs)

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
        """The multi-step graph's body: ``num_steps`` decode steps of the ``bs`` rows the
        buffers hold (``load_multi_step``), each sampled as ``StepSampler.sample`` samples
        an unfiltered batch, tokens into ``tokens`` [N, bs] and packed logprobs into
        ``logprobs`` [N, bs, w]. Runs eagerly too (the CPU tests check it against single
        steps); it never synchronizes with the host."""
        assert self.sampling is not None, "no multi-step graphs: num_steps is 1"
        i, block_size = self.inputs, self.inputs.block_size
        ids, positions, slots = i.input_ids[:bs], i.positions[:bs], i.slot_mapping[:bs]
        seq_lens, tables = i.seq_lens[:bs], i.block_tables[:bs]
        mode = self.logprobs_mode
        keep_processed = mode.startswith("processed")
        for step, sampling in enumerate(self.sampling.rows(bs)):
            logits = self._forward(bs)
            token, processed = sample_and_process(logits, sampling, keep_processed)
            tokens[step].copy_(token)
            values = logits if processed is None else processed
            packed = packed_logprobs(values, token, self.num_top_logprobs, mode, self.live_top)
            logprobs[step].copy_(packed)
            if step + 1 == self.num_steps:
                break
            ids.copy_(token)
            positions.add_(1)
            seq_lens.add_(1)
            blocks = tables.gather(1, (positions // block_size).unsqueeze(1)).squeeze(1)
            slots.copy_(blocks.long() * block_size + positions % block_size)
        return tokens
