"""Runs one step of the model on this rank: inputs in, one sampled token per sequence out, with
the logprobs asked for, computed on the device inside the step (DESIGN §3 invariant 11).

Decode steps replay a captured CUDA graph when one fits (GPU, ``enforce_eager=False``); prefill,
mixed steps (prompt chunks beside decode rows: ``StepInput.is_prefill``) and everything on the
CPU run eagerly. A row whose chunk ends before its sequence's last token samples too (rows are
sampled alike); the driver drops that token. Both paths read the same static input buffers. Every
step ends in one event-guarded device-to-host copy of its tokens and logprobs together
(``HostCopy``); ``StepOutput`` is built from the host copy after its event.

A step is *launched* (``launch``, ``launch_multi_step``) and read back later
(``PendingStep.result``; ``execute`` does both at once), so the engine may queue step N+1 before
it reads step N (its async scheduling, ``worker/pending_step.py``). A decode row of step N+1
then takes its input token from step N's last sampled tokens on the device
(``StepInput.previous_rows``), which the host has not read yet.

Sampling after the logits, and the logprobs asked for, are ``worker/step_sampler.py``'s.

A fused multi-step decode (``execute_multi_step``) runs ``num_steps`` steps in one replay; each
step samples in the graph as ``StepSampler.sample`` samples (greedy rows and random rows without
top-k, top-p or min-p alike), so its tokens and logprobs are those of single steps.

A step with fork rows (``StepInput.has_forks``) runs eagerly: the forward computes the other
rows, its ``block_copies`` follow it, and each fork row samples from its leader's logits row
(one gather), with its own parameters.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import numpy as np
import torch

from dormant.core.config import EngineConfig, LogprobsMode
from dormant.core.step_input import SeqInput, StepInput
from dormant.core.step_output import SeqOutput, StepOutput
from dormant.layers.context import forward_context
from dormant.memory import MemoryManager
from dormant.models import CausalLM
from dormant.worker.block_copy import BlockCopier
from dormant.worker.cuda_graphs import DecodeGraphs
from dormant.worker.graph_sampling import is_unfiltered
from dormant.worker.input_buffers import InputBuffers, Staging
from dormant.worker.logprobs import trim_top
from dormant.worker.pending_step import HostCopies, PendingStep, StagingFence
from dormant.worker.step_sampler import StepSampler, max_logprobs

# The fused multi-step graph carries the sampled token's logprob and rank and at most this many
# top logprobs (fewer when max_logprobs is smaller); a batch asking for more runs single steps.
MAX_MULTI_STEP_TOP_LOGPROBS = 20


class ModelRunner:
    """Owns the static input buffers and the graphs; the model and KV cache are the worker's."""

    def __init__(
        self, config: EngineConfig, model: CausalLM, mm: MemoryManager, null_block: int
    ) -> None:
        self.config = config
        self.model = model
        self.mm = mm
        self.device = mm.backend.device
        self.vocab_size = model.config.vocab_size
        self.inputs = InputBuffers(mm, config, null_block)
        self.graphs: DecodeGraphs | None = None
        self.sampler = StepSampler(model, config.logprobs_mode, self.device)
        max_logprobs = config.max_logprobs  # -1: the whole vocabulary, more than a graph carries
        self.multi_step_top_logprobs = (
            MAX_MULTI_STEP_TOP_LOGPROBS
            if max_logprobs < 0
            else min(max_logprobs, MAX_MULTI_STEP_TOP_LOGPROBS)
        )
        self._host_copies = HostCopies(self.device)
        self._staging_fence = StagingFence(self.device)
        # The last launch's last sampled token per row, on the device: what the next launch's
        # rows with ``previous_rows`` take as their input tokens (None before any launch).
        self._last_tokens: torch.Tensor | None = None
        self._fork_staging = Staging(self.device)
        self.block_copier = BlockCopier(self.device)  # a draft registers its caches too
        layers = model.attention_layers()
        self.block_copier.register(lambda: [(layer.checked_cache(), 1) for layer in layers])

    def capture_graphs(self, multi_steps: int | None = None) -> None:
        """Captures the decode graphs once (GPU only); they are never recaptured.
        ``multi_steps``: the fused multi-step graphs' steps (default the config's; 1: none)."""
        config = self.config
        powers = [s for s in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if s < config.max_num_seqs]
        sizes = config.cuda_graph_batch_sizes or (*powers, config.max_num_seqs)
        self.graphs = DecodeGraphs(
            self.model, self.inputs, self.mm, list(sizes),
            config.cuda_graph_multi_steps if multi_steps is None else multi_steps,
            config.max_model_len, self.logprobs_mode, self.multi_step_top_logprobs,
        )  # fmt: skip
        live_top = self.graphs.live_top
        if self.graphs.sampling is not None and live_top is not None:  # read at these by the
            self.mm.guard_addresses("decode_graphs.sampling", self.graphs.sampling.tensors)
            self.mm.guard_addresses("decode_graphs.live_top", [live_top])  # multi-step graphs
        with torch.inference_mode():
            self.graphs.capture()

    def execute(self, step: StepInput) -> StepOutput:
        """Computes ``step``: one sampled token per sequence, its logprobs where asked, and the
        prompt logprobs of first prefills that ask. One device-to-host copy."""
        return self.launch(step).result()

    def execute_multi_step(self, step: StepInput) -> StepOutput:
        """``launch_multi_step(step)``'s results (see there)."""
        return self.launch_multi_step(step).result()

    @torch.inference_mode()
    def launch(self, step: StepInput) -> PendingStep:
        """Queues ``step`` (as ``execute`` computes it) and returns without waiting for it."""
        self._staging_fence.wait()
        num_seqs = len(step.seqs)
        graphs = None if self.is_logits_patched else self.graphs
        padded = None
        if graphs is not None and not (step.is_prefill or step.has_forks):
            padded = graphs.padded_size(num_seqs)
        prompt = None
        if padded is not None:
            self.inputs.load(step, pad_to=padded, previous_tokens=self._last_tokens)
            captured = self.graphs.full[padded]  # type: ignore[union-attr]
            captured.graph.replay()
            logits = captured.output[:num_seqs]
        else:
            logits, prompt = self._eager(step)
        self.block_copier.copy(step.block_copies)
        tokens, logprobs = self.sampler.sample(logits, step.seqs)
        self._staging_fence.record()
        self._last_tokens = self.inputs.keep_last_tokens(tokens)
        parts = [tokens, *(p for p in (logprobs, prompt) if p is not None)]
        return self._start_copy(parts, step.seqs, 1, logprobs, prompt)

    @torch.inference_mode()
    def launch_multi_step(self, step: StepInput) -> PendingStep:
        """Queues ``num_steps`` decode steps per sequence, with their logprobs where asked: the
        tokens and logprobs of ``num_steps`` single ``execute`` steps, each token fed back.

        The fused multi-step graph runs them in one replay when the batch fits it (see
        ``fits_multi_step_graph``: greedy rows and unfiltered random rows); otherwise they run
        as single steps, with the same results, read back before this returns.
        Preconditions: a decode step whose block tables already cover positions up to
        ``start_position + num_steps - 1``, within ``max_model_len``.
        """
        if self.graphs is None or not self.graphs.multi_step:
            raise RuntimeError(
                "no multi-step graph: needs a GPU, enforce_eager=False and "
                "cuda_graph_multi_steps > 1"
            )
        padded = self.graphs.padded_size(len(step.seqs))
        if step.is_prefill or step.has_forks or padded is None:
            raise ValueError(
                "multi-step graphs run decode batches (no prefill, no fork rows) of at most "
                f"{self.graphs.batch_sizes[-1]} sequences; got {len(step.seqs)} rows, "
                f"is_prefill={step.is_prefill}, has_forks={step.has_forks}"
            )
        if self.is_logits_patched or not self.fits_multi_step_graph(step.seqs):
            return PendingStep.done(self.execute_single_steps(step, self.graphs.num_steps))
        self._staging_fence.wait()
        self.graphs.load_multi_step(step, padded, previous_tokens=self._last_tokens)
        self._staging_fence.record()
        captured = self.graphs.multi_step[padded]
        captured.graph.replay()
        num_seqs = len(step.seqs)
        tokens = captured.output[:, :num_seqs]
        self._last_tokens = tokens[-1]  # the graph's own output buffer, in ``runtime``
        logprobs, num_top = None, max_logprobs(step.seqs, self.vocab_size)
        if num_top is not None:
            assert captured.logprobs is not None
            logprobs = trim_top(captured.logprobs[:, :num_seqs], num_top)
        parts = [tokens, *([] if logprobs is None else [logprobs])]
        return self._start_copy(parts, step.seqs, self.graphs.num_steps, logprobs, None)

    @property
    def logprobs_mode(self) -> LogprobsMode:
        """The logprobs the steps report (the sampler's); graphs keep the one they baked in."""
        return self.sampler.logprobs_mode

    @logprobs_mode.setter
    def logprobs_mode(self, mode: LogprobsMode) -> None:
        self.sampler.logprobs_mode = mode

    @property
    def is_logits_patched(self) -> bool:
        """Whether ``model.compute_logits`` was replaced on the instance after the graphs were
        captured (verl's ``monkey_patch_compute_logits`` masks the padded vocabulary that
        way). The graphs baked in the original, so steps then run eagerly, as in vLLM, whose
        decode graphs stop before the logits."""
        return "compute_logits" in vars(self.model)

    def fits_multi_step_graph(self, seqs: SequenceOf[SeqInput]) -> bool:
        """Whether the fused graph computes what these decode rows ask: each greedy, or random
        without top-k, top-p or min-p filtering (``graph_sampling.is_unfiltered``); no bad
        words, ``min_tokens`` mask or penalties; at most the top logprobs it carries, in the
        logprobs mode it was captured with (raw or processed, logprobs or logits).
        """
        num_top = max_logprobs(seqs, self.vocab_size)
        if num_top is not None and num_top > self.multi_step_top_logprobs:
            return False
        captured_mode = self.logprobs_mode if self.graphs is None else self.graphs.logprobs_mode
        if num_top is not None and captured_mode != self.logprobs_mode:
            return False
        if any(s.masked_stop_token_ids or s.bad_words_token_ids for s in seqs):
            return False
        vocab_size = self.vocab_size
        distinct = {id(s.params): s.params for s in seqs}  # the n samples of a request share
        return all(
            is_unfiltered(p, vocab_size)
            and (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
            for p in distinct.values()
        )

    def execute_single_steps(self, step: StepInput, num_steps: int) -> StepOutput:
        """``num_steps`` decode steps, one ``execute`` each, feeding each token back: what the
        fused graph computes, for batches it does not fit. Same preconditions."""
        seqs, per_step = step.seqs, []
        previous_rows = step.previous_rows  # the first step's input tokens may be on the device
        for _ in range(num_steps):
            single = StepInput(seqs, is_prefill=False, previous_rows=previous_rows)
            result, previous_rows = self.execute(single).seqs, None
            per_step.append(result)
            seqs = tuple(s.advanced(o.token_ids[0]) for s, o in zip(seqs, result, strict=True))
        merged = []
        for outputs in zip(*per_step, strict=True):
            token_ids = tuple(o.token_ids[0] for o in outputs)
            logprobs = [o.logprobs[0] for o in outputs if o.logprobs is not None]
            merged.append(SeqOutput(token_ids, tuple(logprobs) if logprobs else None))
        return StepOutput(tuple(merged))

    def _eager(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The logits of each sequence's last position (a fork row's: its leader's), and packed
        prompt logprobs of the rows that ask for them (None when none does)."""
        computing, logits_rows = step.without_forks() if step.has_forks else (step, None)
        meta = self.inputs.load(computing, previous_tokens=self._last_tokens)
        num_tokens, num_seqs = computing.num_tokens, len(computing.seqs)
        with forward_context(meta):
            hidden = self.model(
                self.inputs.input_ids[:num_tokens], self.inputs.positions[:num_tokens]
            )
        logits = self.model.compute_logits(hidden[self.inputs.logits_indices[:num_seqs]])
        if logits_rows is not None:
            (rows,), _ = self._fork_staging.stage([np.asarray(logits_rows, np.int64)])
            logits = logits[rows]
        return logits, self.sampler.prompt_logprobs(computing.seqs, hidden)

    def _start_copy(
        self,
        parts: list[torch.Tensor],
        seqs: SequenceOf[SeqInput],
        num_steps: int,
        logprobs: torch.Tensor | None,
        prompt: torch.Tensor | None,
    ) -> PendingStep:
        """Starts the step's host copy (``step_readback``'s layout: tokens [num_steps, n], then
        the packed logprobs [num_steps, n, w], then the packed prompt logprobs)."""
        width = None if logprobs is None else logprobs.shape[-1]
        prompt_width = None if prompt is None else prompt.shape[-1]
        return self._host_copies.start(parts, seqs, num_steps, (width, prompt_width))
