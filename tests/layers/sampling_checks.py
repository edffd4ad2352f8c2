"""Checks of the fused sampler draw (``dormant.layers.triton_sampling``) against the torch
reference (``sampler.sample_reference``), shared by the Triton-interpreter test on the CPU and
the GPU test: the tokens must be identical, row for row."""

from __future__ import annotations

from typing import Any

import torch

from dormant.worker import sampler
from dormant.worker.sampler import SamplingTensors, noise_keys, sample_reference

# (rows, vocabulary): one segment, a partial last segment, and the rollout's Qwen3 vocabulary
SHAPES = ((5, 300), (24, 20000))
GPU_SHAPES = ((64, 151936), (512, 151936))
TEMPERATURES = (0.3, 0.7, 1.0, 1.5)


def batch(
    num_rows: int, vocab: int, device: str, seed: int
) -> tuple[torch.Tensor, SamplingTensors]:
    """Logits and unfiltered sampling tensors: every fourth row greedy, the others at the
    temperatures above; some rows with masked (-inf) columns, and greedy rows whose maximum
    is tied across segments (the first must win)."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn((num_rows, vocab), generator=generator) * 4.0
    is_greedy = torch.arange(num_rows) % 4 == 0
    for row in range(0, num_rows, 3):
        logits[row, row % 7 :: 5] = float("-inf")
    for row in range(0, num_rows, 8):  # greedy rows: ties of the maximum, near and far
        logits[row, list(tied_columns(vocab))] = logits[row].max() + 1.0
    temperatures = torch.tensor(
        [1.0 if g else TEMPERATURES[r % len(TEMPERATURES)] for r, g in enumerate(is_greedy)]
    )
    seeds = torch.randint(-(2**62), 2**62, (num_rows,), generator=generator)
    steps = torch.randint(0, 4096, (num_rows,), generator=generator)
    tensors = SamplingTensors(
        temperatures=temperatures.to(device),
        top_ks=torch.full((num_rows,), vocab, dtype=torch.int32, device=device),
        top_ps=torch.ones(num_rows, device=device),
        min_ps=torch.zeros(num_rows, device=device),
        seeds=seeds.to(device),
        steps=steps.to(device),
        is_greedy=is_greedy.to(device),
        noise_keys=noise_keys(seeds, steps).to(device),
        is_all_greedy=False,
        is_any_filtered=False,
    )
    return logits.to(device), tensors


def tied_columns(vocab: int) -> tuple[int, ...]:
    """Where the tied maxima go: two in one block, one in another block of the first segment,
    one in the last segment (those that fit the vocabulary); the first must win."""
    return tuple(c for c in (100, 200, 5000, vocab - 1) if c < vocab)


def reference_winners(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """The values the reference takes its argmax of, at their maximum: the largest logit of a
    greedy row, the largest ``p / E`` of a random one (float32 [n])."""
    scaled = logits / t.temperatures[:, None]
    probs = scaled.sub(scaled.amax(dim=-1, keepdim=True)).exp_()
    draws = probs.div_(sampler.exponential_noise(t.noise_keys, logits.shape[-1]))
    return torch.where(t.is_greedy, logits.amax(dim=-1), draws.amax(dim=-1))


def check_race_matches_the_reference(shape: tuple[int, int], device: str) -> None:
    """Tokens equal the reference's, and so do the winning values (a token alone hides small
    arithmetic differences: the argmax rarely moves): bit for bit on CUDA, where both call
    CUDA's expf and logf; within 4 units in the last place in Triton's interpreter, whose exp
    and log are numpy's and differ from torch's CPU ones by an ulp at times."""
    from dormant.layers.triton_sampling import fused_race, race_winners

    for seed in range(3):
        logits, t = batch(*shape, device, seed)
        expected = sample_reference(logits, t, keep_processed=False)[0]
        tokens = fused_race(logits, t.temperatures, t.noise_keys, t.is_greedy)
        assert tokens.dtype == torch.int64 and tokens.shape == (shape[0],)
        different = (tokens != expected).nonzero().flatten().tolist()
        assert not different, f"{shape} seed {seed}: rows {different} differ"
        first_tie = tied_columns(shape[1])[0]
        assert all(tokens[row].item() == first_tie for row in range(0, shape[0], 8))
        values, _ = race_winners(logits, t.temperatures, t.noise_keys, t.is_greedy)
        reference = reference_winners(logits, t)
        if device == "cpu":
            torch.testing.assert_close(values, reference, rtol=4 * 2.0**-23, atol=0.0)
        else:
            different = (values.view(torch.int32) != reference.view(torch.int32)).nonzero()
            assert not different.numel(), f"{shape} seed {seed}: rows {different} differ"


def check_the_constants_are_the_samplers() -> None:
    from dormant.layers import triton_sampling as fused

    assert (fused._MIX_1.value, fused._MIX_2.value) == sampler._MIX_MULTIPLIERS
    assert fused._UNIFORM_BITS.value == sampler._NUM_UNIFORM_BITS
    assert fused._UNIFORM_SCALE.value == 2.0**-sampler._NUM_UNIFORM_BITS


def hopper_ptx() -> str:
    """The draw kernel compiled for sm_90 (H100/H200), as PTX; needs Triton, not a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dormant.layers import triton_sampling as fused

    pointers = dict(
        logits_ptr="*fp32", row_max_ptr="*fp32", temperatures_ptr="*fp32", greedy_ptr="*u8",
        keys_ptr="*i64", best_ptr="*fp32", column_ptr="*i64",
    )  # fmt: skip
    scalars = dict.fromkeys(("vocab", "stride_row", "stride_keys", "num_segments"), "i32")
    constants = {"SEGMENT": fused._SEGMENT, "BLOCK": fused._BLOCK, "LIBDEVICE": True}
    signature = {**pointers, **scalars, **dict.fromkeys(constants, "constexpr")}
    source = ASTSource(fn=fused._race_kernel, signature=signature, constexprs=constants)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]


def launch_specialisations(num_rows: int, vocab: int) -> tuple[object, ...]:
    """What Triton keys the draw kernel's compiled binary on (each argument's type and its
    value or alignment specialisation), for the arguments ``fused_race`` passes it on the eager
    path: the sampling rows of ``SamplingTensors.from_sequences`` for ``num_rows`` random
    sequences. Needs Triton, not a GPU."""
    from triton.backends import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    from dormant.core.sampling_params import SamplingParams
    from dormant.engine.sequence import Sequence
    from dormant.layers import triton_sampling as fused

    seqs = [Sequence(i, [1], SamplingParams(temperature=1.0), seed=i) for i in range(num_rows)]
    t = SamplingTensors.from_sequences(seqs, vocab, "cpu")
    logits = torch.zeros((num_rows, vocab))
    num_segments = -(-vocab // fused._SEGMENT)
    best = torch.empty((num_rows, num_segments))
    columns = torch.empty((num_rows, num_segments), dtype=torch.int64)
    arguments = (
        logits, logits.amax(dim=-1), t.temperatures, t.is_greedy.view(torch.uint8), t.noise_keys,
        best, columns, vocab, logits.stride(0), t.noise_keys.stride(0), num_segments,
    )  # fmt: skip

    def specialisation(param: Any, argument: object) -> object:
        specialise, align = not param.do_not_specialize, not param.do_not_specialize_on_alignment
        return native_specialize_impl(BaseBackend, argument, False, specialise, align)

    params = fused._race_kernel.params
    return tuple(specialisation(p, a) for p, a in zip(params, arguments, strict=False))
