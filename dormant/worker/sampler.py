"""Greedy and seeded random sampling, vectorized and without host synchronization.

Random rows use the exponential-noise trick: ``argmax_v(p_v / E_v)`` with ``E_v ~ Exp(1)``
i.i.d. picks ``v`` with probability ``p_v``. The noise is not drawn from a generator: each
``E_v`` is a pure function of ``(seed, step, v)`` (a counter-based hash), so a request's
token depends only on its own logits, seed and output position. That makes sampling
reproducible whatever the batch composition, after a preemption, and under CUDA graphs.

Hashing uses 32-bit words held in int64 tensors, masked after every step, and multipliers
below 2**31, so no product reaches 2**63: there is no signed overflow anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from itertools import repeat
from operator import and_, attrgetter
from typing import TypeVar

import numpy as np
import torch

from dormant.core.sampling_params import GREEDY_TEMPERATURE_EPSILON
from dormant.core.step_input import SeqInput
from dormant.layers.kernels import use_triton

Int64s = TypeVar("Int64s", torch.Tensor, np.ndarray)  # int64 values: on a device or the host
_MASK_32 = 0xFFFFFFFF
_MASK_64 = (1 << 64) - 1
# The "lowbias32" mixer of Wellons' hash-prospector, [16 21f0aaad 15 735a2d97 15]: a strong
# 32-bit bijection whose multipliers are below 2**31.
_MIX_MULTIPLIERS = (0x21F0AAAD, 0x735A2D97)
_MIX_SHIFTS = (16, 15, 15)
# U = (k + 0.5) / 2**23 with k < 2**23 is exact in float32 and strictly inside (0, 1).
_NUM_UNIFORM_BITS = 23
# Distinct salts give the two per-row keys independent hashes of (seed, step).
_KEY_SALTS = (0x9E3779B9, 0x7F4A7C15)
# Rows of the packed int64 host buffer. _FLOAT_ROWS hold four float32 per column (two per
# int64 entry): temperatures, top_ps, min_ps, then the int32 top_ks (as their bits); the first
# n bytes of _GREEDY_ROW are the bool flags. Every field is then a view of the one copy.
_SEED_ROW, _STEP_ROW, _GREEDY_ROW = range(3)
_KEY_ROWS = slice(3, 5)
_FLOAT_ROWS = slice(5, 7)
_NUM_PACKED_ROWS = 7
_PARAMS, _SEED, _NUM_OUTPUT_TOKENS = map(attrgetter, ("params", "seed", "num_output_tokens"))
_TEMPERATURE, _TOP_P, _MIN_P = map(attrgetter, ("temperature", "top_p", "min_p"))


@dataclass(frozen=True, slots=True)
class SamplingTensors:
    """Per-row sampling parameters on the device, for a batch of ``n`` rows.

    ``top_ks`` holds the vocabulary size for rows without top-k (keep all tokens), and
    ``steps`` the output position of the token being sampled. Greedy rows are never filtered
    (top-k = vocabulary, top-p 1, min-p 0, temperature 1), as vLLM resets those parameters for
    greedy requests: their processed logits are the logits. ``noise_keys`` are the
    per-row hashes of ``(seeds, steps)`` (see ``noise_keys``), computed on the host so the
    device only does per-element work. The host-side flags are computed when the tensors
    are built, so branching on them costs no synchronization.
    """

    temperatures: torch.Tensor  # float32 [n]; 1.0 on greedy rows (unused there)
    top_ks: torch.Tensor  # int32 [n], in 1 .. vocab_size
    top_ps: torch.Tensor  # float32 [n], in (0, 1]
    min_ps: torch.Tensor  # float32 [n], in [0, 1]
    seeds: torch.Tensor  # int64 [n] (the 64-bit seed, two's complement)
    steps: torch.Tensor  # int64 [n]
    is_greedy: torch.Tensor  # bool [n]
    noise_keys: torch.Tensor  # int64 [2, n]
    is_all_greedy: bool
    is_any_filtered: bool  # some random row has top_k < vocab_size, top_p < 1 or min_p > 0

    @classmethod
    def from_sequences(
        cls, seqs: SequenceOf[SeqInput], vocab_size: int, device: torch.device | str
    ) -> SamplingTensors:
        """Build the rows for ``seqs`` (one row each, in order) on ``device``.

        Each parameter is read from the rows once, into a numpy column; the rest (greedy
        resets, top-k bounds, the noise keys, the flags) is column arithmetic. The values are
        packed into one host buffer (pinned for CUDA) and copied with a single
        ``non_blocking`` transfer; every field is a view of that copy.
        """
        device = torch.device(device)
        num_seqs = len(seqs)
        params = list(map(_PARAMS, seqs))  # columns read by C callables where they can be
        # float64 columns, as the parameters are: the flags compare these, the rows get float32.
        temperatures = np.fromiter(map(_TEMPERATURE, params), np.float64, num_seqs)
        greedy = temperatures < GREEDY_TEMPERATURE_EPSILON  # params.is_greedy
        # top_k None, 0 or -1 all mean "off" (vLLM's callers pass all three). Clamped to the
        # vocabulary while still a Python int: a client's top_k may not fit an int64.
        top_ks = np.fromiter((min(p.top_k or 0, vocab_size) for p in params), np.int64, num_seqs)
        top_ks[greedy | (top_ks <= 0)] = vocab_size
        np.minimum(top_ks, vocab_size, out=top_ks)
        top_ps = np.fromiter(map(_TOP_P, params), np.float64, num_seqs)
        min_ps = np.fromiter(map(_MIN_P, params), np.float64, num_seqs)
        temperatures[greedy], top_ps[greedy], min_ps[greedy] = 1.0, 1.0, 0.0
        packed = torch.empty(
            (_NUM_PACKED_ROWS, num_seqs), dtype=torch.int64, pin_memory=device.type == "cuda"
        )
        host = packed.numpy()
        host[_SEED_ROW] = np.fromiter(
            map(and_, map(_SEED, seqs), repeat(_MASK_64)), np.uint64, num_seqs
        ).view(np.int64)
        host[_STEP_ROW] = np.fromiter(map(_NUM_OUTPUT_TOKENS, seqs), np.int64, num_seqs)
        host[_GREEDY_ROW].view(np.bool_)[:num_seqs] = greedy
        host[_KEY_ROWS] = noise_keys(host[_SEED_ROW], host[_STEP_ROW])
        floats = host[_FLOAT_ROWS].reshape(-1).view(np.float32)
        floats[: 3 * num_seqs] = np.concatenate([temperatures, top_ps, min_ps])
        floats[3 * num_seqs :].view(np.int32)[:] = top_ks
        is_any_filtered = bool(((top_ks < vocab_size) | (top_ps < 1.0) | (min_ps > 0.0)).any())
        on_device = packed.to(device, non_blocking=True)
        device_floats = on_device[_FLOAT_ROWS].reshape(-1).view(torch.float32)
        return cls(
            temperatures=device_floats[:num_seqs],
            top_ks=device_floats[3 * num_seqs :].view(torch.int32),
            top_ps=device_floats[num_seqs : 2 * num_seqs],
            min_ps=device_floats[2 * num_seqs : 3 * num_seqs],
            seeds=on_device[_SEED_ROW],
            steps=on_device[_STEP_ROW],
            is_greedy=on_device[_GREEDY_ROW].view(torch.bool)[:num_seqs],
            noise_keys=on_device[_KEY_ROWS],
            is_all_greedy=bool(greedy.all()),
            is_any_filtered=is_any_filtered,
        )


def sample(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """One token id per row of ``logits`` (float32 [n, V]) as an int64 [n] device tensor.

    Greedy rows take the argmax. Random rows divide by their temperature, keep the tokens
    that pass min-p and their top-k, then the smallest top-p mass of those (renormalized), and
    sample from what is left. Never synchronizes with the host. On CUDA with Triton, a batch
    without filtering draws in one kernel (``dormant.layers.triton_sampling``) with the same
    arithmetic, so the same tokens.
    """
    return sample_and_process(logits, t, keep_processed=False)[0]


def sample_and_process(
    logits: torch.Tensor, t: SamplingTensors, keep_processed: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``sample``, and with ``keep_processed`` also the logits it sampled from (float32
    [n, V], vocabulary order): divided by the temperature, filtered tokens at -inf; greedy
    rows' are their logits. That is vLLM's "processed" logits. ``logits`` is not modified."""
    if logits.dtype != torch.float32 or logits.dim() != 2:
        raise TypeError(
            f"sample needs float32 logits of shape [n, V], got {logits.dtype} {tuple(logits.shape)}"
        )
    if t.is_all_greedy:
        return logits.argmax(dim=-1), logits if keep_processed else None
    if not t.is_any_filtered and use_triton(logits) and _is_unit_stride(logits, t):
        from dormant.layers.triton_sampling import fused_race  # needs Triton (CUDA)

        tokens = fused_race(logits, t.temperatures, t.noise_keys, t.is_greedy)
        return tokens, logits / t.temperatures[:, None] if keep_processed else None
    return sample_reference(logits, t, keep_processed)


def _is_unit_stride(logits: torch.Tensor, t: SamplingTensors) -> bool:
    """Whether the fused draw can read these tensors: each row (and each key row) contiguous."""
    return (
        logits.stride(-1) == 1
        and t.noise_keys.stride(-1) == 1
        and t.temperatures.stride(0) == 1
        and t.is_greedy.stride(0) == 1
    )


def sample_reference(
    logits: torch.Tensor, t: SamplingTensors, keep_processed: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``sample_and_process`` in torch operations, on any device: the reference the fused
    kernel's tokens equal."""
    greedy_tokens = logits.argmax(dim=-1)
    scaled = logits / t.temperatures[:, None]
    if t.is_any_filtered:
        scaled, vocab_ids = scaled.sort(dim=-1, descending=True, stable=True)
        scaled = scaled.masked_fill(~_filter_mask(scaled, t), float("-inf"))
    else:
        vocab_ids = None
    processed = None
    if keep_processed:
        processed = scaled if vocab_ids is None else scaled.scatter(-1, vocab_ids, scaled)
    # Unnormalized probabilities: the argmax does not need the sum, and skipping it keeps
    # the result bitwise independent of whether the row went through the sort.
    probs = scaled.sub(scaled.amax(dim=-1, keepdim=True)).exp_()
    noise = exponential_noise(t.noise_keys, logits.shape[-1], vocab_ids)
    choice = probs.div_(noise).argmax(dim=-1, keepdim=True)
    random_tokens = choice.squeeze(-1) if vocab_ids is None else vocab_ids.gather(-1, choice)
    return torch.where(t.is_greedy, greedy_tokens, random_tokens.reshape(-1)), processed


def processed_logits(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """The logits ``sample`` draws a row's token from (float32 [n, V], vocabulary order):
    divided by the temperature, tokens outside min-p, top-k and top-p at -inf. Greedy rows'
    are their logits, unchanged. Their softmax is the distribution ``sample`` samples from
    (speculative verification needs it as probabilities). ``logits`` is not modified."""
    if t.is_all_greedy:
        return logits
    scaled = logits / t.temperatures[:, None]
    if not t.is_any_filtered:
        return scaled
    scaled, vocab_ids = scaled.sort(dim=-1, descending=True, stable=True)
    scaled = scaled.masked_fill(~_filter_mask(scaled, t), float("-inf"))
    return scaled.scatter(-1, vocab_ids, scaled)


def _filter_mask(sorted_logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Which entries of each descending row to keep: those within ``min_p`` of the most likely
    one and in the top-k, then the top-p of those (vLLM applies min-p, top-k, top-p in turn).

    The first entry is always kept, and rows with ``top_p == 1`` keep all of their top-k
    (a float cumulative sum can pass 1.0 early and would drop the tail otherwise).
    """
    ranks = torch.arange(sorted_logits.shape[-1], device=sorted_logits.device)
    keep = ranks[None, :] < t.top_ks[:, None]
    # p_v < min_p * p_max, with p_v / p_max = exp(l_v - l_max); rows with min_p 0 keep all.
    relative = sorted_logits.sub(sorted_logits[:, :1]).exp_()
    keep &= relative >= t.min_ps[:, None]
    probs = sorted_logits.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    top_ps = t.top_ps[:, None]
    return keep & ((mass_before < top_ps) | (top_ps >= 1.0))


def exponential_noise(
    keys: torch.Tensor, vocab_size: int, vocab_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Exp(1) noise, float32 [n, V], for the rows' ``noise_keys`` (int64 [2, n]).

    Entry ``[i, j]`` is a pure function of ``(keys[:, i], v)``, where ``v`` is
    ``vocab_ids[i, j]``, or ``j`` when ``vocab_ids`` is ``None``. Every value is finite and
    strictly positive. Per element this costs one table lookup, a keyed xor-add and one
    32-bit mix: the hash of each vocabulary id is shared by all rows.
    """
    return uniform_noise(keys, vocab_size, vocab_ids).log_().neg_()


def uniform_noise(
    keys: torch.Tensor, vocab_size: int, vocab_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Uniform noise strictly inside (0, 1), float32 [n, V], indexed as ``exponential_noise``
    (which is ``-log`` of it): multiples of 2**-23 plus 2**-24, each exact in float32."""
    id_hashes = _mix32(torch.arange(vocab_size, device=keys.device))
    id_hashes = id_hashes[None, :] if vocab_ids is None else id_hashes[vocab_ids]
    bits = (id_hashes ^ keys[0, :, None]).add_(keys[1, :, None]).bitwise_and_(_MASK_32)
    bits = _mix32(bits).bitwise_right_shift_(32 - _NUM_UNIFORM_BITS)
    return bits.to(torch.float32).add_(0.5).mul_(2.0**-_NUM_UNIFORM_BITS)


def noise_keys(seeds: Int64s, steps: Int64s, salts: tuple[int, int] = _KEY_SALTS) -> Int64s:
    """Two 32-bit keys per row (int64 [2, n]), each hashing all 128 bits of ``(seed, step)``.

    ``seeds`` and ``steps`` are int64 tensors, or numpy arrays (the sampler hashes on the
    host, where the columns are): the same operators give the same keys, as the same type.
    ``salts`` (two 32-bit words) select an independent family of keys: the sampler's are the
    default; other users of the noise (speculative decoding) pass their own, so their draws
    are independent of the sampler's at the same ``(seed, step)``.
    """
    return step_keys(seed_keys(seeds, salts), steps)


def seed_keys(seeds: Int64s, salts: tuple[int, int] = _KEY_SALTS) -> Int64s:
    """The first half of ``noise_keys``: the keys (int64 [2, n]) after hashing the seeds. A
    row's keys at several steps hash its seed once: ``step_keys`` of these, each step."""
    if isinstance(seeds, np.ndarray):
        keys: Int64s = np.array(salts, np.int64)[:, None].repeat(seeds.shape[0], axis=1)
    else:
        keys = torch.stack([torch.full_like(seeds, salt) for salt in salts])
    return _mix_in(keys, seeds)


def step_keys(seeded: Int64s, steps: Int64s) -> Int64s:
    """``noise_keys`` of the rows whose ``seed_keys`` are ``seeded`` (int64 [2, n]), at
    ``steps`` (int64 [n])."""
    return _mix_in(seeded, steps)


def _mix_in(keys: Int64s, value: Int64s) -> Int64s:
    """``keys`` (int64 [2, n]) with both 32-bit halves of ``value`` (int64 [n]) hashed in."""
    keys = _mix32(keys ^ (value & _MASK_32))
    return _mix32(keys ^ ((value >> 32) & _MASK_32))


def _mix32(x: Int64s) -> Int64s:
    """A bijective 32-bit mix of ``x`` (int64 values in [0, 2**32), a tensor or a numpy
    array); returns a new one."""
    first_shift, second_shift, third_shift = _MIX_SHIFTS
    first_multiplier, second_multiplier = _MIX_MULTIPLIERS
    x = x ^ (x >> first_shift)
    x *= first_multiplier
    x &= _MASK_32
    x ^= x >> second_shift
    x *= second_multiplier
    x &= _MASK_32
    x ^= x >> third_shift
    return x
