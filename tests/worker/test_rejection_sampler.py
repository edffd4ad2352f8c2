"""Speculative decoding's sampling: greedy exactness, the target distribution preserved (with
deliberately wrong samplers failing the same check), reproducibility and batch independence.

The "models" are bigram tables: the logits of the next token are a row of a [V, V] table chosen
by the previous token, so target logits at every draft position depend on the drafted path.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import pytest
import torch

from dormant.core.sampling_params import SamplingParams
from dormant.core.step_input import SeqInput
from dormant.worker import rejection_sampler
from dormant.worker.rejection_sampler import draft_sample, per_position_sampling, verify
from dormant.worker.sampler import (
    SamplingTensors,
    noise_keys,
    processed_logits,
    sample,
    sample_and_process,
)

VOCAB_SIZE = 8
NUM_DRAFTS = 2
FIRST_TOKEN = 3
Verify = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def tensors(
    params: list[SamplingParams],
    seeds: list[int],
    steps: int = 0,
    vocab_size: int = VOCAB_SIZE,
    device: str = "cpu",
) -> SamplingTensors:
    seqs = [
        SeqInput((1,), 0, (), p, seed=s, num_output_tokens=steps)
        for p, s in zip(params, seeds, strict=True)
    ]
    return SamplingTensors.from_sequences(seqs, vocab_size, device)


def with_steps(t: SamplingTensors, steps: torch.Tensor) -> SamplingTensors:
    return dataclasses.replace(t, steps=steps, noise_keys=noise_keys(t.seeds, steps))


def bigram(seed: int, scale: float = 1.5) -> torch.Tensor:
    return (
        torch.randn(VOCAB_SIZE, VOCAB_SIZE, generator=torch.Generator().manual_seed(seed)) * scale
    )


TARGET, DRAFT = bigram(0), bigram(1)


def speculative_decode(
    t: SamplingTensors,
    num_tokens: int,
    target: torch.Tensor = TARGET,
    draft: torch.Tensor = DRAFT,
    num_drafts: int = NUM_DRAFTS,
    verify_fn: Verify = verify,
) -> torch.Tensor:
    """``num_tokens`` outputs per row after ``FIRST_TOKEN``, by speculative steps of
    ``num_drafts`` drafts each (int64 [n, num_tokens])."""
    num_seqs = t.seeds.shape[0]
    width = num_tokens + num_drafts + 1
    out = torch.full((num_seqs, width), -1)
    count = torch.zeros(num_seqs, dtype=torch.int64)
    newest = torch.full((num_seqs,), FIRST_TOKEN)
    positions = torch.arange(num_drafts + 1)[None, :]
    while int(count.min()) < num_tokens:
        previous, tokens, probs = newest, [], []
        for offset in range(num_drafts):
            token, prob = draft_sample(draft[previous], t, offset)
            tokens.append(token)
            probs.append(prob)
            previous = token
        drafts = torch.stack(tokens, dim=1)
        draft_probs = None if probs[0] is None else torch.stack(probs, dim=1)
        target_logits = target[torch.cat([newest[:, None], drafts], dim=1)]
        emitted, num_emitted = verify_fn(target_logits, drafts, draft_probs, t)
        columns = count[:, None] + positions
        is_new = (positions < num_emitted[:, None]) & (columns < width)
        out[is_new.nonzero(as_tuple=True)[0], columns[is_new]] = emitted[is_new]
        newest = emitted.gather(1, (num_emitted - 1)[:, None]).squeeze(1)
        count += num_emitted
        t = with_steps(t, t.steps + num_emitted)
    return out[:, :num_tokens]


def greedy_decode(target: torch.Tensor, num_tokens: int) -> list[int]:
    tokens, newest = [], FIRST_TOKEN
    for _ in range(num_tokens):
        newest = int(target[newest].argmax())
        tokens.append(newest)
    return tokens


# --- the sampler's processing, reused --------------------------------------------------------


def test_processed_logits_is_what_the_sampler_keeps() -> None:
    params = [
        SamplingParams(temperature=0.7, top_k=5, top_p=0.8, min_p=0.05),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3),
    ]
    t = tensors(params, [1, 2, 3])
    logits = bigram(5)[:3]
    expected = sample_and_process(logits, t, keep_processed=True)[1]
    assert expected is not None and torch.equal(processed_logits(logits, t), expected)


# --- greedy -----------------------------------------------------------------------------------


def greedy_tensors(num_rows: int) -> SamplingTensors:
    return tensors([SamplingParams(temperature=0.0)] * num_rows, list(range(num_rows)))


def test_greedy_accepts_the_target_argmax_prefix() -> None:
    logits = torch.randn(4, 4, VOCAB_SIZE, generator=torch.Generator().manual_seed(3))
    argmax = logits.argmax(dim=-1)  # [4, 4]: k = 3
    wrong = (argmax + 1) % VOCAB_SIZE
    drafts = torch.stack(
        [
            argmax[0, :3],  # all accepted: the bonus follows
            torch.stack([wrong[1, 0], argmax[1, 1], argmax[1, 2]]),  # first rejected
            torch.stack([argmax[2, 0], wrong[2, 1], argmax[2, 2]]),  # one accepted
            torch.stack([argmax[3, 0], argmax[3, 1], wrong[3, 2]]),  # last rejected
        ]
    )
    emitted, num_emitted = verify(logits, drafts, None, greedy_tensors(4))
    assert num_emitted.tolist() == [4, 1, 2, 3]
    assert emitted.tolist() == [
        argmax[0].tolist(),
        [argmax[1, 0].item(), -1, -1, -1],
        [argmax[2, 0].item(), argmax[2, 1].item(), -1, -1],
        [*argmax[3, :3].tolist(), -1],
    ]
    assert emitted.dtype == torch.int64 and num_emitted.dtype == torch.int64


@pytest.mark.parametrize("num_drafts", [1, 3, 5])
def test_greedy_speculation_is_greedy_decoding(num_drafts: int) -> None:
    """Exact for any draft: one that mostly agrees (many acceptances), one that never does."""
    agreeing = TARGET + 0.8 * bigram(9)
    assert not torch.equal(agreeing.argmax(-1), TARGET.argmax(-1))  # some drafts rejected
    for draft in (agreeing, DRAFT, TARGET):
        tokens = speculative_decode(greedy_tensors(2), 12, draft=draft, num_drafts=num_drafts)
        assert tokens.tolist() == [greedy_decode(TARGET, 12)] * 2


def test_greedy_rows_are_exact_beside_random_rows() -> None:
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.9)] * 4
    tokens = speculative_decode(tensors(params, list(range(8))), 10, draft=TARGET + bigram(9))
    for row in range(0, 8, 2):
        assert tokens[row].tolist() == greedy_decode(TARGET, 10)


def test_all_greedy_draft_sample_returns_no_probs() -> None:
    logits = bigram(4)[:3]
    tokens, probs = draft_sample(logits, greedy_tensors(3), 2)
    assert probs is None and torch.equal(tokens, logits.argmax(-1))


# --- draft sampling ---------------------------------------------------------------------------


def test_draft_sample_draws_from_the_probs_it_returns() -> None:
    num_rows = 20_000
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.95)
    t = tensors([params] * num_rows, list(range(num_rows)), steps=4)
    logits = DRAFT[FIRST_TOKEN].expand(num_rows, -1)
    tokens, probs = draft_sample(logits, t, 1)
    assert probs is not None and probs.dtype == torch.float32
    expected = processed_logits(logits[:1], t).softmax(-1)[0]
    assert torch.allclose(probs, expected.expand_as(probs))
    counts = torch.bincount(tokens, minlength=VOCAB_SIZE).double()
    assert (counts[expected == 0] == 0).all() and (expected == 0).sum() >= 2  # filtered
    assert chi_square(counts, expected.double()) < critical_value(int((expected > 0).sum()) - 1)
    # Its own draws: not the sampler's at the same (seed, step), nor another offset's.
    same_as_sampler = (tokens == sample(logits, with_steps(t, t.steps + 1))).double().mean()
    assert same_as_sampler < 0.6
    assert (tokens != draft_sample(logits, t, 2)[0]).any()


def test_draft_sample_greedy_rows_take_the_argmax_with_one_hot_probs() -> None:
    t = tensors([SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)], [0, 1])
    logits = bigram(6)[:2]
    tokens, probs = draft_sample(logits, t, 0)
    assert probs is not None and tokens[0] == logits[0].argmax()
    assert probs[0].tolist() == torch.nn.functional.one_hot(tokens[0], VOCAB_SIZE).tolist()
    assert torch.allclose(probs[1], logits[1].softmax(-1))


# --- the target distribution ------------------------------------------------------------------


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    kept = probs > 0
    expected = probs[kept] * counts.sum()
    return float(((counts[kept] - expected) ** 2 / expected).sum())


def critical_value(dof: int, z: float = 4.75) -> float:
    """The chi-square value exceeded with probability ~1e-6 (Wilson-Hilferty)."""
    scale = 2.0 / (9.0 * dof)
    return dof * (1.0 - scale + z * math.sqrt(scale)) ** 3


def joint_counts(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens[:, 0] * VOCAB_SIZE + tokens[:, 1], minlength=VOCAB_SIZE**2)


def target_joint(params: SamplingParams) -> torch.Tensor:
    """P(first output, second output) under the target with ``params``, flattened [V * V]."""
    t = tensors([params] * VOCAB_SIZE, [0] * VOCAB_SIZE)
    next_probs = processed_logits(TARGET, t).softmax(-1).double()
    return (next_probs[FIRST_TOKEN][:, None] * next_probs).reshape(-1)


def always_accept(
    target_logits: torch.Tensor, drafts: torch.Tensor, *_: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """Wrong on purpose: emits every draft, whatever the target says (the draft's distribution)."""
    num_seqs, num_drafts = drafts.shape
    bonus = target_logits[:, -1].argmax(-1, keepdim=True)
    return torch.cat([drafts, bonus], 1), torch.full((num_seqs,), num_drafts + 1)


DISTRIBUTION_PARAMS = [
    SamplingParams(temperature=0.9, top_k=6),
    SamplingParams(temperature=1.2, top_p=0.85, min_p=0.02),
]


@pytest.mark.parametrize("params", DISTRIBUTION_PARAMS, ids=["top_k", "top_p_min_p"])
def test_emitted_tokens_follow_the_target(
    params: SamplingParams, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first two outputs (one step or two, depending on the acceptances) are distributed as
    the target's over 30k seeds; the draft's distribution, or a resample of ``p`` instead of
    the residual at a rejection, fails the same check."""
    num_rows = 20_000
    t = tensors([params] * num_rows, list(range(num_rows)))
    expected = target_joint(params)
    threshold = critical_value(int((expected > 0).sum()) - 1)

    counts = joint_counts(speculative_decode(t, 2))
    assert (counts[expected == 0] == 0).all() and (expected == 0).any()  # filtered: never
    assert chi_square(counts, expected) < threshold

    wrong = joint_counts(speculative_decode(t, 2, verify_fn=always_accept))
    assert chi_square(wrong, expected) > 10 * threshold

    monkeypatch.setattr(rejection_sampler, "_recovery_weights", lambda p, q: p)
    wrong = joint_counts(speculative_decode(t, 2))
    assert chi_square(wrong, expected) > 2 * threshold


def test_self_speculation_accepts_every_draft() -> None:
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.6, top_k=3)] * 200
    t = tensors(params, list(range(400)))
    newest = torch.full((400,), FIRST_TOKEN)
    d1, q1 = draft_sample(TARGET[newest], t, 0)
    d2, q2 = draft_sample(TARGET[d1], t, 1)
    assert q1 is not None and q2 is not None
    drafts = torch.stack([d1, d2], 1)
    target_logits = TARGET[torch.stack([newest, d1, d2], 1)]
    emitted, num_emitted = verify(target_logits, drafts, torch.stack([q1, q2], 1), t)
    assert (num_emitted == 3).all() and torch.equal(emitted[:, :2], drafts)


# --- reproducibility and batch independence ---------------------------------------------------

MIXED_PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, top_p=0.8),
    SamplingParams(temperature=1.5, min_p=0.1, top_k=4),
]


def test_same_seed_same_tokens_other_seed_other_tokens() -> None:
    params = MIXED_PARAMS * 16
    first = speculative_decode(tensors(params, list(range(64))), 6)
    assert torch.equal(first, speculative_decode(tensors(params, list(range(64))), 6))
    other = speculative_decode(tensors(params, list(range(100, 164))), 6)
    random_rows = [r for r in range(64) if r % 4 != 1]
    assert not torch.equal(first[random_rows], other[random_rows])
    assert torch.equal(first[1::4], other[1::4])  # greedy rows ignore the seed


def test_a_row_is_the_same_in_any_batch() -> None:
    params = MIXED_PARAMS * 4
    seeds = [7 * r + 1 for r in range(16)]
    batch = speculative_decode(tensors(params, seeds), 6)
    order = list(reversed(range(16)))
    reordered = speculative_decode(
        tensors([params[r] for r in order], [seeds[r] for r in order]), 6
    )
    assert torch.equal(reordered, batch[order])
    for row in (0, 5, 14):
        alone = speculative_decode(tensors([params[row]], [seeds[row]]), 6)
        assert torch.equal(alone[0], batch[row])


def test_verify_at_later_steps_uses_those_steps_draws() -> None:
    """The draws are keyed by output position: the same logits at another step differ."""
    params = [SamplingParams(temperature=1.0)] * 256
    t = tensors(params, list(range(256)))
    logits = TARGET[torch.full((256, NUM_DRAFTS + 1), FIRST_TOKEN)]
    drafts, probs = draft_sample(DRAFT[torch.full((256,), FIRST_TOKEN)], t, 0)
    drafts, probs = (
        drafts[:, None].expand(-1, NUM_DRAFTS),
        probs[:, None].expand(-1, NUM_DRAFTS, -1),
    )
    at_zero = verify(logits, drafts.contiguous(), probs.contiguous(), t)
    at_five = verify(logits, drafts.contiguous(), probs.contiguous(), with_steps(t, t.steps + 5))
    assert not torch.equal(at_zero[0], at_five[0])


# --- refusals ---------------------------------------------------------------------------------


def test_bad_arguments_are_refused_with_what_was_expected() -> None:
    t = tensors([SamplingParams(temperature=1.0)] * 2, [0, 1])
    logits = torch.zeros(2, 3, VOCAB_SIZE)
    drafts = torch.zeros(2, 2, dtype=torch.int64)
    probs = torch.full((2, 2, VOCAB_SIZE), 1 / VOCAB_SIZE)
    with pytest.raises(TypeError, match="needs draft_probs"):
        verify(logits, drafts, None, t)
    with pytest.raises(TypeError, match=r"draft tokens \[2, 2\]"):
        verify(logits, drafts[:, :1], probs, t)
    with pytest.raises(TypeError, match="float32 draft probs"):
        verify(logits, drafts, probs.double(), t)
    with pytest.raises(TypeError, match="3 sampling rows"):
        verify(logits, drafts, probs, tensors([SamplingParams()] * 3, [0, 1, 2]))
    with pytest.raises(TypeError, match=r"float target logits \[n, k \+ 1, V\]"):
        verify(logits[:, 0], drafts, probs, t)
    with pytest.raises(TypeError, match=r"float logits \[n, V\]"):
        draft_sample(logits, t, 0)


# --- on the GPU ---------------------------------------------------------------------------------


def one_step(
    t: SamplingTensors, target: torch.Tensor, draft: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One speculative step of ``NUM_DRAFTS`` drafts after ``FIRST_TOKEN`` (no host reads)."""
    num_seqs = t.seeds.shape[0]
    newest = torch.full((num_seqs,), FIRST_TOKEN, device=target.device)
    previous, tokens, probs = newest, [], []
    for offset in range(NUM_DRAFTS):
        token, prob = draft_sample(draft[previous], t, offset)
        assert prob is not None
        tokens.append(token)
        probs.append(prob)
        previous = token
    drafts = torch.stack(tokens, dim=1)
    target_logits = target[torch.cat([newest[:, None], drafts], dim=1)]
    return verify(target_logits, drafts, torch.stack(probs, dim=1), t)


@pytest.mark.gpu
def test_on_cuda_no_host_sync_and_the_cpu_result() -> None:
    """Drafting and verification never synchronize with the host (CUDA's sync debug mode
    raises on any synchronizing call), and give the CPU's tokens (the draws are integer
    hashes; float rounding may flip a rare near-tie, hence the 99 %)."""
    params, seeds = MIXED_PARAMS * 256, list(range(1024))
    on_gpu = tensors(params, seeds, steps=3, device="cuda")
    target, draft = TARGET.cuda(), DRAFT.cuda()
    one_step(on_gpu, target, draft)  # warm-up: lazy CUDA initialisation may synchronize
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu_tokens, gpu_counts = one_step(on_gpu, target, draft)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cpu_tokens, cpu_counts = one_step(tensors(params, seeds, steps=3), TARGET, DRAFT)
    same = (gpu_tokens.cpu() == cpu_tokens).all(dim=1) & (gpu_counts.cpu() == cpu_counts)
    assert same[1::4].all()  # greedy rows: exact
    assert same.double().mean() >= 0.99


def test_per_position_sampling_is_each_row_at_each_later_step() -> None:
    params, seeds = MIXED_PARAMS, [3, 4, 5, 6]
    flat = per_position_sampling(tensors(params, seeds, steps=2), 3)
    for offset in range(3):
        expected = tensors(params, seeds, steps=2 + offset)
        for field in dataclasses.fields(SamplingTensors):
            value = getattr(flat, field.name)
            if isinstance(value, torch.Tensor):
                rows = value[..., offset::3]
                assert torch.equal(rows, getattr(expected, field.name)), field.name
            else:
                assert value == getattr(expected, field.name)
