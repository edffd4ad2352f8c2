"""Speculative decoding inside the fused multi-step graph: ``M`` rounds of (draft ``k``, verify
``k + 1``, accept, feed back) per replay, for all-greedy batches, with a draft model or MTP.

Each of the ``M = cuda_graph_multi_steps`` rounds of one replay, per row, on the device only:

1. **Draft**: the draft's passes of the round (``spec_round_drafts.RoundDrafts``: a draft
   model's ``k + 1`` one-token passes, or MTP's catch-up and ``k - 1`` chained passes,
   ``mtp_rounds.py``), each draft the argmax: ``d_1 .. d_k``.
2. **Verify**: the target's pass over ``[newest, d_1 .. d_k]`` at ``p .. p + k`` (``p``: the
   position of the row's newest token; with MTP it writes the hidden cache there).
3. **Accept** (as ``rejection_sampler.verify`` does for greedy rows): ``a`` = the drafts equal
   to the target's argmax before the first that is not; the row emits the target's argmax at
   ``p .. p + a`` (``a + 1`` tokens: the accepted drafts and the target's own next token).
4. **Feed back**: that last token is the newest, at ``p + a + 1``; the draft takes what it must
   catch up on next (``RoundDrafts.feed_back``).

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
| live_top             | [1] int32               | the top logprobs a replay computes (of w's)  |

The block tables are the verifier's (``target_verifier.py``) and the draft's passes read their
decoder's buffers (``draft_decoder.py``, ``mtp_decoder.py``): all allocated once, so every
captured address holds across sleeps. Padding rows are dummy rows in the null block (position 0,
token 0). The host side (staging, reading back) is ``spec_round_outputs.py``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from dormant.core.step_input import SeqInput, StepInput
from dormant.core.step_output import StepOutput
from dormant.memory import RUNTIME, MemoryManager
from dormant.worker.graph_capture import capture_passes
from dormant.worker.input_buffers import Staging
from dormant.worker.logprobs import HostCopy, LogprobsMode, packed_logprobs, packed_width, trim_top
from dormant.worker.spec_round_drafts import RoundDrafts, slots
from dormant.worker.spec_round_outputs import round_arrays, round_outputs
from dormant.worker.target_verifier import TargetVerifier

RAW_MODES = ("raw_logprobs", "raw_logits")  # a greedy row's logprobs need no sampler state


class SpecRounds:
    """The fused rounds' buffers, bodies and graphs (one per batch size), over ``drafts``'
    and ``verifier``'s passes."""

    def __init__(
        self,
        drafts: RoundDrafts,
        verifier: TargetVerifier,
        mm: MemoryManager,
        num_rounds: int,
        logprobs_mode: LogprobsMode,
        num_top_logprobs: int,
    ) -> None:
        self.drafts, self.verifier, self.mm = drafts, verifier, mm
        self.num_rounds, self.logprobs_mode = num_rounds, logprobs_mode
        self.num_top = num_top_logprobs
        self.width = verifier.width  # k + 1
        self.block_size = verifier.inputs.block_size
        self.max_rows = verifier.max_rows
        device = mm.backend.device
        m, bs, w = num_rounds, self.max_rows, self.width
        int64, width = torch.int64, packed_width(num_top_logprobs)
        shapes = [((bs,), int64), ((bs,), int64), ((w,), int64), ((m, bs, w), int64),
                  ((m, bs), int64), ((m, bs * w, width), torch.int32),
                  ((1,), torch.int32)]  # fmt: skip
        tensors = mm.empty_many(shapes, RUNTIME)
        self.newest, self.position, self.offsets, self.tokens, self.counts = tensors[:5]
        self.logprobs, self.live_top = tensors[5:]
        self.offsets.copy_(torch.arange(w, device=device))
        # The top logprobs a replay computes, of the num_top it carries: the most its batch asks
        # for (``run``), read by the fused logprobs kernel at run time (``DecodeGraphs``' too)
        self.live_top.fill_(num_top_logprobs)
        self._live_top = num_top_logprobs
        self.graphs: dict[int, Any] = {}  # batch size -> a CUDA graph (or a stand-in)
        self.num_replays = 0
        self._staging = Staging(device)
        self._host_copy = HostCopy(device)

    def tensors(self) -> list[torch.Tensor]:
        """The buffers a replay reads and writes at fixed addresses (the pointer guard's)."""
        own = [self.newest, self.position, self.offsets, self.tokens, self.counts]
        return [*own, self.logprobs, self.live_top, *self.drafts.tensors()]

    # ── which batches, and running them ───────────────────────────────────────────────────────

    def padded_size(self, num_rows: int) -> int | None:
        return next((bs for bs in sorted(self.graphs) if bs >= num_rows), None)

    def fits(self, seqs: tuple[SeqInput, ...], mode: LogprobsMode, max_len: int) -> bool:
        """Whether a replay computes what these decode rows ask: each greedy, drafting ``k``
        with a draft state the rounds take (``RoundDrafts.fits``: a draft model caught up but
        for the newest token, MTP's 1 .. k + 1 positions to catch up on), no logits processor,
        at most the logprobs the graph carries in ``mode`` (a raw mode), and positions below
        ``max_len``."""
        k, reach = self.width - 1, self.num_rounds * self.width - 1
        if self.padded_size(len(seqs)) is None:
            return False
        asked = _asked_logprobs(seqs)
        if asked and (mode not in RAW_MODES or mode != self.logprobs_mode):
            return False
        if asked and not all(0 <= n <= self.num_top for n in asked):  # -1: everything
            return False
        return all(
            s.params.is_greedy and s.num_draft_tokens == k and self.drafts.fits(s)
            and not s.masked_stop_token_ids
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
        asked = _asked_logprobs(seqs)
        live = max(asked, default=0)  # fits(): 0 .. num_top each
        if live != self._live_top:  # a fill only when it changes
            self.live_top.fill_(live)
            self._live_top = live
        self._load(seqs, bs)
        self.graphs[bs].replay()
        self.num_replays += 1
        parts = [self.tokens[:, :n], self.counts[:, :n]]
        width = None
        if asked:
            packed = self.logprobs[:, : n * self.width]
            packed = trim_top(packed, max(asked))
            width = packed.shape[-1]
            parts.append(packed)
        self._host_copy.start(parts)
        host = self._host_copy.wait()
        return round_outputs(host, seqs, self.num_rounds, self.width, width, self.drafts.lag)

    def _load(self, seqs: tuple[SeqInput, ...], bs: int) -> None:
        """Rows ``0 .. n``: their newest tokens, positions, block tables and draft states; the
        rest padding."""
        n, inputs = len(seqs), self.verifier.inputs
        arrays = round_arrays(seqs, inputs.null_block)
        width = arrays[-1].size // n
        views, _ = self._staging.stage([*arrays, *self.drafts.host_arrays(seqs)])
        newest_view, position_view, table_view = views[:3]
        self._fill_padding(n, bs)
        self.newest[:n].copy_(newest_view)
        self.position[:n].copy_(position_view)
        inputs.block_tables[:n, :width].copy_(table_view.view(n, width))
        self.drafts.load(views[3:], n)

    def _fill_padding(self, start: int, bs: int) -> None:
        """Rows ``start .. bs`` become dummy rows (token 0 at position 0, the null block), and
        the passes' query starts are those of ``bs`` rows (one token each, ``k + 1`` each)."""
        self.newest[start:bs].zero_()
        self.position[start:bs].zero_()
        self.verifier.inputs.block_tables[start:bs].fill_(self.verifier.inputs.null_block)
        self.verifier._pad(0, bs)  # its query starts; positions and slots are the body's
        self.drafts.pad(start, bs)

    # ── the body, and capturing it ────────────────────────────────────────────────────────────

    def capture(self, batch_sizes: list[int]) -> None:
        """Warms up, then captures, one graph per batch size that fits, largest first (GPU
        only), once, into the ``cuda_graph`` pool."""
        sizes = sorted((bs for bs in batch_sizes if bs <= self.max_rows), reverse=True)
        passes = [(partial(self._fill_padding, 0, bs), partial(self.body, bs)) for bs in sizes]
        captured = capture_passes(self.mm, passes, "the speculative rounds' graphs were captured")
        self.graphs.update((bs, graph) for bs, (graph, _) in zip(sizes, captured, strict=True))

    def body(self, bs: int) -> torch.Tensor:
        """``M`` rounds of ``bs`` rows from the state buffers (see the module); never
        synchronizes with the host, so it is what the graphs capture (and the CPU runs).
        Returns the tokens buffer (the rounds' output)."""
        k, w, block_size = self.width - 1, self.width, self.block_size
        target = self.verifier.inputs
        tables = target.block_tables[:bs]
        self.drafts.begin(bs, tables)
        newest, position = self.newest[:bs], self.position[:bs]
        offsets = self.offsets
        for round_ in range(self.num_rounds):
            drafts = self.drafts.propose(bs, tables, newest, position)
            positions = position[:, None] + offsets[None, :]  # [bs, k + 1]
            ids = target.input_ids[: bs * w].view(bs, w)
            ids[:, 0].copy_(newest)
            ids[:, 1:].copy_(drafts)
            target.positions[: bs * w].copy_(positions.reshape(-1))
            target.slot_mapping[: bs * w].copy_(slots(tables, positions, block_size).reshape(-1))
            target.seq_lens[:bs].copy_(position + w)
            logits = self.verifier._forward(bs)  # [bs * (k + 1), V]
            argmax = logits.argmax(dim=-1)
            best = argmax.view(bs, w)
            accepted = (drafts == best[:, :k]).long().cumprod(dim=-1).sum(dim=-1)
            is_emitted = offsets[None, :] <= accepted[:, None]
            emitted = torch.where(is_emitted, best, -1)
            self.tokens[round_, :bs].copy_(emitted)
            self.counts[round_, :bs].copy_(accepted + 1)
            mode, live_top = self.logprobs_mode, self.live_top
            packed = packed_logprobs(logits, argmax, self.num_top, mode, live_top)
            self.logprobs[round_, : bs * w].copy_(packed)
            self.drafts.feed_back(bs, position, emitted, accepted)
            newest.copy_(best.gather(1, accepted[:, None]).squeeze(1))
            position.add_(accepted + 1)
        return self.tokens


def _asked_logprobs(seqs: tuple[SeqInput, ...]) -> set[int]:
    """The distinct top-logprob counts the rows ask for (-1: the whole vocabulary)."""
    return {int(s.params.logprobs) for s in seqs if s.params.logprobs is not None}


__all__ = ["RAW_MODES", "SpecRounds"]
