"""The fused multi-step decode graph's sampling inputs: every step's rows, static in ``runtime``.

The graph samples each of its ``num_steps`` steps with ``sampler.sample_and_process``, the
sampler a single step uses, from a ``SamplingTensors`` whose fields view the static device
buffers below, so a replay reads them at the addresses it captured. Before each replay,
``load`` writes every step's rows of the batch into one pinned host buffer and copies it with
one non-blocking transfer; step ``j``'s noise keys are ``noise_keys(seeds, steps + j)``, the
keys the single step ``j`` steps later would hash, so the graph's tokens are the single steps'
(each seed is hashed once, ``seed_keys``, then with each step, ``step_keys``).

The graph serves rows that are greedy or random *without* filtering (``is_unfiltered``), so
``top_ks`` / ``top_ps`` / ``min_ps`` are constants (the vocabulary, 1, 0), written once.
Greedy and padding rows have temperature 1.0 and take their argmax through the sampler's
``torch.where(is_greedy, ...)``; their processed logits are their logits.

The flat int64 buffer is laid out per batch size ``bs`` (``_Layout``), so every field of every
graph is contiguous; graphs replay one at a time, so one buffer serves them all:

| entries (int64)      | viewed as        | what                                                |
|----------------------|------------------|-----------------------------------------------------|
| 2 * N * bs           | int64 [N, 2, bs] | step j's noise keys                                 |
| N * bs               | int64 [N, bs]    | step j's output position (``steps``): first + j     |
| bs                   | int64 [bs]       | seeds (the 64-bit seed, two's complement)           |
| ceil(bs / 2)         | float32 [bs]     | temperatures; 1.0 on greedy and padding rows        |
| ceil(bs / 8)         | bool [bs]        | is_greedy; True on padding rows                     |
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from functools import cache, cached_property
from itertools import repeat
from operator import and_, attrgetter

import numpy as np
import torch

from dormant.core.sampling_params import GREEDY_TEMPERATURE_EPSILON, SamplingParams
from dormant.core.step_input import SeqInput
from dormant.memory import RUNTIME, MemoryManager
from dormant.memory.census import host_staging
from dormant.worker.sampler import SamplingTensors, seed_keys, step_keys

_MASK_64 = (1 << 64) - 1
_PARAMS, _TEMPERATURE = attrgetter("params"), attrgetter("temperature")
_SEED, _NUM_OUTPUT_TOKENS = attrgetter("seed"), attrgetter("num_output_tokens")


def is_unfiltered(params: SamplingParams, vocab_size: int) -> bool:
    """Whether the sampler draws this row from its whole tempered distribution: greedy, or
    random with top-k off (None, 0, -1 or at least the vocabulary), top-p 1 and min-p 0.
    These are the rows ``SamplingTensors.from_sequences`` does not count as filtered."""
    if params.is_greedy:
        return True
    top_k = params.top_k or 0
    is_top_k_off = top_k <= 0 or top_k >= vocab_size
    return is_top_k_off and params.top_p >= 1.0 and params.min_p <= 0.0


@dataclass(frozen=True)
class _Layout:
    """Where each field of a ``bs``-row batch of ``num_steps`` steps lies in the flat buffer.
    (Each slice is computed once, on first use: ``load`` reads them on every call.)"""

    bs: int
    num_steps: int

    @cached_property
    def keys(self) -> slice:
        return slice(0, 2 * self.num_steps * self.bs)

    @cached_property
    def steps(self) -> slice:
        return slice(self.keys.stop, self.keys.stop + self.num_steps * self.bs)

    @cached_property
    def seeds(self) -> slice:
        return slice(self.steps.stop, self.steps.stop + self.bs)

    @cached_property
    def temperatures(self) -> slice:
        return slice(self.seeds.stop, self.seeds.stop + (self.bs + 1) // 2)

    @cached_property
    def is_greedy(self) -> slice:
        return slice(self.temperatures.stop, self.temperatures.stop + (self.bs + 7) // 8)

    @cached_property
    def size(self) -> int:
        return self.is_greedy.stop


@cache
def _layout(bs: int, num_steps: int) -> _Layout:
    """The one ``_Layout`` of each shape (its slices computed once)."""
    return _Layout(bs, num_steps)


class GraphSampling:
    """Static sampling rows for graphs of up to ``max_batch_size`` rows and ``num_steps`` steps.

    Precondition of ``load``: the previous load's copy has completed (the runner waits for
    each step's results before the next step), so the host buffer may be overwritten.
    """

    def __init__(
        self, mm: MemoryManager, max_batch_size: int, num_steps: int, vocab_size: int
    ) -> None:
        self.num_steps, self.vocab_size = num_steps, vocab_size
        size = _Layout(max_batch_size, num_steps).size
        specs = [
            ((size,), torch.int64),
            ((max_batch_size,), torch.int32),
            ((max_batch_size,), torch.float32),
            ((max_batch_size,), torch.float32),
        ]
        self._flat, self._top_ks, self._top_ps, self._min_ps = mm.empty_many(specs, RUNTIME)
        self._flat.zero_()
        self._top_ks.fill_(vocab_size)
        self._top_ps.fill_(1.0)
        self._min_ps.zero_()
        pin = mm.backend.device.type == "cuda"
        self._host = host_staging(torch.zeros(size, dtype=torch.int64, pin_memory=pin))
        self._host_np = self._host.numpy()

    def tensors(self) -> list[torch.Tensor]:
        """Every device buffer (what the pointer guard watches)."""
        return [self._flat, self._top_ks, self._top_ps, self._min_ps]

    def rows(self, bs: int) -> list[SamplingTensors]:
        """Step ``j``'s ``SamplingTensors`` of a ``bs``-row graph, for each step: views of the
        static buffers, valid for every later replay."""
        layout, flat = _layout(bs, self.num_steps), self._flat
        keys = flat[layout.keys].view(self.num_steps, 2, bs)
        steps = flat[layout.steps].view(self.num_steps, bs)
        constants = {
            "temperatures": flat[layout.temperatures].view(torch.float32)[:bs],
            "top_ks": self._top_ks[:bs],
            "top_ps": self._top_ps[:bs],
            "min_ps": self._min_ps[:bs],
            "seeds": flat[layout.seeds],
            "is_greedy": flat[layout.is_greedy].view(torch.bool)[:bs],
        }
        return [
            SamplingTensors(
                **constants,
                steps=steps[j],
                noise_keys=keys[j],
                is_all_greedy=False,
                is_any_filtered=False,
            )
            for j in range(self.num_steps)
        ]

    def load(self, seqs: SequenceOf[SeqInput], bs: int, non_blocking: bool = True) -> None:
        """Writes every step's rows of ``seqs`` (rows ``len(seqs) .. bs`` padding) for a
        ``bs``-row graph: one copy of the host buffer.

        Preconditions: ``len(seqs) <= bs <= max_batch_size``; every row ``is_unfiltered``.
        """
        num_seqs, num_steps = len(seqs), self.num_steps
        layout = _layout(bs, num_steps)
        host = self._host_np
        # Each column read by C callables (attrgetter, map): no Python frame per row.
        temperature = np.fromiter(map(_TEMPERATURE, map(_PARAMS, seqs)), np.float64, num_seqs)
        is_greedy = host[layout.is_greedy].view(np.bool_)[:bs]
        is_greedy[num_seqs:] = True
        is_greedy[:num_seqs] = temperature < GREEDY_TEMPERATURE_EPSILON  # params.is_greedy
        temperatures = host[layout.temperatures].view(np.float32)[:bs]
        temperatures[:num_seqs] = temperature
        temperatures[is_greedy] = 1.0
        seeds = host[layout.seeds]
        seeds[num_seqs:] = 0
        seeds[:num_seqs] = np.fromiter(
            map(and_, map(_SEED, seqs), repeat(_MASK_64)), np.uint64, num_seqs
        ).view(np.int64)
        steps = host[layout.steps].reshape(num_steps, bs)
        steps[0, num_seqs:] = 0
        steps[0, :num_seqs] = np.fromiter(map(_NUM_OUTPUT_TOKENS, seqs), np.int64, num_seqs)
        steps[1:] = steps[0] + np.arange(1, num_steps, dtype=np.int64)[:, None]
        # Each seed hashed once, then every (seed, step j) pair: [2, N * bs] keys, step-major.
        keys = step_keys(np.tile(seed_keys(seeds), num_steps), steps.reshape(-1))
        host[layout.keys].reshape(num_steps, 2, bs)[:] = keys.reshape(2, num_steps, bs).swapaxes(
            0, 1
        )
        self._flat[: layout.size].copy_(self._host[: layout.size], non_blocking=non_blocking)

    def fill_padding(self, bs: int) -> None:
        """Makes every row of a ``bs``-row graph padding and waits for the copy (warm-ups run
        the graph body on these rows)."""
        self.load((), bs, non_blocking=False)
