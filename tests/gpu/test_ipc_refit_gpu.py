"""The colocated refit on the GPU (issue #13): a trainer process on the same GPU sends the new
weights as CUDA IPC handles (SGLang's flattened bucket, and named tensors) after a level-2 sleep
with CUDA graphs; the tokens equal a fresh engine's on those weights."""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.connection import Connection

import pytest
import torch

from dormant import LLM, SamplingParams
from dormant.worker.ipc_weights import (
    FLATTENED_BUCKET,
    flattened_bucket_request,
    serialize_for_update,
)
from tests.engine.conftest import PROMPTS, hf_state_dict, write_checkpoint

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
OPTIONS = dict(device="cuda", max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=16 << 20)


def _trainer(conn: Connection, seed: int, as_bucket: bool) -> None:
    weights = [(n, t.to("cuda")) for n, t in hf_state_dict(seed).items()]
    if as_bucket:
        entries, flat = flattened_bucket_request(weights)
    else:
        entries, flat = [serialize_for_update(weights)], None
    conn.send(entries)
    conn.recv()  # the engine copied them: the buffers may go
    del flat


@pytest.mark.parametrize("as_bucket", [True, False], ids=["flattened-bucket", "named"])
def test_ipc_refit_after_level_2_equals_a_fresh_engine(tmp_path, as_bucket: bool) -> None:
    with LLM(str(write_checkpoint(tmp_path / "b", seed=2)), **OPTIONS) as fresh:
        expected = [o.outputs[0].token_ids for o in fresh.generate(PROMPTS, GREEDY)]
    with LLM(str(write_checkpoint(tmp_path / "a", seed=1)), **OPTIONS) as llm:
        llm.generate(PROMPTS, GREEDY)
        llm.sleep(level=2)
        llm.wake_up(["weights"])
        context = mp.get_context("spawn")
        conn, child = context.Pipe()
        trainer = context.Process(target=_trainer, args=(child, 2, as_bucket))
        trainer.start()
        try:
            entries = conn.recv()
            load_format = FLATTENED_BUCKET if as_bucket else None
            llm.update_weights_from_tensor(entries, load_format=load_format, weight_version="2")
            conn.send(True)
        finally:
            trainer.join(timeout=60)
        llm.wake_up(["kv_cache"])
        assert llm.get_weight_version() == "2"
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    torch.cuda.empty_cache()
