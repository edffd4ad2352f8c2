"""A trainer that reuses one bucket buffer (verl's way), on the GPU: the engine keeps the buffer's
IPC handle open between buckets (``ipc_receiver.IpcHandles``) and, since torch skips the sender's
IPC event on such a cache hit, waits on that event itself. The trainer delays each pack behind a
long kernel and sends at once, so a bucket read before the event fired would hold the previous
bucket's bytes: the weights must still be byte-equal to a fresh engine's, and the tokens equal.
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.connection import Connection

import pytest
import torch

from dormant import LLM
from dormant.worker.ipc_weights import (
    FLATTENED_BUCKET,
    iter_buckets,
    pack_flattened_bucket,
    serialize_for_update,
)
from tests.engine.conftest import PROMPTS, hf_state_dict, write_checkpoint
from tests.gpu.test_ipc_refit_gpu import GREEDY, OPTIONS

pytestmark = pytest.mark.gpu
BUCKET_BYTES = 64 << 10  # the tiny checkpoint in about a dozen buckets
DELAY_CYCLES = 20_000_000  # ~10 ms of GPU time before each pack


def _reusing_trainer(conn: Connection, seed: int) -> None:
    weights = [(n, t.to("cuda")) for n, t in hf_state_dict(seed).items()]
    largest = max(t.numel() * t.element_size() for _, t in weights)
    buffer = torch.zeros(max(largest, BUCKET_BYTES) + (1 << 16), dtype=torch.uint8, device="cuda")
    for bucket in iter_buckets(weights, BUCKET_BYTES):
        torch.cuda._sleep(DELAY_CYCLES)  # the pack below lands late, on this stream
        payload = pack_flattened_bucket(buffer, bucket)
        conn.send([serialize_for_update(payload)])  # before the pack finished
        conn.recv()  # the engine copied this bucket: the buffer may be packed again
    conn.send(None)
    conn.recv()  # keep the buffer alive until the engine is done with it


def _worker(llm: LLM):
    return llm.llm_engine.executor.worker


def test_a_reused_buffer_is_read_after_the_senders_writes(tmp_path) -> None:
    with LLM(str(write_checkpoint(tmp_path / "b", seed=2)), **OPTIONS) as fresh:
        expected_tokens = [o.outputs[0].token_ids for o in fresh.generate(PROMPTS, GREEDY)]
        expected = {n: p.detach().clone() for n, p in _worker(fresh).model.named_parameters()}
    with LLM(str(write_checkpoint(tmp_path / "a", seed=1)), **OPTIONS) as llm:
        llm.generate(PROMPTS, GREEDY)
        llm.sleep(level=2)
        llm.wake_up(["weights"])
        context = mp.get_context("spawn")
        conn, child = context.Pipe()
        trainer = context.Process(target=_reusing_trainer, args=(child, 2))
        trainer.start()
        handles = _worker(llm).refitter.ipc.handles
        num_buckets = 0
        try:
            while (entries := conn.recv()) is not None:
                llm.update_weights_from_tensor(entries, load_format=FLATTENED_BUCKET)
                num_buckets += 1
                conn.send(True)
            assert num_buckets > 3
            assert handles.num_opened == 1 and handles.num_reused == num_buckets - 1
            assert handles.num_held == 1
            llm.wake_up(["kv_cache"])  # ends the refit: the handle is closed
            assert handles.num_held == 0
            conn.send(True)
        finally:
            trainer.join(timeout=60)
        actual = dict(_worker(llm).model.named_parameters())
        for name, value in expected.items():
            assert torch.equal(actual[name], value), name
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected_tokens
    torch.cuda.empty_cache()
