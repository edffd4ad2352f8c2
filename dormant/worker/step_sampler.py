"""A step's sampling on the device: each row's token from its logits, and the logprobs asked for.

Sampling after the logits, in vLLM's order (``worker/sampler.py``, ``worker/penalties.py``):
raw logprobs → bad words, ``min_tokens``, penalties → greedy argmax, or temperature, min-p,
top-k, top-p and a seeded draw → processed logprobs → gather the sampled token's and the top-k.
The logprobs of a step are those of the engine's ``logprobs_mode``; prompt logprobs are always
the raw log-softmax, as vLLM's are.

Both come out packed (``worker/logprobs.py``), to ride the step's one host copy. The target of
speculative decoding samples its plain rows and prompt positions here too (``spec_step.py``).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import numpy as np
import torch

from dormant.core.config import LogprobsMode
from dormant.core.step_input import SeqInput
from dormant.models import CausalLM
from dormant.worker.input_buffers import Staging
from dormant.worker.logprobs import packed_logprobs, packed_width
from dormant.worker.penalties import LogitsProcessors
from dormant.worker.sampler import SamplingTensors, sample_and_process

# Prompt positions whose logits are materialised at once for prompt logprobs ([chunk, V]).
PROMPT_LOGPROBS_CHUNK = 512


class StepSampler:
    """Samples a step's rows and packs their logprobs; owns the staging buffers it fills.
    Prompt logprobs call ``model.compute_logits`` as it is at each step (verl replaces it on
    the instance)."""

    def __init__(self, model: CausalLM, logprobs_mode: LogprobsMode, device: torch.device) -> None:
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.logprobs_mode: LogprobsMode = logprobs_mode
        self.device = device
        self._penalty_staging = Staging(device)
        self._prompt_staging = Staging(device)

    def sample(
        self, logits: torch.Tensor, seqs: SequenceOf[SeqInput]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sampled tokens (int64 [n]) and, when any row asks, packed logprobs of them."""
        mode = self.logprobs_mode
        num_top = max_logprobs(seqs, self.vocab_size)
        processors = LogitsProcessors.build(seqs, self.vocab_size, self._penalty_staging)
        raw = None  # the logits the raw modes report on, kept from the processors' writes
        if num_top is not None and mode.startswith("raw"):
            raw = logits.clone() if processors is not None else logits
        if processors is not None:
            logits = logits.contiguous()
            processors.apply(logits)
        sampling = SamplingTensors.from_sequences(seqs, self.vocab_size, self.device)
        keep_processed = num_top is not None and mode.startswith("processed")
        tokens, processed = sample_and_process(logits, sampling, keep_processed)
        values = processed if processed is not None else raw
        if values is None or num_top is None:
            return tokens, None
        return tokens, packed_logprobs(values, tokens, num_top, mode)

    def prompt_logprobs(
        self, seqs: SequenceOf[SeqInput], hidden: torch.Tensor
    ) -> torch.Tensor | None:
        """Packed logprobs of each actual next prompt token, at every computed position of the
        rows with ``compute_prompt_logprobs`` but their last, in row order (None when no row
        asks). ``hidden``: the step's final hidden states, one row per computed token."""
        rows = [(r, s) for r, s in enumerate(seqs) if s.compute_prompt_logprobs]
        if not rows:
            return None
        num_top = max(num_logprobs(s.params.prompt_logprobs, self.vocab_size) for _, s in rows)
        starts = np.cumsum([0, *(len(s.token_ids) for s in seqs)])
        positions = [np.arange(starts[r], starts[r + 1] - 1) for r, _ in rows]
        targets = [np.asarray(s.token_ids[1:], np.int64) for _, s in rows]
        (positions_t, targets_t), _ = self._prompt_staging.stage(
            [np.concatenate(positions), np.concatenate(targets)]
        )
        packs = []
        for first in range(0, positions_t.shape[0], PROMPT_LOGPROBS_CHUNK):
            chunk = slice(first, first + PROMPT_LOGPROBS_CHUNK)
            chunk_logits = self.model.compute_logits(hidden[positions_t[chunk]])
            packs.append(packed_logprobs(chunk_logits, targets_t[chunk], num_top, "raw_logprobs"))
        empty = torch.empty((0, packed_width(num_top)), dtype=torch.int32, device=self.device)
        return torch.cat([empty, *packs])


def num_logprobs(requested: int | bool | None, vocab_size: int) -> int:
    """vLLM's count: ``-1`` is the whole vocabulary (True, as vLLM takes it, is 1)."""
    count = int(requested or 0)
    return vocab_size if count < 0 else min(count, vocab_size)


def max_logprobs(seqs: SequenceOf[SeqInput], vocab_size: int) -> int | None:
    """The most top logprobs any row asks for, or None when no row asks for logprobs."""
    asked = {s.params.logprobs for s in seqs}  # each distinct count once (a batch shares few)
    asked.discard(None)
    return max(num_logprobs(k, vocab_size) for k in asked) if asked else None
