"""The engine's start-up heap, out of the garbage collector's sight while the engine runs.

A loaded engine holds millions of long-lived Python objects (modules, parameters, graphs,
buffers), and a rollout makes thousands of short-lived ones per step (each token's logprobs,
the step outputs). Every collection of the oldest generation traverses all of them: on the CI
machine, at batch 512 with 4 decode steps per call, two such collections in 60 calls took
about 0.2 s each and doubled the mean host time per call (``benchmarks/host_overhead.py
--gc-freeze``). vLLM freezes its heap after its warm-up for the same reason.

So the first engine of a process freezes the heap once it has started, as vLLM's
``freeze_gc_heap`` does: a full collection first, so that no garbage of the start-up (a cycle
holding a warm-up's tensors) is kept alive, then ``gc.freeze`` (the objects alive then are
never traversed again). It unfreezes the heap when it shuts down, before its workers free their
memory, so that cycles among its objects are collected then. A process whose heap something
else froze already is left as it is.
"""

from __future__ import annotations

import gc


class FrozenHeap:
    def __init__(self) -> None:
        self._froze = False

    def freeze(self) -> None:
        if gc.get_freeze_count() == 0:
            gc.collect()
            gc.freeze()
            self._froze = True

    def unfreeze(self) -> None:
        if self._froze:
            self._froze = False
            gc.unfreeze()
