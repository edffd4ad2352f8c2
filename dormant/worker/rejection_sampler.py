"""Speculative decoding's two sampling halves: drawing draft tokens, and verifying them against
the target model (Leviathan et al. 2023, Chen et al. 2023).

One step of a row proposes ``k`` draft tokens ``d_1 .. d_k`` after its newest token and runs the
target on ``[newest, d_1 .. d_k]``. Output positions (``steps`` is ``SamplingTensors.steps``):

| what                         | output position | its draws' salts      |
|------------------------------|-----------------|-----------------------|
| draft token ``d_{i+1}``      | steps + i       | ``_DRAFT_SALTS``      |
| acceptance uniform of d_{i+1}| steps + i       | ``_ACCEPT_SALTS``     |
| recovery / bonus token at i  | steps + i       | ``_RECOVERY_SALTS``   |

Every draw is a pure function of ``(seed, output position, vocabulary id)`` through the
sampler's counter hash, each family with its own salts (none equals the sampler's), so a row's
result depends on its own logits and seed only: reproducible, and the same in any batch. A
position's draws decide at most one emitted token: a later step that starts at a position this
step computed but did not emit uses draws that decided nothing yet.

Greedy rows accept ``d_i`` while it is the target's argmax and emit the target's argmax after;
they are exactly non-speculative greedy decoding. Random rows accept ``d_i`` with probability
``min(1, p(d_i) / q(d_i))`` (``p`` the target's processed distribution, as the sampler's for the
row, ``q`` the draft's), emit a draw of ``normalize(max(0, p - q))`` at the first rejection, or
of ``p`` after ``k`` acceptances: each emitted token is distributed as the target's.

Logits processors (penalties, bad words, ``min_tokens`` masks) are the caller's: both functions
take logits as they are to be sampled from. Neither synchronizes with the host, and neither
loops over rows (only over the ``k`` positions, in the caller). ``per_position_sampling`` gives
the sampling rows of every verified position (for the target's processed logprobs, say).
"""

from __future__ import annotations

import dataclasses

import torch

from dormant.worker.sampler import (
    SamplingTensors,
    exponential_noise,
    noise_keys,
    processed_logits,
    uniform_noise,
)

# Salts of the three draw families (see the module's table); distinct from the sampler's.
_DRAFT_SALTS = (0x1B873593, 0x5BD1E995)
_ACCEPT_SALTS = (0x68E31DA4, 0xB5297A4D)
_RECOVERY_SALTS = (0x1B56C4E9, 0x3C6EF372)


def draft_sample(
    draft_logits: torch.Tensor, sampling: SamplingTensors, step_offset: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The draft's ``step_offset``-th proposal of each row (0 = output position ``steps``).

    ``draft_logits``: float [n, V]. Returns the tokens (int64 [n]) and the probabilities they
    were drawn from (float32 [n, V], the draft's logits processed as the sampler processes the
    row's: temperature, min-p, top-k, top-p), or ``None`` when every row is greedy. Greedy rows
    take the argmax, and their row of probabilities is one-hot on it (``verify`` ignores it).
    """
    if draft_logits.dim() != 2 or not draft_logits.is_floating_point():
        raise TypeError(f"draft_sample needs float logits [n, V], got {_describe(draft_logits)}")
    logits = draft_logits.float()
    greedy_tokens = logits.argmax(dim=-1)
    if sampling.is_all_greedy:
        return greedy_tokens, None
    probs = processed_logits(logits, sampling).softmax(dim=-1)
    keys = noise_keys(sampling.seeds, sampling.steps + step_offset, _DRAFT_SALTS)
    random_tokens = (probs / exponential_noise(keys, probs.shape[-1])).argmax(dim=-1)
    one_hot = torch.zeros_like(probs).scatter_(-1, greedy_tokens[:, None], 1.0)
    greedy = sampling.is_greedy
    return (
        torch.where(greedy, greedy_tokens, random_tokens),
        torch.where(greedy[:, None], one_hot, probs),
    )


def verify(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    sampling: SamplingTensors,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept a prefix of each row's drafts and emit one more token after it.

    ``target_logits``: float [n, k + 1, V], the target's logits at ``[newest, d_1 .. d_k]``;
    ``draft_tokens``: int64 [n, k]; ``draft_probs``: float32 [n, k, V] from ``draft_sample``
    (``None`` only when every row is greedy). Returns the emitted tokens (int64 [n, k + 1]:
    the accepted drafts, then the recovery or bonus token, then ``-1``) and their number per
    row (int64 [n], in ``1 .. k + 1``; the accepted drafts are one fewer).
    """
    num_seqs, num_drafts = _check_shapes(target_logits, draft_tokens, draft_probs, sampling)
    logits = target_logits.float()
    target_argmax = logits.argmax(dim=-1)  # [n, k + 1]
    accepted = draft_tokens == target_argmax[:, :num_drafts]
    recovered = target_argmax
    if not sampling.is_all_greedy:
        assert draft_probs is not None  # _check_shapes refused None for random rows
        random_accepted, random_recovered = _verify_random(
            logits, draft_tokens, draft_probs, sampling
        )
        greedy = sampling.is_greedy[:, None]
        accepted = torch.where(greedy, accepted, random_accepted)
        recovered = torch.where(greedy, recovered, random_recovered)
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)
    positions = torch.arange(num_drafts + 1, device=logits.device)[None, :]
    padded_drafts = torch.cat([draft_tokens, draft_tokens.new_full((num_seqs, 1), -1)], dim=-1)
    emitted = torch.where(positions < num_accepted[:, None], padded_drafts, -1)
    emitted = torch.where(positions == num_accepted[:, None], recovered, emitted)
    return emitted, num_accepted + 1


def per_position_sampling(sampling: SamplingTensors, num_positions: int) -> SamplingTensors:
    """``sampling`` with each row repeated for its ``num_positions`` positions (row-major: row
    ``r``'s position ``i`` is row ``r * num_positions + i``), at output step ``steps + i`` with
    the sampler's own noise keys for that step. With it, ``processed_logits`` and the sampler
    apply to target logits ``[n, k + 1, V]`` reshaped to ``[n * (k + 1), V]`` (the processed
    logprobs of every position, for instance)."""
    offsets = torch.arange(num_positions, device=sampling.steps.device)
    steps = (sampling.steps[:, None] + offsets[None, :]).reshape(-1)

    def repeat(values: torch.Tensor) -> torch.Tensor:
        return values[:, None].expand(-1, num_positions).reshape(-1)

    seeds = repeat(sampling.seeds)
    return dataclasses.replace(
        sampling,
        temperatures=repeat(sampling.temperatures),
        top_ks=repeat(sampling.top_ks),
        top_ps=repeat(sampling.top_ps),
        min_ps=repeat(sampling.min_ps),
        seeds=seeds,
        steps=steps,
        is_greedy=repeat(sampling.is_greedy),
        noise_keys=noise_keys(seeds, steps),
    )


def _verify_random(
    logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    sampling: SamplingTensors,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random rows' acceptance (bool [n, k]) and recovery tokens (int64 [n, k + 1]: a draw of
    the residual at each draft position, of ``p`` at the bonus position), for every row."""
    num_seqs, num_positions, vocab_size = logits.shape
    num_drafts = num_positions - 1
    flat = per_position_sampling(sampling, num_positions)
    target_probs = processed_logits(logits.reshape(-1, vocab_size), flat).softmax(dim=-1)
    target_probs = target_probs.reshape(num_seqs, num_positions, vocab_size)
    p = target_probs[:, :num_drafts].gather(-1, draft_tokens[..., None]).squeeze(-1)
    q = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
    accept_keys = noise_keys(flat.seeds, flat.steps, _ACCEPT_SALTS)
    uniform = uniform_noise(accept_keys, 1).reshape(num_seqs, num_positions)[:, :num_drafts]
    # u < p / q without dividing; ``<=`` accepts every draft when p == q (self-speculation),
    # and p > 0 keeps tokens the target filters out from ever being accepted.
    accepted = (uniform * q <= p) & (p > 0)
    no_draft = draft_probs.new_zeros((num_seqs, 1, vocab_size))
    weights = _recovery_weights(target_probs, torch.cat([draft_probs, no_draft], dim=1))
    recovery_keys = noise_keys(flat.seeds, flat.steps, _RECOVERY_SALTS)
    noise = exponential_noise(recovery_keys, vocab_size).reshape(weights.shape)
    return accepted, weights.div_(noise).argmax(dim=-1)


def _recovery_weights(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """Unnormalized weights of the token emitted at each position when it is reached without
    an accepted draft: ``max(0, p - q)``, which is ``p`` where ``q`` is zero (the bonus
    position). A residual that rounds to zero everywhere (``p == q``, where rejection has
    probability zero) falls back to ``p``."""
    residual = (target_probs - draft_probs).clamp_(min=0.0)
    is_empty = residual.sum(dim=-1, keepdim=True) <= 0.0
    return torch.where(is_empty, target_probs, residual)


def _check_shapes(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    sampling: SamplingTensors,
) -> tuple[int, int]:
    """``(n, k)`` of consistent arguments; a ``TypeError`` that names the mismatch otherwise."""
    if target_logits.dim() != 3 or not target_logits.is_floating_point():
        raise TypeError(
            f"verify needs float target logits [n, k + 1, V], got {_describe(target_logits)}"
        )
    num_seqs, num_positions, vocab_size = target_logits.shape
    num_drafts = num_positions - 1
    if draft_tokens.shape != (num_seqs, num_drafts) or draft_tokens.dtype != torch.int64:
        raise TypeError(
            f"verify needs int64 draft tokens [{num_seqs}, {num_drafts}] for target logits "
            f"{tuple(target_logits.shape)}, got {_describe(draft_tokens)}"
        )
    if sampling.seeds.shape[0] != num_seqs:
        raise TypeError(f"verify got {sampling.seeds.shape[0]} sampling rows for {num_seqs} rows")
    if draft_probs is None:
        if not sampling.is_all_greedy:
            raise TypeError("verify needs draft_probs when any row is random (not greedy)")
    elif (
        draft_probs.shape != (num_seqs, num_drafts, vocab_size)
        or draft_probs.dtype != torch.float32
    ):
        raise TypeError(
            f"verify needs float32 draft probs [{num_seqs}, {num_drafts}, {vocab_size}], "
            f"got {_describe(draft_probs)}"
        )
    return num_seqs, num_drafts


def _describe(tensor: torch.Tensor) -> str:
    return f"{tensor.dtype} {tuple(tensor.shape)}"
