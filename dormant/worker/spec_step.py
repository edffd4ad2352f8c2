"""One step of speculative decoding on one rank: draft, verify, emit; eager.

Order within the step (the drafts and the draft's probabilities never leave it, so workers keep
no per-request state, and nothing but the result is copied to the host):

1. **Draft catch-up**: the draft computes every row's ``draft_prefix_token_ids`` and
   ``token_ids`` (its KV then covers what the target's does); at each drafting row's last
   position it proposes ``d_1``.
2. **Chained drafts**: ``k_max - 1`` single-token passes propose ``d_2 .. d_j`` (a row takes
   part while it has drafts left).
3. **Target**: one pass over every row, a drafting row's being ``[newest, d_1 .. d_j]`` at
   ``start_position ..`` (the drafts are written into the input ids on the device), with
   logits at all of its positions.
4. **Verify** (``rejection_sampler.verify``): greedy rows accept drafts equal to the target's
   argmax; random rows by rejection sampling, exact in distribution. Rows verify ``k_max``
   positions: past a row's ``j`` its drafts are padding (token 0, drawn from a point mass),
   and what it emits is cut to ``j + 1`` tokens, so the ``(j + 1)``-th is the target's own
   draw there. Plain rows (no drafts) sample as without speculation.
5. **One host copy** of tokens, counts and logprobs. Logprobs of every emitted token are the
   target's, at its position, in the engine's ``logprobs_mode``.

Drafts are drawn as ``draft_sample_method`` says (vLLM's): "greedy" proposes the draft's
argmax, which rejection sampling treats as drawn from a point mass; "probabilistic" draws from
the draft's processed distribution (``rejection_sampler.draft_sample``).

KV at rejected positions is stale but lies past the sequence's length; the next step overwrites
it. Each row reports ``num_draft_computed_tokens``: the positions whose draft KV is exact (the
catch-up's, plus the accepted drafts' that the draft computed itself).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as SequenceOf

import torch

from dormant.core.speculative_config import SpeculativeConfig
from dormant.core.step_input import SeqInput, StepInput
from dormant.core.step_output import SeqOutput, StepOutput, TokenLogprobs
from dormant.layers.context import forward_context
from dormant.worker.draft_model import DraftModel
from dormant.worker.input_buffers import Staging
from dormant.worker.logprobs import HostCopy, packed_logprobs, unpack_logprobs
from dormant.worker.model_runner import ModelRunner, _max_logprobs
from dormant.worker.mtp_draft import MTPDraftModel
from dormant.worker.rejection_sampler import draft_sample, verify
from dormant.worker.sampler import SamplingTensors, processed_logits
from dormant.worker.spec_inputs import PassLayout, SpecLayout

_PASS_ARRAYS = 5  # PassLayout.arrays()


class SpecStep:
    """Runs steps with drafts (``execute``) over the runner's target and ``draft``."""

    def __init__(
        self, runner: ModelRunner, draft: DraftModel | MTPDraftModel, spec: SpeculativeConfig
    ) -> None:
        self.runner, self.draft, self.spec = runner, draft, spec
        self.device = runner.device
        self.vocab_size = runner.vocab_size
        self.block_size = runner.config.block_size
        self._staging = Staging(self.device)
        self._host_copy = HostCopy(self.device)

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        lag = self.draft.lag
        layout = SpecLayout.of(step.seqs, self.block_size, lag)
        views, _ = self._staging.stage(layout.arrays())
        drafts, probs = self._draft(step.seqs, layout, views)
        if not layout.spec_rows and self.draft.hidden_cache is None:
            # nothing to verify, no hidden state to keep: the target's step as without drafts
            output = self.runner.execute(step)
            return _with_draft_computed(output, [s.seq_len for s in step.seqs])
        return self._verify(step, layout, views[-5:], drafts, probs)

    # ── drafting ──────────────────────────────────────────────────────────────────────────────

    def _draft(
        self, seqs: SequenceOf[SeqInput], layout: SpecLayout, views: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Runs the catch-up and chained passes; returns the drafts (int64 [n_spec, k_max],
        0 past a row's ``j``) and, for "probabilistic" drafts of random rows, the
        distributions they were drawn from (float32 [n_spec, k_max, V]; point masses on the
        padding)."""
        draft = self.draft
        num_spec, k_max = len(layout.spec_rows), layout.max_drafts
        drafts = torch.zeros((num_spec, k_max), dtype=torch.int64, device=self.device)
        offset = 0
        hidden = None
        if layout.catch_up is not None:
            positions, meta = layout.catch_up.metadata(views[:_PASS_ARRAYS])
            offset = _PASS_ARRAYS
            previous = self._cached_hidden(meta.slot_mapping)
            with forward_context(meta):
                hidden = draft.forward(views[offset], positions, previous, 0)
        last = views[offset + 1]
        offset += 2
        if not num_spec:
            return drafts, None
        assert hidden is not None
        spec_seqs = [seqs[r] for r in layout.spec_rows]
        sampling = SamplingTensors.from_sequences(spec_seqs, self.vocab_size, self.device)
        probs = None
        if self.spec.draft_sample_method == "probabilistic" and not sampling.is_all_greedy:
            probs = torch.zeros((num_spec, k_max, self.vocab_size), device=self.device)
            probs[..., 0] = 1.0  # the padding's point mass
        latest = hidden[last]  # each drafting row's newest hidden state (MTP's next input)
        tokens, row_probs = self._sample(draft.model.compute_logits(latest), sampling, 0)
        drafts[:, 0] = tokens
        if probs is not None and row_probs is not None:
            probs[:, 0] = row_probs
        for i, (pass_layout, _) in enumerate(layout.chained, start=1):
            pass_views = views[offset : offset + _PASS_ARRAYS + 1]
            offset += _PASS_ARRAYS + 1
            rows = pass_views[-1]
            positions, meta = pass_layout.metadata(pass_views[:_PASS_ARRAYS])
            with forward_context(meta):
                hidden = draft.forward(drafts[rows, i - 1], positions, latest[rows], i)
            latest = latest.index_copy(0, rows, hidden)
            subset = _select(sampling, rows)
            tokens, row_probs = self._sample(draft.model.compute_logits(hidden), subset, i)
            drafts[rows, i] = tokens
            if probs is not None and row_probs is not None:
                probs[rows, i] = row_probs
        return drafts, probs

    def _cached_hidden(self, slots: torch.Tensor) -> torch.Tensor | None:
        """The target's hidden states at ``slots`` (MTP's hidden cache), or None."""
        cache = self.draft.hidden_cache
        return None if cache is None else cache.view(-1, cache.shape[-1])[slots]

    def _sample(
        self, logits: torch.Tensor, sampling: SamplingTensors, offset: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.spec.draft_sample_method == "greedy":
            return logits.argmax(dim=-1), None
        return draft_sample(logits, sampling, offset)

    # ── the target and verification ───────────────────────────────────────────────────────────

    def _verify(
        self,
        step: StepInput,
        layout: SpecLayout,
        views: list[torch.Tensor],
        drafts: torch.Tensor,
        probs: torch.Tensor | None,
    ) -> StepOutput:
        runner, seqs = self.runner, step.seqs
        draft_slots, draft_source, spec_index, plain_index, max_emitted = views
        target_seqs = tuple(
            dataclasses.replace(s, token_ids=(*s.token_ids, *(0,) * s.num_draft_tokens))
            for s in seqs
        )
        meta = runner.inputs.load(StepInput(target_seqs, is_prefill=True))
        num_tokens = sum(len(s.token_ids) for s in target_seqs)
        input_ids = runner.inputs.input_ids
        input_ids[draft_slots] = drafts.view(-1)[draft_source]
        with forward_context(meta):
            hidden = runner.model(input_ids[:num_tokens], runner.inputs.positions[:num_tokens])
        cache = self.draft.hidden_cache
        if cache is not None:  # MTP reads it in later steps
            cache.view(-1, cache.shape[-1])[meta.slot_mapping] = hidden.to(cache.dtype)
        spec_seqs = [seqs[r] for r in layout.spec_rows]
        plain_seqs = [seqs[r] for r in layout.plain_rows]
        k_max, num_spec = layout.max_drafts, len(spec_seqs)
        parts: list[torch.Tensor] = []
        spec_logprobs = None
        if spec_seqs:
            logits = runner.model.compute_logits(hidden[spec_index])
            sampling = SamplingTensors.from_sequences(spec_seqs, self.vocab_size, self.device)
            if probs is None and not sampling.is_all_greedy:  # greedy drafts: point masses
                probs = torch.zeros((num_spec, k_max, self.vocab_size), device=self.device)
                probs.scatter_(-1, drafts[..., None], 1.0)
            logits = logits.view(num_spec, k_max + 1, -1)
            emitted, num_emitted = verify(logits, drafts, probs, sampling)
            parts += [emitted, torch.minimum(num_emitted, max_emitted)]
            spec_logprobs = self._spec_logprobs(spec_seqs, logits, emitted, k_max)
        plain_tokens, plain_logprobs = None, None
        if plain_seqs:
            plain_tokens, plain_logprobs = runner._sample(
                runner.model.compute_logits(hidden[plain_index]), plain_seqs
            )
            parts.append(plain_tokens)
        prompt = runner._prompt_logprobs(target_seqs, hidden)
        extras = [p for p in (spec_logprobs, plain_logprobs, prompt) if p is not None]
        self._host_copy.start(parts + extras)
        return self._outputs(seqs, layout, spec_logprobs, plain_logprobs, prompt)

    def _spec_logprobs(
        self,
        spec_seqs: list[SeqInput],
        logits: torch.Tensor,
        emitted: torch.Tensor,
        k_max: int,
    ) -> torch.Tensor | None:
        """Packed logprobs of every verified position's emitted token, from the target's
        logits there ([n_spec * (k_max + 1), w]), or None when no drafting row asks."""
        num_top = _max_logprobs(spec_seqs, self.vocab_size)
        if num_top is None:
            return None
        flat = logits.reshape(-1, logits.shape[-1])
        mode = self.runner.logprobs_mode
        if mode.startswith("processed"):
            per_position = [s for s in spec_seqs for _ in range(k_max + 1)]
            sampling = SamplingTensors.from_sequences(per_position, self.vocab_size, self.device)
            flat = processed_logits(flat, sampling)
        return packed_logprobs(flat, emitted.clamp(min=0).reshape(-1), num_top, mode)

    def _draft_computed(self, seq: SeqInput, num_emitted: int) -> int:
        """The row's positions with exact draft KV after the step: a draft model's catch-up
        reached the row's end, and its chained KV holds where the drafts were accepted; MTP's
        catch-up reached ``start_position`` (its chained passes used its own hidden states)."""
        if self.draft.lag:
            return seq.start_position
        if not seq.num_draft_tokens:
            return seq.seq_len
        return seq.seq_len + min(num_emitted - 1, seq.num_draft_tokens - 1)

    def _outputs(
        self,
        seqs: SequenceOf[SeqInput],
        layout: SpecLayout,
        spec_logprobs: torch.Tensor | None,
        plain_logprobs: torch.Tensor | None,
        prompt: torch.Tensor | None,
    ) -> StepOutput:
        """Reads the step's host copy back into one ``SeqOutput`` per row, in row order."""
        host = self._host_copy.wait()
        num_spec, num_plain, width = (
            len(layout.spec_rows),
            len(layout.plain_rows),
            layout.max_drafts + 1,
        )
        end = num_spec * width
        emitted = host[:end].reshape(num_spec, width).tolist()
        counts = host[end : end + num_spec].tolist()
        end += num_spec
        plain_tokens = host[end : end + num_plain].tolist()
        end += num_plain
        entries: list[list[TokenLogprobs] | None] = []
        for packed, rows in ((spec_logprobs, num_spec * width), (plain_logprobs, num_plain)):
            if packed is None:
                entries.append(None)
                continue
            size = rows * packed.shape[-1]
            entries.append(unpack_logprobs(host[end : end + size].reshape(rows, -1)))
            end += size
        spec_entries, plain_entries = entries
        prompt_entries = (
            [] if prompt is None else unpack_logprobs(host[end:].reshape(-1, prompt.shape[-1]))
        )
        outputs: list[SeqOutput | None] = [None] * len(seqs)
        for n, row in enumerate(layout.spec_rows):
            seq, count = seqs[row], counts[n]
            lps = None
            if spec_entries is not None and seq.params.logprobs is not None:
                lps = tuple(spec_entries[n * width : n * width + count])
            computed = self._draft_computed(seq, count)
            outputs[row] = SeqOutput(tuple(emitted[n][:count]), lps, None, computed)
        next_prompt = 0
        for n, row in enumerate(layout.plain_rows):
            seq = seqs[row]
            lps = None
            if plain_entries is not None and seq.params.logprobs is not None:
                lps = (plain_entries[n],)
            seq_prompt = None
            if seq.compute_prompt_logprobs:
                count = len(seq.token_ids) - 1
                seq_prompt = tuple(prompt_entries[next_prompt : next_prompt + count])
                next_prompt += count
            outputs[row] = SeqOutput(
                (plain_tokens[n],), lps, seq_prompt, self._draft_computed(seq, 1)
            )
        return StepOutput(tuple(o for o in outputs if o is not None))


def _select(sampling: SamplingTensors, rows: torch.Tensor) -> SamplingTensors:
    """The rows ``rows`` of ``sampling`` (its host flags stay the superset's: conservative)."""
    return dataclasses.replace(
        sampling,
        temperatures=sampling.temperatures[rows],
        top_ks=sampling.top_ks[rows],
        top_ps=sampling.top_ps[rows],
        min_ps=sampling.min_ps[rows],
        seeds=sampling.seeds[rows],
        steps=sampling.steps[rows],
        is_greedy=sampling.is_greedy[rows],
        noise_keys=sampling.noise_keys[:, rows],
    )


def _with_draft_computed(output: StepOutput, computed: list[int]) -> StepOutput:
    return StepOutput(
        tuple(
            dataclasses.replace(o, num_draft_computed_tokens=c)
            for o, c in zip(output.seqs, computed, strict=True)
        )
    )


__all__ = ["PassLayout", "SpecStep"]
