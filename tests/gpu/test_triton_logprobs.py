"""The fused Triton logprobs against the torch reference (``log_softmax``, then gather, rank and
top-k), on rows shaped like a real vocabulary and on rows the sampler filtered to ``-inf``."""

from __future__ import annotations

import pytest
import torch

from dormant.layers.kernels import IS_TRITON_ENABLED
from dormant.worker.logprobs import gather_logprobs, packed_logprobs, unpack_logprobs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not IS_TRITON_ENABLED, reason="needs Triton, with DORMANT_TRITON unset"),
]


def rows(num_rows: int, vocab: int, filtered: bool, seed: int) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    logits = 4 * torch.randn(num_rows, vocab, device="cuda", generator=generator)
    if filtered:  # what top-k / top-p leave: most of the row at -inf, whole segments included
        keep = torch.rand(num_rows, vocab, device="cuda", generator=generator) < 0.001
        keep[:, 0] = True
        logits = logits.masked_fill(~keep, float("-inf"))
    return logits


@pytest.mark.parametrize(("num_rows", "vocab"), [(64, 151936), (3, 1000), (1, 8192), (5, 8193)])
@pytest.mark.parametrize("filtered", [False, True])
@pytest.mark.parametrize("num_top", [0, 5, 20])
def test_fused_logprobs_match_the_reference(
    num_rows: int, vocab: int, filtered: bool, num_top: int
) -> None:
    logits = rows(num_rows, vocab, filtered, seed=vocab + num_rows)
    finite = torch.isfinite(logits)
    choice = torch.multinomial(finite.float(), 1).squeeze(-1)  # a token the row kept
    fused = unpack_logprobs(packed_logprobs(logits, choice, num_top, "raw_logprobs").cpu().numpy())
    reference = gather_logprobs(logits.log_softmax(-1), choice, num_top).cpu().numpy()
    # Ranks count the logits above the token's (the same order as its logprob's, without the
    # ties that rounding the log-softmax can make).
    ranks = 1 + (logits > logits.gather(-1, choice[:, None])).sum(-1)
    for row, (got, want) in enumerate(zip(fused, unpack_logprobs(reference), strict=True)):
        assert got.ranks == (int(ranks[row]), *want.ranks[1:])
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5, rel=1e-6)
        # Tokens at -inf (a row the sampler left with fewer than k) tie: any distinct ones do.
        finite = [lp > float("-inf") for lp in want.logprobs]
        assert [t for t, f in zip(got.token_ids, finite, strict=True) if f] == [
            t for t, f in zip(want.token_ids, finite, strict=True) if f
        ]
        assert len(set(got.token_ids[1:])) == num_top
        assert all(0 <= t < vocab for t in got.token_ids)


def test_fused_logprobs_leave_the_logits_alone_and_run_in_a_graph() -> None:
    logits = rows(8, 4096, False, seed=1)
    before = logits.clone()
    tokens = logits.argmax(-1)
    eager = packed_logprobs(logits, tokens, 3, "processed_logprobs")
    out = torch.empty_like(eager)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(packed_logprobs(logits, tokens, 3, "processed_logprobs"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert torch.equal(logits, before)
    assert (out[:, 1] == 1).all()  # the argmax ranks first
