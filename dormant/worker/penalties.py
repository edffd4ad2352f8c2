"""The logits processors that can change a greedy pick, with vLLM's semantics, applied in place
before sampling: bad words, ``min_tokens``, then the repetition, frequency and presence
penalties.

- **Masks.** ``masked_stop_token_ids`` (``min_tokens``) and one-token bad words are set to
  -inf. A multi-token bad word sets its last token to -inf when the outputs end with its other
  tokens (vLLM compares against the output tokens only).
- **Penalties** (vLLM, OpenAI's definitions): a token seen in the prompt or the outputs has a
  positive logit divided by ``repetition_penalty`` and a non-positive one multiplied by it;
  then ``logit -= frequency_penalty * count + presence_penalty * (count > 0)`` over the
  output tokens.

Only rows that use a feature are staged, and a batch without any builds nothing
(``LogitsProcessors.build`` returns None). The token histories are staged into one reusable
host buffer (pinned on CUDA) and reach the device in one non-blocking copy; every step on the
device is a batched scatter or elementwise op over the rows that need it, with no host sync.
Bad-word prefixes are matched on the host while staging, as metadata (like the slot mapping),
one tuple comparison per bad word: only the flat indices of the logits to mask cross.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import numpy as np
import torch

from dormant.core.step_input import SeqInput
from dormant.worker.input_buffers import Staging


@dataclass(frozen=True, slots=True)
class LogitsProcessors:
    """What one step's processors need on the device.

    ``mask_indices`` index the flattened logits [n * V]. The penalty tensors describe the
    ``p`` penalised rows, ``rows`` of the batch: ``output_indices`` / ``prompt_indices`` index
    a flattened [p, V] count table (``row * V + token``).
    """

    mask_indices: torch.Tensor | None  # int64 [m]
    rows: torch.Tensor | None  # int64 [p]; None: no penalties
    is_every_row: bool  # the penalised rows are all rows, in order
    output_indices: torch.Tensor | None  # int64 [a]
    prompt_indices: torch.Tensor | None  # int64 [b]
    repetition: torch.Tensor | None  # float32 [p]
    frequency: torch.Tensor | None  # float32 [p]
    presence: torch.Tensor | None  # float32 [p]

    @classmethod
    def build(
        cls, seqs: SequenceOf[SeqInput], vocab_size: int, staging: Staging
    ) -> LogitsProcessors | None:
        """The processors of ``seqs`` (one logits row each), or None when no row uses any."""
        masks, penalised = [], []
        for row, seq in enumerate(seqs):
            if seq.masked_stop_token_ids or seq.bad_words_token_ids:
                masks.append(_mask_indices(row, seq, vocab_size))
            p = seq.params
            if (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) != (1.0, 0.0, 0.0):
                penalised.append(row)
        if not penalised and not masks:
            return None
        ints: list[np.ndarray] = [np.concatenate([np.zeros(0, np.int64), *masks])]
        floats: list[np.ndarray] = []
        if penalised:
            outputs, prompts = [], []
            for i, row in enumerate(penalised):
                seq = seqs[row]
                repetition = _penalties(seq)[0]
                outputs.append(_history(seq.output_token_ids, "output", seq) + i * vocab_size)
                if repetition != 1.0:
                    prompts.append(_history(seq.prompt_token_ids, "prompt", seq) + i * vocab_size)
            ints += [
                np.asarray(penalised, np.int64),
                np.concatenate([np.zeros(0, np.int64), *outputs]),
                np.concatenate([np.zeros(0, np.int64), *prompts]),
            ]
            params = np.array([_penalties(seqs[row]) for row in penalised], np.float32)
            floats = [params[:, 0].copy(), params[:, 1].copy(), params[:, 2].copy()]
        device_ints, device_floats = staging.stage(ints, floats)
        mask = device_ints[0] if ints[0].size else None
        if not penalised:
            return cls(mask, None, False, None, None, None, None, None)
        rows, output_indices, prompt_indices = device_ints[1:]
        return cls(
            mask_indices=mask,
            rows=rows,
            is_every_row=penalised == list(range(len(seqs))),
            output_indices=output_indices,
            prompt_indices=prompt_indices,
            repetition=device_floats[0],
            frequency=device_floats[2],
            presence=device_floats[1],
        )

    def apply(self, logits: torch.Tensor) -> None:
        """Applies every processor to ``logits`` (float32 [n, V], contiguous) in place."""
        if self.mask_indices is not None:
            logits.view(-1).index_fill_(0, self.mask_indices, float("-inf"))
        if self.rows is None:
            return
        assert self.output_indices is not None and self.prompt_indices is not None
        assert self.repetition is not None and self.frequency is not None
        assert self.presence is not None
        num_rows, vocab_size = self.rows.shape[0], logits.shape[1]
        rows = logits if self.is_every_row else logits.index_select(0, self.rows)
        counts = torch.zeros(num_rows * vocab_size, dtype=torch.float32, device=logits.device)
        counts.index_add_(
            0, self.output_indices, torch.ones_like(self.output_indices, dtype=counts.dtype)
        )
        counts = counts.view(num_rows, vocab_size)
        is_output = counts > 0
        seen = is_output.clone()
        seen.view(-1).index_fill_(0, self.prompt_indices, True)
        scale = torch.where(seen, self.repetition[:, None], 1.0)
        rows = torch.where(rows > 0, rows / scale, rows * scale)
        rows -= self.frequency[:, None] * counts + self.presence[:, None] * is_output
        if self.is_every_row:
            logits.copy_(rows)
        else:
            logits.index_copy_(0, self.rows, rows)


def _penalties(seq: SeqInput) -> tuple[float, float, float]:
    """(repetition, presence, frequency); (1, 0, 0) is no penalty."""
    p = seq.params
    return (float(p.repetition_penalty), float(p.presence_penalty), float(p.frequency_penalty))


def _history(token_ids: tuple[int, ...] | None, what: str, seq: SeqInput) -> np.ndarray:
    if token_ids is None:
        raise ValueError(
            f"a request with penalties {_penalties(seq)} reached the worker without its "
            f"{what}_token_ids: ScheduledBatch.step_input() must send them"
        )
    return np.asarray(token_ids, np.int64).reshape(-1)


def _mask_indices(row: int, seq: SeqInput, vocab_size: int) -> np.ndarray:
    """Flat logits indices this row masks: its min_tokens stop ids and its bad words' last
    tokens whose prefix the outputs end with."""
    masked = list(seq.masked_stop_token_ids)
    if seq.bad_words_token_ids:
        outputs = seq.output_token_ids or ()
        for word in seq.bad_words_token_ids:
            prefix = len(word) - 1
            if prefix == 0 or (prefix <= len(outputs) and tuple(outputs[-prefix:]) == word[:-1]):
                masked.append(word[-1])
    ids = np.asarray(masked, np.int64)
    return ids[(ids >= 0) & (ids < vocab_size)] + row * vocab_size
