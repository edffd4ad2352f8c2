"""Decode "graphs" on the CPU: ``capture_eagerly`` fills a ``DecodeGraphs`` the way ``capture``
does, with stand-ins whose ``replay`` runs the captured body again (capturing needs CUDA). So
``ModelRunner.execute`` and ``execute_multi_step`` take their graph paths on the CPU, with the
same buffers, loads, bodies and read-backs; only the CUDA graph itself is missing (and so do
speculative decoding's fused rounds, ``capture_rounds_eagerly``). The CPU tests
check the graph paths with it, and ``benchmarks/host_overhead.py --multi-steps`` times the host
work around them (nothing in the engine uses it)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from dormant.memory import RUNTIME
from dormant.worker.cuda_graphs import CapturedGraph, DecodeGraphs
from dormant.worker.logprobs import packed_width
from dormant.worker.spec_rounds import SpecRounds


class EagerGraph:
    """A captured graph's stand-in: ``replay`` runs the body again into the output the
    "capture" returned (what replaying a graph does), and counts the replays."""

    def __init__(self, body: Callable[[], torch.Tensor]) -> None:
        self.body, self.num_replays = body, 0
        self.output = body()

    def replay(self) -> None:
        self.num_replays += 1
        output = self.body()
        if output is not self.output:
            self.output.copy_(output)


def capture_eagerly(graphs: DecodeGraphs) -> None:
    """``DecodeGraphs.capture`` with ``EagerGraph``s: a full and (``num_steps > 1``) a
    multi-step graph per batch size, their outputs where ``capture`` puts them."""
    width = packed_width(graphs.num_top_logprobs)
    for bs in reversed(graphs.batch_sizes):
        graphs._fill_padding(bs)
        full = EagerGraph(partial(graphs._forward, bs))
        graphs.full[bs] = CapturedGraph(full, full.output)  # type: ignore[arg-type]
        if graphs.num_steps > 1:
            shapes = [
                ((graphs.num_steps, bs), torch.int64),
                ((graphs.num_steps, bs, width), torch.int32),
            ]
            tokens, packed = graphs.mm.empty_many(shapes, RUNTIME)
            graphs._fill_padding(bs)
            multi = EagerGraph(partial(graphs._steps, bs, tokens, packed))
            graphs.multi_step[bs] = CapturedGraph(multi, tokens, packed)  # type: ignore[arg-type]
    graphs._fill_padding(graphs.batch_sizes[-1])


def capture_rounds_eagerly(rounds: SpecRounds, batch_sizes: list[int]) -> None:
    """``SpecRounds.capture`` with ``EagerGraph``s: one per batch size that fits."""
    for bs in sorted((bs for bs in batch_sizes if bs <= rounds.max_rows), reverse=True):
        rounds._fill_padding(0, bs)
        rounds.graphs[bs] = EagerGraph(partial(rounds.body, bs))


def num_replays(graphs: dict[int, CapturedGraph]) -> int:
    """Replays of the stand-ins in ``graphs`` (``DecodeGraphs.full`` or ``multi_step``)."""
    return sum(captured.graph.num_replays for captured in graphs.values())  # type: ignore[attr-defined]
