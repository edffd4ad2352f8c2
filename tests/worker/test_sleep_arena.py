"""The worker prepares the host arena for a level-1 sleep once its KV cache and graphs exist, so
the first level-1 sleep only copies (issue 17, section 2); ``prepare_sleep_arena=False`` and
``enable_sleep_mode=False`` leave it to the first sleep."""

from __future__ import annotations

from pathlib import Path

import pytest
from worker_setup import BLOCK_SIZE, MAX_MODEL_LEN, NUM_BLOCKS

from dormant.core.config import EngineConfig
from dormant.memory import LEVELS, Policy
from dormant.worker.worker import Worker


def make_worker(path: Path, **options: object) -> Worker:
    config = EngineConfig.create(
        path, device="cpu", dtype="float32", block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
        max_num_seqs=8, max_num_batched_tokens=256, **options,
    )  # fmt: skip
    worker = Worker(config)
    worker.load_model()
    worker.init_kv_cache(NUM_BLOCKS)
    return worker


def test_the_first_level_1_sleep_finds_its_arena_ready(hf_model_and_path) -> None:  # type: ignore[no-untyped-def]
    worker = make_worker(hf_model_and_path[1])
    try:
        preparation = worker.mm.arena.preparation
        assert preparation is not None
        preparation.wait()
        host_tags = [t for t, p in LEVELS[1].items() if p is Policy.HOST]
        offloaded = sum(a.size for a in worker.mm._table.allocations(host_tags))
        assert offloaded <= preparation.nbytes == worker.mm.arena.capacity_bytes
        worker.sleep(1)
        report = worker.mm.last_sleep
        assert report is not None and report.bytes_copied == offloaded
        assert worker.mm.arena.capacity_bytes == preparation.nbytes  # nothing grown at the sleep
        worker.wake_up()
    finally:
        worker.shutdown()


@pytest.mark.parametrize("option", ["prepare_sleep_arena", "enable_sleep_mode"])
def test_no_preparation_when_turned_off(hf_model_and_path, option: str) -> None:  # type: ignore[no-untyped-def]
    worker = make_worker(hf_model_and_path[1], **{option: False})
    try:
        assert worker.mm.arena.preparation is None and worker.mm.arena.capacity_bytes == 0
    finally:
        worker.shutdown()
