"""``SamplingTensors.from_sequences`` reads its columns at once and hashes the noise keys on
the host in numpy: every field equals the per-row build it replaced, bit for bit, and the keys
are the ones the sampler always drew (so every seeded token stays the same)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from dormant.core.sampling_params import SamplingParams
from dormant.core.step_input import SeqInput
from dormant.worker.sampler import SamplingTensors, noise_keys, seed_keys, step_keys

VOCAB_SIZE = 50
SEEDS = [0, 1, -1, 2**63 - 1, -(2**63), 123456789012345]
STEPS = [0, 7, 3, 1000, 2**40, 5]
# noise_keys(SEEDS, STEPS) as the sampler has computed them since it was written.
KEYS = [
    [4019235728, 3181462570, 236535667, 1337780871, 1904302105, 2038820088],
    [1520614945, 3395245686, 2322887142, 1628101, 3787663771, 4122288437],
]


def test_noise_keys_are_the_sampler_s_on_the_host_and_the_device() -> None:
    assert noise_keys(torch.tensor(SEEDS), torch.tensor(STEPS)).tolist() == KEYS
    host = noise_keys(np.array(SEEDS, np.int64), np.array(STEPS, np.int64))
    assert isinstance(host, np.ndarray) and host.dtype == np.int64
    assert host.tolist() == KEYS


def reference(seqs: list[SeqInput], vocab_size: int) -> dict[str, object]:
    """Each row's values one at a time, as vLLM's parameters define them."""
    rows: dict[str, list] = {k: [] for k in ("temperatures", "top_ks", "top_ps", "min_ps")}
    seeds, steps, greedy = [], [], []
    for seq in seqs:
        p = seq.params
        seed = seq.seed & (2**64 - 1)
        seeds.append(seed - 2**64 if seed >= 2**63 else seed)
        steps.append(seq.num_output_tokens)
        greedy.append(p.is_greedy)
        top_k = 0 if p.is_greedy or p.top_k is None else p.top_k
        rows["top_ks"].append(vocab_size if top_k <= 0 else min(top_k, vocab_size))
        rows["temperatures"].append(1.0 if p.is_greedy else p.temperature)
        rows["top_ps"].append(1.0 if p.is_greedy else p.top_p)
        rows["min_ps"].append(0.0 if p.is_greedy else p.min_p)
    seeds_t, steps_t = torch.tensor(seeds, dtype=torch.int64), torch.tensor(steps)
    filtered = zip(rows["top_ks"], rows["top_ps"], rows["min_ps"], strict=True)
    return {
        "temperatures": torch.tensor(rows["temperatures"], dtype=torch.float32),
        "top_ks": torch.tensor(rows["top_ks"], dtype=torch.int32),
        "top_ps": torch.tensor(rows["top_ps"], dtype=torch.float32),
        "min_ps": torch.tensor(rows["min_ps"], dtype=torch.float32),
        "seeds": seeds_t,
        "steps": steps_t.to(torch.int64),
        "is_greedy": torch.tensor(greedy, dtype=torch.bool),
        "noise_keys": noise_keys(seeds_t, steps_t.to(torch.int64)),
        "is_all_greedy": all(greedy),
        "is_any_filtered": any(k < vocab_size or tp < 1.0 or mp > 0.0 for k, tp, mp in filtered),
    }


def random_row(rand: random.Random) -> SeqInput:
    params = SamplingParams(
        temperature=rand.choice([0.0, 1e-6, 0.01, 0.7, 1, 1.0, 1.3]),
        top_k=rand.choice([None, 0, -1, 1, 7, VOCAB_SIZE, 10_000]),
        top_p=rand.choice([1.0, 1 - 1e-9, 0.9, 0.33]),  # 1 - 1e-9 is 1.0 in float32
        min_p=rand.choice([0.0, 0.0, 0.05, 1.0]),
    )
    seed = rand.choice([0, -2, 2**64 - 1, 2**63, rand.randrange(-(2**70), 2**70)])
    return SeqInput((1,), 0, (0,), params, seed, num_output_tokens=rand.randrange(2**41))


@pytest.mark.parametrize("case", range(20))
def test_from_sequences_equals_the_per_row_build(case: int) -> None:
    rand = random.Random(case)
    seqs = [random_row(rand) for _ in range(rand.choice([0, 1, 2, 9, 33]))]
    built = SamplingTensors.from_sequences(seqs, VOCAB_SIZE, "cpu")
    for name, expected in reference(seqs, VOCAB_SIZE).items():
        value = getattr(built, name)
        if isinstance(expected, torch.Tensor):
            assert value.dtype == expected.dtype and value.shape == expected.shape, name
            assert torch.equal(value, expected), name
        else:
            assert value is expected, name


def test_flags_follow_double_precision_parameters() -> None:
    # top_p = 1 - 1e-9 is 1.0 in float32 but filters (as it always did): the flag reads the
    # parameter, not its float32 copy.
    seqs = [SeqInput((1,), 0, (0,), SamplingParams(top_p=1 - 1e-9), 0, 0)]
    built = SamplingTensors.from_sequences(seqs, VOCAB_SIZE, "cpu")
    assert built.is_any_filtered and built.top_ps.tolist() == [1.0]


def test_a_top_k_beyond_int64_keeps_the_whole_vocabulary() -> None:
    """A client may send any int as ``top_k`` (schemathesis sent 5.6e24): it means "every
    token" past the vocabulary, as in vLLM, and must not overflow the int64 column (regression:
    the vectorised build raised OverflowError inside the engine's step)."""
    huge = SeqInput((1,), 0, (0,), SamplingParams(temperature=1.0, top_k=2**83), seed=0,
                    num_output_tokens=0)  # fmt: skip
    small = SeqInput((1,), 0, (0,), SamplingParams(temperature=1.0, top_k=3), seed=1,
                     num_output_tokens=0)  # fmt: skip
    tensors = SamplingTensors.from_sequences([huge, small], VOCAB_SIZE, "cpu")
    assert tensors.top_ks.tolist() == [VOCAB_SIZE, 3]


def test_seed_keys_then_step_keys_are_noise_keys() -> None:
    """A row's seed hashed once (``seed_keys``), then with each step (``step_keys``), gives the
    keys of every (seed, step) pair, on the host and the device."""
    seeds, steps = np.array(SEEDS, np.int64), np.array(STEPS, np.int64)
    seeded = seed_keys(seeds)
    assert step_keys(seeded, steps).tolist() == KEYS
    tiled = step_keys(np.tile(seeded, 3), np.concatenate([steps, steps + 1, steps + 2]))
    for j in range(3):
        assert tiled[:, j * 6 : (j + 1) * 6].tolist() == noise_keys(seeds, steps + j).tolist()
    device = step_keys(seed_keys(torch.tensor(SEEDS)), torch.tensor(STEPS))
    assert device.tolist() == KEYS


@pytest.mark.parametrize("temperature", [0, 0.0, 1e-6, 1e-5 - 1e-12, 1e-5, 1e-5 + 1e-12, 1])
def test_greedy_rows_are_the_params_greedy_rows(temperature: float) -> None:
    """The greedy column compares the temperatures as ``SamplingParams.is_greedy`` does."""
    params = SamplingParams(temperature=temperature)
    built = SamplingTensors.from_sequences([SeqInput((1,), 0, (0,), params, 0, 0)], 5, "cpu")
    assert built.is_greedy.tolist() == [params.is_greedy]
