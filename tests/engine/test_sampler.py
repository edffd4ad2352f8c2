"""Sampler: greedy, seeded reproducibility, distribution, filtering, and the hash."""

from __future__ import annotations

import random

import pytest
import torch

from dormant.core.sampling_params import SamplingParams
from dormant.engine.sequence import Sequence
from dormant.worker.sampler import (
    SamplingTensors,
    _mix32,
    exponential_noise,
    noise_keys,
    sample,
    sample_and_process,
)

VOCAB_SIZE = 50


def make_seq(num_output_tokens: int = 0, seed: int = 0, **kwargs: object) -> Sequence:
    seq = Sequence(0, [1], SamplingParams(**kwargs), seed=seed)  # type: ignore[arg-type]
    seq.output_token_ids.extend([1] * num_output_tokens)
    return seq


def tensors(seqs: list[Sequence], vocab_size: int = VOCAB_SIZE) -> SamplingTensors:
    return SamplingTensors.from_sequences(seqs, vocab_size, "cpu")


def random_logits(num_rows: int, vocab_size: int = VOCAB_SIZE, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab_size, generator=generator) * 3


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_from_sequences_builds_rows() -> None:
    seqs = [
        make_seq(3, seed=5, temperature=0.5, top_k=7, top_p=0.9, min_p=0.25),
        make_seq(0, seed=2**64 - 1, temperature=0.0, top_k=3, top_p=0.5, min_p=0.5),
        make_seq(1, seed=-2, top_k=10_000),
    ]
    t = tensors(seqs)
    assert t.temperatures.dtype == torch.float32 and t.top_ps.dtype == torch.float32
    assert t.top_ks.dtype == torch.int32
    assert t.seeds.dtype == torch.int64 and t.steps.dtype == torch.int64
    assert t.is_greedy.dtype == torch.bool
    assert t.temperatures.tolist() == [0.5, 1.0, 1.0]
    assert t.top_ks.tolist() == [7, VOCAB_SIZE, VOCAB_SIZE]
    assert t.top_ps.tolist() == pytest.approx([0.9, 1.0, 1.0])  # greedy rows are unfiltered
    assert t.min_ps.tolist() == [0.25, 0.0, 0.0]
    assert t.seeds.tolist() == [5, -1, -2]
    assert t.steps.tolist() == [3, 0, 1]
    assert t.is_greedy.tolist() == [False, True, False]
    assert torch.equal(t.noise_keys, noise_keys(t.seeds, t.steps))
    assert not t.is_all_greedy and t.is_any_filtered


def test_flags() -> None:
    assert tensors([make_seq(temperature=0.0, top_k=3)]).is_all_greedy
    unfiltered = tensors([make_seq(temperature=0.0, top_k=3), make_seq()])
    assert not unfiltered.is_all_greedy and not unfiltered.is_any_filtered
    assert tensors([make_seq(top_p=0.5)]).is_any_filtered
    assert tensors([make_seq(min_p=0.1)]).is_any_filtered


@pytest.mark.parametrize("top_k", [None, 0, -1])
def test_top_k_off_spellings_keep_every_token(top_k: int | None) -> None:
    t = tensors([make_seq(top_k=top_k)])
    assert t.top_ks.tolist() == [VOCAB_SIZE] and not t.is_any_filtered


def test_empty_batch() -> None:
    assert sample(torch.zeros(0, VOCAB_SIZE), tensors([])).shape == (0,)


def test_logits_must_be_float32_matrix() -> None:
    with pytest.raises(TypeError, match="float32"):
        sample(torch.zeros(1, VOCAB_SIZE, dtype=torch.bfloat16), tensors([make_seq()]))
    with pytest.raises(TypeError, match="shape"):
        sample(torch.zeros(VOCAB_SIZE), tensors([make_seq()]))


def test_greedy_rows_take_the_argmax() -> None:
    logits = random_logits(6)
    seqs = [make_seq(seed=i, temperature=0.0 if i % 2 else 1.0, top_k=3) for i in range(6)]
    tokens = sample(logits, tensors(seqs))
    assert tokens.dtype == torch.int64
    assert tokens[1::2].tolist() == logits.argmax(-1)[1::2].tolist()
    all_greedy = [make_seq(temperature=0.0) for _ in range(6)]
    assert sample(logits, tensors(all_greedy)).tolist() == logits.argmax(-1).tolist()


def test_same_seed_and_step_gives_the_same_token() -> None:
    logits = random_logits(1)
    seqs = [make_seq(seed=123, temperature=1.5)]
    first = sample(logits, tensors(seqs))
    assert all(torch.equal(sample(logits, tensors(seqs)), first) for _ in range(5))


@pytest.mark.parametrize("params", [{}, {"top_k": 5}, {"top_p": 0.7}, {"temperature": 0.3}])
def test_token_is_independent_of_batch_composition(params: dict[str, object]) -> None:
    rng = random.Random(0)
    row = random_logits(1, seed=1)
    for seed in range(40):
        alone = sample(row, tensors([make_seq(2, seed=seed, **params)])).item()
        others = [
            make_seq(rng.randrange(9), seed=rng.randrange(1000), top_k=rng.choice([None, 3]))
            for _ in range(5)
        ]
        position = rng.randrange(6)
        seqs = [*others[:position], make_seq(2, seed=seed, **params), *others[position:]]
        logits = random_logits(6, seed=seed + 100)
        logits[position] = row[0]
        assert sample(logits, tensors(seqs))[position].item() == alone


def test_different_seeds_and_steps_give_different_samples() -> None:
    logits = torch.zeros(1, 1000)
    by_seed = {sample(logits, tensors([make_seq(seed=s)])).item() for s in range(100)}
    by_step = {sample(logits, tensors([make_seq(n, seed=7)])).item() for n in range(100)}
    assert len(by_seed) > 80 and len(by_step) > 80


def sample_many(logits_row: torch.Tensor, num_samples: int, **params: object) -> torch.Tensor:
    """Counts of tokens sampled from one row with seeds 0..num_samples-1 (deterministic)."""
    seqs = [make_seq(seed=seed, **params) for seed in range(num_samples)]
    tokens = sample(logits_row.expand(num_samples, -1).contiguous(), tensors(seqs))
    return torch.bincount(tokens, minlength=logits_row.shape[-1]).to(torch.float64)


def test_distribution_matches_softmax_over_seeds() -> None:
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, 2.0]])
    counts = sample_many(logits, 20_000, temperature=0.8)
    probs = torch.softmax(logits[0].double() / 0.8, dim=-1)
    # 5 degrees of freedom: P(chi2 > 25) is about 1e-4, and the seeds are fixed.
    assert chi_square(counts, probs) < 25


def test_distribution_matches_softmax_over_steps() -> None:
    logits = torch.tensor([[0.3, -0.2, 1.1, 0.0]])
    num_steps = 20_000
    row = tensors([make_seq(seed=99, temperature=1.3)], vocab_size=4)
    t = SamplingTensors(
        temperatures=row.temperatures.expand(num_steps),
        top_ks=row.top_ks.expand(num_steps),
        top_ps=row.top_ps.expand(num_steps),
        min_ps=row.min_ps.expand(num_steps),
        seeds=row.seeds.expand(num_steps),
        steps=torch.arange(num_steps),
        is_greedy=row.is_greedy.expand(num_steps),
        noise_keys=noise_keys(row.seeds.expand(num_steps), torch.arange(num_steps)),
        is_all_greedy=False,
        is_any_filtered=False,
    )
    tokens = sample(logits.expand(num_steps, -1).contiguous(), t)
    counts = torch.bincount(tokens, minlength=4).double()
    assert chi_square(counts, torch.softmax(logits[0].double() / 1.3, dim=-1)) < 22


def test_top_k_distribution_is_renormalized() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    counts = sample_many(logits, 20_000, top_k=3)
    assert counts[3:].sum() == 0
    probs = torch.softmax(logits[0, :3].double(), dim=-1)
    assert chi_square(counts[:3], probs) < 20


def test_top_p_distribution_is_renormalized() -> None:
    # probs ~ [0.47, 0.26, 0.17, 0.10]: top_p=0.7 keeps the first two.
    logits = torch.log(torch.tensor([[0.47, 0.26, 0.17, 0.10]]))
    counts = sample_many(logits, 20_000, top_p=0.7)
    assert counts[2:].sum() == 0
    probs = torch.tensor([0.47, 0.26], dtype=torch.float64) / 0.73
    assert chi_square(counts[:2], probs) < 15


def test_min_p_drops_tokens_below_the_fraction_of_the_best() -> None:
    # probs ~ [0.5, 0.3, 0.15, 0.05]: min_p=0.25 keeps p >= 0.125, the first three.
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    counts = sample_many(logits, 20_000, min_p=0.25)
    assert counts[3] == 0
    probs = torch.tensor([0.5, 0.3, 0.15], dtype=torch.float64) / 0.95
    assert chi_square(counts[:3], probs) < 15


def test_processed_logits_follow_vllm() -> None:
    """Random rows: divided by the temperature, filtered tokens at -inf; greedy rows: as is."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]]))
    seqs = [make_seq(temperature=0.5, top_k=3, min_p=0.2), make_seq(temperature=0.0, top_k=1)]
    _, processed = sample_and_process(logits, tensors(seqs, vocab_size=4), keep_processed=True)
    assert processed is not None
    scaled = logits[0] / 0.5  # p ~ [.68, .24, .06, .006]: min_p 0.2 keeps two, top-k three
    expected = torch.stack([scaled.masked_fill(torch.arange(4) >= 2, float("-inf")), logits[1]])
    torch.testing.assert_close(processed, expected)


@pytest.mark.parametrize(("top_k", "top_p"), [(1, 1.0), (4, 1.0), (None, 0.3), (8, 0.6)])
def test_filtered_tokens_are_never_picked(top_k: int | None, top_p: float) -> None:
    num_rows = 400
    logits = random_logits(num_rows, seed=3)
    seqs = [make_seq(seed=i, temperature=0.7, top_k=top_k, top_p=top_p) for i in range(num_rows)]
    tokens = sample(logits, tensors(seqs))
    sorted_logits, order = (logits / 0.7).sort(dim=-1, descending=True)
    k = top_k or VOCAB_SIZE
    for row in range(num_rows):
        probs = torch.softmax(sorted_logits[row, :k].double(), dim=-1)
        mass_before = torch.cumsum(probs, 0) - probs
        num_kept = int((mass_before < top_p).sum()) if top_p < 1 else k
        assert tokens[row].item() in order[row, :num_kept].tolist()


def test_exponential_noise_is_a_positive_pure_function() -> None:
    seeds = torch.tensor([0, -1, 2**62], dtype=torch.int64)
    steps = torch.tensor([0, 5, 2**40], dtype=torch.int64)
    keys = noise_keys(seeds, steps)
    noise = exponential_noise(keys, 20_000)
    assert noise.dtype == torch.float32 and noise.shape == (3, 20_000)
    assert bool(torch.isfinite(noise).all()) and bool((noise > 0).all())
    assert torch.equal(noise, exponential_noise(keys, 20_000))
    assert noise.double().mean(dim=-1).sub(1).abs().max() < 0.03
    assert not torch.equal(noise[0], noise[1])
    generator = torch.Generator().manual_seed(0)
    permuted = torch.stack([torch.randperm(20_000, generator=generator) for _ in range(3)])
    assert torch.equal(exponential_noise(keys, 20_000, permuted), noise.gather(1, permuted))


def test_exponential_noise_is_independent_of_the_other_rows() -> None:
    seeds = torch.tensor([3, 4, 5], dtype=torch.int64)
    steps = torch.tensor([7, 7, 9], dtype=torch.int64)
    keys = noise_keys(seeds, steps)
    batch = exponential_noise(keys, 1000)
    for row in range(3):
        alone_keys = noise_keys(seeds[row : row + 1], steps[row : row + 1])
        assert torch.equal(alone_keys[:, 0], keys[:, row])
        assert torch.equal(exponential_noise(alone_keys, 1000)[0], batch[row])
    assert len({tuple(k) for k in keys.T.tolist()}) == 3


def test_mix32_is_a_32_bit_bijection_on_a_sample() -> None:
    values = torch.cat([torch.arange(100_000), torch.tensor([2**31, 2**32 - 1])])
    mixed = _mix32(values)
    assert int(mixed.min()) >= 0 and int(mixed.max()) < 2**32
    assert mixed.unique().numel() == values.numel()
    assert _mix32(torch.tensor([0, 1])).tolist() == [_reference_mix32(0), _reference_mix32(1)]
    assert _mix32(torch.tensor([2**32 - 1])).item() == _reference_mix32(2**32 - 1)


def _reference_mix32(x: int) -> int:
    """The same mixer with Python's unbounded ints."""
    x ^= x >> 16
    x = (x * 0x21F0AAAD) % 2**32
    x ^= x >> 15
    x = (x * 0x735A2D97) % 2**32
    return x ^ (x >> 15)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sampling_never_syncs_and_matches_cpu() -> None:
    seqs = [make_seq(i, seed=i, top_k=[None, 5][i % 2], top_p=0.9) for i in range(8)]
    seqs.append(make_seq(temperature=0.0))
    logits = random_logits(len(seqs))
    expected = sample(logits, tensors(seqs))
    device_logits = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        t = SamplingTensors.from_sequences(seqs, VOCAB_SIZE, "cuda")
        tokens = sample(device_logits, t)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(tokens.cpu(), expected)
