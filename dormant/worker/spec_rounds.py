"""Speculative decoding inside the fused multi-step graph: ``M`` rounds of (draft ``k``, verify
``k + 1``, accept, feed back) per replay, for all-greedy batches with a draft model.

Each of the ``M = cuda_graph_multi_steps`` rounds of one replay, per row, on the device only:

1. **Draft**: ``k + 1`` one-token passes of the draft at ``p .. p + k`` (``p``: the position of
   the row's newest token): the newest token, then each draft fed back; the first ``k`` propose
   ``d_1 .. d_k`` (argmax), the last only writes ``d_k``'s draft KV, so that the draft never
   trails the target and the next round's catch-up is again one token (``spec_inputs.py``).
2. **Verify**: the target's pass over ``[newest, d_1 .. d_k]`` at ``p .. p + k``.
3. **Accept** (as ``rejection_sampler.verify`` does for greedy rows): ``a`` = the drafts equal
   to the target's argmax before the first that is not; the row emits the target's argmax at
   ``p .. p + a`` (``a + 1`` tokens: the accepted drafts and the target's own next token).
4. **Feed back**: that last token is the newest, at ``p + a + 1``.

Slots come from the block tables on the device: a row's positions stay below ``p + M (k + 1)``,
which the scheduler's lookahead blocks cover. Rejected drafts' KV lies past the row's length, as
in single speculative steps, and is written again before anything reads it.

The replay computes exactly what ``M`` single speculative steps compute (``spec_step.py``, with
its graphs at the same padded batch sizes), so tokens, counts and logprobs are theirs; the CPU
tests check it with the body run eagerly. Batches it does not fit run as ``M`` single steps
(``spec_round_steps.py``).

| buffer (``runtime``) | shape                   | what                                         |
|----------------------|-------------------------|----------------------------------------------|
| newest, position     | [max_bs] int64          | each row's newest token and its position     |
| tokens               | [M, max_bs, k + 1] int64| each round's emitted tokens, -1 past the last|
| counts               | [M, max_bs] int64       | each round's emitted count, ``1 .. k + 1``   |
| logprobs             | [M, max_bs * (k + 1), w]| the target's packed logprobs at each position|

The block tables are the verifier's (``target_verifier.py``) and the draft's passes read the
draft decoder's buffers (``draft_decoder.py``): all allocated once, so every captured address
holds across sleeps. Padding rows are dummy rows in the null block (position 0, token 0).
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import torch

from dormant.core.step_input import SeqInput, StepInput
from dormant.core.step_output import SeqOutput, StepOutput, TokenLogprobs
from dormant.layers.context import forward_context
from dormant.memory import RUNTIME, MemoryManager
from dormant.memory.torch_usage import clear_cublas_workspaces
from dormant.worker.draft_decoder import DraftDecoder
from dormant.worker.input_buffers import Staging
from dormant.worker.logprobs import (
    HostCopy,
    LogprobsMode,
    packed_logprobs,
    packed_width,
    trim_top,
    unpack_logprobs,
)
from dormant.worker.target_verifier import TargetVerifier

RAW_MODES = ("raw_logprobs", "raw_logits")  # a greedy row's logprobs need no sampler state


class SpecRounds:
    """The fused rounds' buffers, bodies and graphs (one per batch size), over ``decoder``'s
    and ``verifier``'s passes."""

    def __init__(
        self,
        decoder: DraftDecoder,
        verifier: TargetVerifier,
        mm: MemoryManager,
        num_rounds: int,
        logprobs_mode: LogprobsMode,
        num_top_logprobs: int,
    ) -> None:
        self.decoder, self.verifier, self.mm = decoder, verifier, mm
        self.num_rounds, self.logprobs_mode = num_rounds, logprobs_mode
        self.num_top = num_top_logprobs
        self.width = verifier.width  # k + 1
        self.block_size = verifier.inputs.block_size
        self.max_rows = verifier.max_rows
        device = mm.backend.device
        m, bs, w = num_rounds, self.max_rows, self.width
        int64, width = torch.int64, packed_width(num_top_logprobs)
        shapes = [((bs,), int64), ((bs,), int64), ((w,), int64), ((m, bs, w), int64),
                  ((m, bs), int64), ((m, bs * w, width), torch.int32)]  # fmt: skip
        tensors = mm.empty_many(shapes, RUNTIME)
        self.newest, self.position, self.offsets, self.tokens, self.counts, self.logprobs = tensors
        self.offsets.copy_(torch.arange(w, device=device))
        self.graphs: dict[int, Any] = {}  # batch size -> a CUDA graph (or a stand-in)
        self.num_replays = 0
        self._staging = Staging(device)
        self._host_copy = HostCopy(device)

    def tensors(self) -> list[torch.Tensor]:
        """The buffers a replay reads and writes at fixed addresses (the pointer guard's)."""
        return [self.newest, self.position, self.offsets, self.tokens, self.counts, self.logprobs]

    # ── which batches, and running them ───────────────────────────────────────────────────────

    def padded_size(self, num_rows: int) -> int | None:
        return next((bs for bs in sorted(self.graphs) if bs >= num_rows), None)

    def fits(self, seqs: tuple[SeqInput, ...], mode: LogprobsMode, max_len: int) -> bool:
        """Whether a replay computes what these decode rows ask: each greedy, drafting ``k``
        with its draft caught up but for its newest token, no logits processor, at most the
        logprobs the graph carries in ``mode`` (a raw mode), and positions below ``max_len``."""
        k, reach = self.width - 1, self.num_rounds * self.width - 1
        if self.padded_size(len(seqs)) is None:
            return False
        asked = _asked_logprobs(seqs)
        if asked and (mode not in RAW_MODES or mode != self.logprobs_mode):
            return False
        if asked and not all(0 <= n <= self.num_top for n in asked):  # -1: everything
            return False
        return all(
            s.params.is_greedy and s.num_draft_tokens == k and len(s.token_ids) == 1
            and not s.draft_prefix_token_ids and not s.masked_stop_token_ids
            and not s.bad_words_token_ids and s.start_position + reach < max_len
            and len(s.block_table) * self.block_size > s.start_position + reach
            for s in seqs
        )  # fmt: skip

    def run(self, step: StepInput) -> StepOutput:
        """Loads ``step`` (rows that ``fits``), replays the rounds' graph of its padded size and
        reads the results back: per row every round's emitted tokens, in order."""
        seqs, n = step.seqs, len(step.seqs)
        bs = self.padded_size(n)
        assert bs is not None, "the batch does not fit a captured size: check fits() first"
        self._load(seqs, bs)
        self.graphs[bs].replay()
        self.num_replays += 1
        asked = _asked_logprobs(seqs)
        parts = [self.tokens[:, :n], self.counts[:, :n]]
        width = None
        if asked:
            packed = self.logprobs[:, : n * self.width]
            packed = trim_top(packed, max(asked))
            width = packed.shape[-1]
            parts.append(packed)
        self._host_copy.start(parts)
        return self._outputs(self._host_copy.wait(), seqs, width)

    def _load(self, seqs: tuple[SeqInput, ...], bs: int) -> None:
        """Rows ``0 .. n``: their newest tokens, positions and block tables; the rest padding."""
        n, inputs = len(seqs), self.verifier.inputs
        width = max(len(s.block_table) for s in seqs)
        tables = np.full((n, width), inputs.null_block, np.int64)
        for row, seq in enumerate(seqs):
            tables[row, : len(seq.block_table)] = seq.block_table
        newest = np.fromiter((s.token_ids[0] for s in seqs), np.int64, n)
        positions = np.fromiter((s.start_position for s in seqs), np.int64, n)
        (newest_view, position_view, table_view), _ = self._staging.stage(
            [newest, positions, tables.reshape(-1)]
        )
        self._fill_padding(n, bs)
        self.newest[:n].copy_(newest_view)
        self.position[:n].copy_(position_view)
        inputs.block_tables[:n, :width].copy_(table_view.view(n, width))

    def _fill_padding(self, start: int, bs: int) -> None:
        """Rows ``start .. bs`` become dummy rows (token 0 at position 0, the null block), and
        the passes' query starts are those of ``bs`` rows (one token each, ``k + 1`` each)."""
        self.newest[start:bs].zero_()
        self.position[start:bs].zero_()
        self.verifier.inputs.block_tables[start:bs].fill_(self.verifier.inputs.null_block)
        self.verifier._pad(0, bs)  # its query starts; positions and slots are the body's
        draft = self.decoder.inputs
        draft.query_start_loc[: bs + 1].copy_(
            torch.arange(bs + 1, device=draft.query_start_loc.device)
        )

    def _outputs(
        self, host: np.ndarray, seqs: tuple[SeqInput, ...], width: int | None
    ) -> StepOutput:
        """Each row's tokens over the rounds (``tokens``, ``counts``, then the packed logprobs
        of every position), and its draft's exact positions: all but the newest token's."""
        m, n, w = self.num_rounds, len(seqs), self.width
        end = m * n * w
        tokens = host[:end].reshape(m, n, w)
        counts = host[end : end + m * n].reshape(m, n)
        end += m * n
        entries = None
        if width is not None:
            entries = unpack_logprobs(host[end:].reshape(m * n * w, width))
        outputs, round_counts = [], counts.T.tolist()
        for row, seq in enumerate(seqs):
            emitted: list[int] = []
            row_logprobs: list[TokenLogprobs] | None = None
            if entries is not None and seq.params.logprobs is not None:
                row_logprobs = []
            for round_, count in enumerate(round_counts[row]):
                emitted += tokens[round_, row, :count].tolist()
                if row_logprobs is not None and entries is not None:
                    first = (round_ * n + row) * w
                    row_logprobs += entries[first : first + count]
            computed = seq.start_position + len(emitted)  # the newest token's is missing
            lps = None if row_logprobs is None else tuple(row_logprobs)
            outputs.append(SeqOutput(tuple(emitted), lps, None, computed))
        return StepOutput(tuple(outputs), tuple(map(tuple, round_counts)))

    # ── the body, and capturing it ────────────────────────────────────────────────────────────

    def capture(self, batch_sizes: list[int]) -> None:
        """Warms up, then captures, one graph per batch size that fits, largest first (GPU
        only), once, into the ``cuda_graph`` pool."""
        sizes = sorted((bs for bs in batch_sizes if bs <= self.max_rows), reverse=True)
        stream = torch.cuda.Stream()
        with torch.inference_mode():
            for bs in sizes:
                self._fill_padding(0, bs)
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    self.body(bs)
                torch.cuda.current_stream().wait_stream(stream)
            clear_cublas_workspaces()  # capture allocates its own, in the graph pool
            pool = cast(Any, self.mm.graph_pool().id)
            for bs in sizes:
                self._fill_padding(0, bs)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.body(bs)
                self.graphs[bs] = graph
        torch.cuda.synchronize()
        clear_cublas_workspaces()
        self.mm.residual.mark("the speculative rounds' graphs were captured")

    def body(self, bs: int) -> torch.Tensor:
        """``M`` rounds of ``bs`` rows from the state buffers (see the module); never
        synchronizes with the host, so it is what the graphs capture (and the CPU runs).
        Returns the tokens buffer (the rounds' output)."""
        k, w, block_size = self.width - 1, self.width, self.block_size
        target, draft = self.verifier.inputs, self.decoder.inputs
        tables = target.block_tables[:bs]
        draft.block_tables[:bs].copy_(tables)
        newest, position = self.newest[:bs], self.position[:bs]
        offsets = self.offsets
        for round_ in range(self.num_rounds):
            drafts = self._draft(bs, tables, newest, position)
            positions = position[:, None] + offsets[None, :]  # [bs, k + 1]
            ids = target.input_ids[: bs * w].view(bs, w)
            ids[:, 0].copy_(newest)
            ids[:, 1:].copy_(drafts)
            target.positions[: bs * w].copy_(positions.reshape(-1))
            target.slot_mapping[: bs * w].copy_(_slots(tables, positions, block_size).reshape(-1))
            target.seq_lens[:bs].copy_(position + w)
            logits = self.verifier._forward(bs)  # [bs * (k + 1), V]
            argmax = logits.argmax(dim=-1)
            best = argmax.view(bs, w)
            accepted = (drafts == best[:, :k]).long().cumprod(dim=-1).sum(dim=-1)
            is_emitted = offsets[None, :] <= accepted[:, None]
            self.tokens[round_, :bs].copy_(torch.where(is_emitted, best, -1))
            self.counts[round_, :bs].copy_(accepted + 1)
            self.logprobs[round_, : bs * w].copy_(
                packed_logprobs(logits, argmax, self.num_top, self.logprobs_mode)
            )
            newest.copy_(best.gather(1, accepted[:, None]).squeeze(1))
            position.add_(accepted + 1)
        return self.tokens

    def _draft(
        self,
        bs: int,
        tables: torch.Tensor,
        newest: torch.Tensor,
        position: torch.Tensor,
    ) -> torch.Tensor:
        """The draft's ``k + 1`` passes of one round; returns ``d_1 .. d_k`` (int64 [bs, k])."""
        k, block_size = self.width - 1, self.block_size
        inputs, graphs = self.decoder.inputs, self.decoder.graphs
        drafts = torch.empty((bs, k), dtype=torch.int64, device=newest.device)
        token = newest
        for i in range(k + 1):
            positions = position + i
            inputs.input_ids[:bs].copy_(token)
            inputs.positions[:bs].copy_(positions)
            inputs.seq_lens[:bs].copy_(positions + 1)
            inputs.slot_mapping[:bs].copy_(_slots(tables, positions[:, None], block_size)[:, 0])
            if i == k:  # d_k's KV only: its logits would propose nothing
                with forward_context(graphs._meta(bs)):
                    self.decoder.model(inputs.input_ids[:bs], inputs.positions[:bs])
                break
            token = graphs._forward(bs).argmax(dim=-1)
            drafts[:, i].copy_(token)
        return drafts


def _asked_logprobs(seqs: tuple[SeqInput, ...]) -> set[int]:
    """The distinct top-logprob counts the rows ask for (-1: the whole vocabulary)."""
    return {int(s.params.logprobs) for s in seqs if s.params.logprobs is not None}


def _slots(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The KV slots (int64, ``positions``' shape [bs, j]) of each row's ``positions``."""
    blocks = tables.gather(1, positions // block_size).long()
    return blocks * block_size + positions % block_size


__all__ = ["RAW_MODES", "SpecRounds"]
