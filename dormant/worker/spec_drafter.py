"""Speculative decoding's drafts for one step (steps 1 and 2 of ``spec_step.py``).

The draft catches up on every row's new positions (a draft model's decode pass, MTP's padded
passes, or an eager forward), proposes ``d_1`` at each drafting row's last position, then
proposes ``d_2 .. d_j`` in ``k_max - 1`` chained one-token passes (a row takes part while it has
drafts left). Drafts are drawn as ``draft_sample_method`` says: "greedy" takes the draft's argmax,
"probabilistic" draws from its processed distribution (``rejection_sampler.draft_sample``),
whose probabilities come back for the verification.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as SequenceOf

import torch

from dormant.core.speculative_config import SpeculativeConfig
from dormant.core.step_input import SeqInput
from dormant.layers.context import forward_context
from dormant.worker.draft_decoder import DraftDecoder
from dormant.worker.draft_model import DraftModel
from dormant.worker.mtp_decoder import MTPDecoder
from dormant.worker.mtp_draft import MTPDraftModel
from dormant.worker.rejection_sampler import draft_sample
from dormant.worker.sampler import SamplingTensors
from dormant.worker.spec_inputs import SpecLayout, SpecViews


class Drafter:
    """Proposes the drafts of a step with ``draft``, through ``decoder`` (a draft model's
    static passes) or ``mtp`` (MTP's padded passes) where they apply."""

    def __init__(
        self,
        draft: DraftModel | MTPDraftModel,
        spec: SpeculativeConfig,
        decoder: DraftDecoder | None,
        mtp: MTPDecoder | None,
        device: torch.device,
        vocab_size: int,
    ) -> None:
        self.draft, self.spec, self.decoder, self.mtp = draft, spec, decoder, mtp
        self.device, self.vocab_size = device, vocab_size

    def propose(
        self, seqs: SequenceOf[SeqInput], layout: SpecLayout, views: SpecViews
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Runs the catch-up and chained passes; returns the drafts (int64 [n_spec, k_max],
        0 past a row's ``j``) and, for "probabilistic" drafts of random rows, the
        distributions they were drawn from (float32 [n_spec, k_max, V]; point masses on the
        padding)."""
        draft, decoder, device = self.draft, self.decoder, self.device
        mtp = self.mtp if layout.is_padded_draft else None  # static shapes: its graphs
        num_spec, k_max = len(layout.spec_rows), layout.max_drafts
        drafts = torch.zeros((num_spec, k_max), dtype=torch.int64, device=device)
        hidden, logits, first_logits = None, None, None
        if layout.catch_up is not None:
            assert views.catch_up is not None
            positions, meta = layout.catch_up.metadata(views.catch_up)
            if mtp is not None:  # each row's newest hidden state stays in mtp.previous
                assert views.catch_up_valid is not None
                first_logits = mtp.catch_up(
                    views.catch_up, views.catch_up_ids, views.catch_up_last,
                    views.catch_up_valid, layout.catch_up.width,
                )  # fmt: skip
            elif decoder is not None and meta.max_query_len == 1:  # a decode step of the draft
                logits = decoder.run(views.catch_up_ids, positions, meta)
            else:
                previous = self._cached_hidden(meta.slot_mapping)
                with forward_context(meta):
                    hidden = draft.forward(views.catch_up_ids, positions, previous, 0)
        if not num_spec:
            return drafts, None
        last = views.catch_up_last
        spec_seqs = [seqs[r] for r in layout.spec_rows]
        sampling = SamplingTensors.from_sequences(spec_seqs, self.vocab_size, device)
        probs = None
        if self.spec.draft_sample_method == "probabilistic" and not sampling.is_all_greedy:
            probs = torch.zeros((num_spec, k_max, self.vocab_size), device=device)
            probs[..., 0] = 1.0  # the padding's point mass
        latest = None  # each drafting row's newest hidden state (MTP's next input)
        if first_logits is not None:
            logits = first_logits
        elif logits is not None:
            logits = logits[last]
        else:
            assert hidden is not None
            latest = hidden[last]
            logits = draft.model.compute_logits(latest)
        tokens, row_probs = self._sample(logits, sampling, 0)
        drafts[:, 0] = tokens
        if probs is not None and row_probs is not None:
            probs[:, 0] = row_probs
        for i, ((pass_layout, _), (pass_views, rows)) in enumerate(
            zip(layout.chained, views.chained, strict=True), start=1
        ):
            positions, meta = pass_layout.metadata(pass_views)
            if mtp is not None:  # every row: past a row's j its drafts are padding
                logits = mtp.step(drafts[:, i - 1], pass_views, pass_layout.width, i)
            elif decoder is not None:
                logits = decoder.run(drafts[rows, i - 1], positions, meta)
            else:
                assert latest is not None
                with forward_context(meta):
                    hidden = draft.forward(drafts[rows, i - 1], positions, latest[rows], i)
                latest = latest.index_copy(0, rows, hidden)
                logits = draft.model.compute_logits(hidden)
            if i == k_max:
                break  # the last drafts' KV (a draft model): nothing more to propose
            subset = select_rows(sampling, rows)
            tokens, row_probs = self._sample(logits, subset, i)
            # A row whose drafts ended here (j == i) proposes one more into its padding
            # (truncated by the verification), drawn as a draft: exactness holds for it.
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


def select_rows(sampling: SamplingTensors, rows: torch.Tensor) -> SamplingTensors:
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
