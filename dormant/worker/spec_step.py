"""One step of speculative decoding on one rank: draft, verify, emit.

Passes of static shapes run from their own buffers and replay CUDA graphs on a GPU: a draft
model's one-token passes (``draft_decoder.py``), MTP's passes of a step whose rows all draft
(``mtp_decoder.py``), and the verification of such a step (``target_verifier.py``); the rest
(a prompt's catch-up, a step with a prefill chunk or a row that cannot draft) runs eagerly.

Order within the step (the drafts and the draft's probabilities never leave it, so workers keep
no per-request state, and nothing but the result is copied to the host; steps 1 and 2 are
``spec_drafter.py``'s):

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
from dormant.core.step_output import StepOutput
from dormant.layers.context import forward_context
from dormant.worker.draft_decoder import DraftDecoder
from dormant.worker.draft_model import DraftModel
from dormant.worker.input_buffers import Staging
from dormant.worker.logprobs import HostCopy, packed_logprobs
from dormant.worker.model_runner import ModelRunner
from dormant.worker.mtp_decoder import MTPDecoder
from dormant.worker.mtp_draft import MTPDraftModel
from dormant.worker.mtp_rounds import MTPRoundDrafts
from dormant.worker.rejection_sampler import verify
from dormant.worker.sampler import SamplingTensors, processed_logits
from dormant.worker.spec_drafter import Drafter
from dormant.worker.spec_inputs import SpecLayout, SpecViews
from dormant.worker.spec_outputs import read_outputs, with_draft_computed
from dormant.worker.spec_round_drafts import ModelRoundDrafts, RoundDrafts
from dormant.worker.spec_round_steps import run_rounds_singly
from dormant.worker.spec_rounds import SpecRounds
from dormant.worker.step_sampler import max_logprobs
from dormant.worker.target_verifier import TargetVerifier

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
        # A draft model's one-token passes run from static buffers (graphs once captured);
        # MTP's passes do in padded steps (``mtp_decoder.py``), and eagerly in the others.
        null_block = runner.inputs.null_block
        self.decoder: DraftDecoder | None = None
        self.mtp: MTPDecoder | None = None
        if isinstance(draft, DraftModel):
            self.decoder = DraftDecoder(draft.model, runner.mm, runner.config, null_block)
        else:
            k = spec.num_speculative_tokens
            self.mtp = MTPDecoder(draft, runner.mm, runner.config, null_block, k)
        self.drafter = Drafter(draft, spec, self.decoder, self.mtp, self.device, self.vocab_size)
        # The target's verification of steps whose rows all draft, padded to K drafts each
        self.verifier = TargetVerifier(
            runner.model, runner.mm, runner.config, null_block, spec.num_speculative_tokens,
            draft.hidden_cache,
        )  # fmt: skip
        # The fused rounds (``cuda_graph_multi_steps`` per replay, greedy batches), over the
        # draft model's passes or MTP's
        self.num_rounds = runner.config.cuda_graph_multi_steps
        self.rounds: SpecRounds | None = None
        if self.num_rounds > 1:
            round_drafts: RoundDrafts
            if self.decoder is not None:
                round_drafts = ModelRoundDrafts(self.decoder, spec.num_speculative_tokens)
            else:
                assert self.mtp is not None
                round_drafts = MTPRoundDrafts(self.mtp, runner.mm)
            self.rounds = SpecRounds(
                round_drafts, self.verifier, runner.mm, self.num_rounds, runner.logprobs_mode,
                runner.multi_step_top_logprobs,
            )  # fmt: skip

    @classmethod
    def create(
        cls, runner: ModelRunner, draft: DraftModel | MTPDraftModel, num_blocks: int
    ) -> SpecStep:
        """Allocates the draft's KV (``num_blocks`` and the null block) and guards every tensor
        a step reads at a fixed address; returns the step."""
        spec, mm = runner.config.speculative_config, runner.mm
        assert spec is not None
        draft.allocate_kv_cache(num_blocks + 1)
        layers = draft.model.attention_layers()
        hidden = [] if draft.hidden_cache is None else [draft.hidden_cache]
        mm.guard_addresses(
            "draft.kv_cache", lambda: [*(a.checked_cache() for a in layers), *hidden]
        )
        step = cls(runner, draft, spec)
        if step.decoder is not None:
            mm.guard_addresses("draft.inputs", step.decoder.inputs.tensors)
        if step.mtp is not None:
            mm.guard_addresses("mtp.inputs", step.mtp.tensors)
        mm.guard_addresses("verifier.inputs", step.verifier.inputs.tensors)
        if step.rounds is not None:
            mm.guard_addresses("spec_rounds.inputs", step.rounds.tensors)
        return step

    def capture_graphs(self) -> None:
        """Captures the draft's decode graphs (a draft model's, or MTP's passes), the
        verification's graphs and the fused rounds' at the target's batch sizes (GPU only)."""
        graphs = self.runner.graphs
        if graphs is None or self.spec.enforce_eager:
            return
        if self.decoder is not None:
            self.decoder.capture(graphs.batch_sizes)
        if self.mtp is not None:
            self.mtp.capture(graphs.batch_sizes)
        self.verifier.capture(graphs.batch_sizes)
        if self.rounds is not None:
            self.rounds.capture(graphs.batch_sizes)

    @property
    def max_rounds_rows(self) -> int:
        """The largest batch the fused rounds' graph takes (0: none was captured)."""
        return 0 if self.rounds is None else max(self.rounds.graphs, default=0)

    @torch.inference_mode()
    def execute_rounds(self, step: StepInput) -> StepOutput:
        """``num_rounds`` speculative steps of a decode batch, each round's tokens fed back: one
        replay of the fused rounds' graph where the batch fits it (``SpecRounds.fits``), else
        single steps, with the same results. Precondition: the block tables cover each row's
        positions up to ``start_position + num_rounds * (k + 1) - 1``, below ``max_model_len``.
        """
        if step.is_prefill or step.has_forks:
            raise ValueError("speculative rounds run decode batches (no prefill, no fork rows)")
        runner = self.runner
        rounds = None if runner.is_logits_patched else self.rounds  # the graph, where it fits
        if rounds is not None and rounds.fits(
            step.seqs, runner.logprobs_mode, runner.config.max_model_len
        ):
            return rounds.run(step)
        return run_rounds_singly(self.execute, step, self.num_rounds)

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        seqs, lag = step.seqs, self.draft.lag
        pad_to = self._padded_verification(seqs)
        layout = SpecLayout.of(seqs, self.block_size, lag, pad_to, self.runner.inputs.null_block)
        staged, _ = self._staging.stage(layout.arrays())
        views = layout.unpack(staged)
        drafts, probs = self.drafter.propose(seqs, layout, views)
        if not layout.spec_rows and self.draft.hidden_cache is None:
            # nothing to verify, no hidden state to keep: the target's step as without drafts
            output = self.runner.execute(step)
            return with_draft_computed(output, [s.seq_len for s in seqs])
        return self._verify(step, layout, views, drafts, probs)

    def _padded_verification(self, seqs: SequenceOf[SeqInput]) -> int | None:
        """``K`` when every row drafts and fits the verification's static pass, else None."""
        k, max_len = self.spec.num_speculative_tokens, self.runner.config.max_model_len
        fits = self.verifier.fits(len(seqs)) and (self.mtp is None or self.mtp.fits(len(seqs)))
        fits = fits and all(
            s.num_draft_tokens and s.start_position + k + 1 <= max_len for s in seqs
        )
        return k if fits and not self.runner.is_logits_patched else None

    # ── the target and verification ───────────────────────────────────────────────────────────

    def _verify(
        self,
        step: StepInput,
        layout: SpecLayout,
        views: SpecViews,
        drafts: torch.Tensor,
        probs: torch.Tensor | None,
    ) -> StepOutput:
        runner, seqs = self.runner, step.seqs
        _, _, spec_index, plain_index, max_emitted = views.target
        spec_seqs = [seqs[r] for r in layout.spec_rows]
        plain_seqs = [seqs[r] for r in layout.plain_rows]
        k_max, num_spec = layout.max_drafts, len(spec_seqs)
        hidden, target_seqs, logits = None, seqs, None
        if layout.verify is not None:  # every row drafts: the static pass (graphs on a GPU)
            assert views.verify is not None
            logits = self.verifier.run(views.verify, layout.verify.width, drafts)
        else:
            hidden, target_seqs = self._eager_target(seqs, views, drafts)
            if spec_seqs:
                logits = runner.model.compute_logits(hidden[spec_index])
                logits = logits.view(num_spec, k_max + 1, -1)
        parts: list[torch.Tensor] = []
        spec_logprobs = None
        if logits is not None:
            sampling = SamplingTensors.from_sequences(spec_seqs, self.vocab_size, self.device)
            if probs is None and not sampling.is_all_greedy:  # greedy drafts: point masses
                probs = torch.zeros((num_spec, k_max, self.vocab_size), device=self.device)
                probs.scatter_(-1, drafts[..., None], 1.0)
            emitted, num_emitted = verify(logits, drafts, probs, sampling)
            parts += [emitted, torch.minimum(num_emitted, max_emitted)]
            spec_logprobs = self._spec_logprobs(spec_seqs, logits, emitted, k_max)
        plain_tokens, plain_logprobs, prompt = None, None, None
        if plain_seqs:
            assert hidden is not None
            plain_tokens, plain_logprobs = runner.sampler.sample(
                runner.model.compute_logits(hidden[plain_index]), plain_seqs
            )
            parts.append(plain_tokens)
        if hidden is not None:
            prompt = runner.sampler.prompt_logprobs(target_seqs, hidden)
        extras = [p for p in (spec_logprobs, plain_logprobs, prompt) if p is not None]
        self._host_copy.start(parts + extras)
        return self._outputs(seqs, layout, spec_logprobs, plain_logprobs, prompt)

    def _eager_target(
        self, seqs: SequenceOf[SeqInput], views: SpecViews, drafts: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[SeqInput, ...]]:
        """The target over every row, a drafting row's ``[newest, d_1 .. d_j]``, through the
        runner's input buffers: its final hidden states, and the rows as it computed them."""
        runner = self.runner
        draft_slots, draft_source = views.target[:2]
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
        return hidden, target_seqs

    def _spec_logprobs(
        self,
        spec_seqs: list[SeqInput],
        logits: torch.Tensor,
        emitted: torch.Tensor,
        k_max: int,
    ) -> torch.Tensor | None:
        """Packed logprobs of every verified position's emitted token, from the target's
        logits there ([n_spec * (k_max + 1), w]), or None when no drafting row asks."""
        num_top = max_logprobs(spec_seqs, self.vocab_size)
        if num_top is None:
            return None
        flat = logits.reshape(-1, logits.shape[-1])
        mode = self.runner.logprobs_mode
        if mode.startswith("processed"):
            per_position = [s for s in spec_seqs for _ in range(k_max + 1)]
            sampling = SamplingTensors.from_sequences(per_position, self.vocab_size, self.device)
            flat = processed_logits(flat, sampling)
        return packed_logprobs(flat, emitted.clamp(min=0).reshape(-1), num_top, mode)

    def _outputs(
        self,
        seqs: SequenceOf[SeqInput],
        layout: SpecLayout,
        spec_logprobs: torch.Tensor | None,
        plain_logprobs: torch.Tensor | None,
        prompt: torch.Tensor | None,
    ) -> StepOutput:
        widths = [None if t is None else t.shape[-1] for t in (spec_logprobs, plain_logprobs)]
        prompt_width = None if prompt is None else prompt.shape[-1]
        host = self._host_copy.wait()
        return read_outputs(host, seqs, layout, widths, prompt_width, self.draft.lag)


__all__ = ["SpecStep"]
