"""slime's calls to its SGLang rollout server (issue #15, section 3), made over HTTP against
dormant's server (a real uvicorn on a free port) in slime's order, with slime's bodies, reading
the fields slime reads. Our own code; only the calls are slime's, read at THUDM/slime@624b824
(``sglang_engine.py`` is ``slime/backends/sglang_utils/sglang_engine.py``, ``distributed.py``
is ``slime/backends/megatron_utils/update_weight/update_weight_from_distributed.py``,
``from_tensor.py`` is ``.../update_weight/update_weight_from_tensor.py``).

One colocated training step with ``--offload-rollout`` (``train.py`` L23-33, L53-56, L83-88):

    call                                                 slime's source
    ───────────────────────────────────────────────────  ───────────────────────────────────────
    GET  /health_generate until 200                      sglang_engine.py L67-85
    GET  /flush_cache, POST /release_memory_occupation   sglang_engine.py L270-289, L328-330;
         {}  (the offload)                               placement_group.py L250-251
    POST /init_weights_update_group {master_address,     sglang_engine.py L372-383; distributed.py
         master_port, rank_offset, world_size,           L269-316 (the trainer joins as rank 0)
         group_name, backend}
    POST /resume_memory_occupation {"tags": ["weights"]} sglang_engine.py L332-339; slime/ray/
                                                         rollout.py L343-356; train.py L23-24
    POST /pause_generation {}, GET /flush_cache          distributed.py L110-112; from_tensor.py
                                                         L284-286; sglang_engine.py L423-428
    POST /update_weights_from_distributed {names,        distributed.py L328-356 (then rank 0
         dtypes, shapes, group_name, flush_cache: false,  broadcasts each tensor); sglang_engine.py
         weight_version}                                 L397-421
      or POST /update_weights_from_tensor                from_tensor.py L360-425 (one flattened
         {serialized_named_tensors, load_format:         bucket per chunk: SGLang's
         "flattened_bucket", flush_cache: false,          FlattenedTensorBucket, serialized by
         weight_version}                                 MultiprocessingSerializer); L245-268
    POST /continue_generation {}                         distributed.py L134; sglang_engine.py
                                                         L430-435
    POST /resume_memory_occupation {"tags": ["kv_cache", rollout.py L358-363; train.py L32-33
         "cuda_graph"]}
    POST /generate {sampling_params, return_logprob:     slime/rollout/sglang_rollout.py L95-105
         true, input_ids}; read meta_info.               (sampling params), L319-322
         output_token_logprobs: tokens item[1], logprobs (sampling_seed), L176-203, L206-208
         item[0], and "text"
    GET  /get_weight_version                             sglang_engine.py L320-326

Each sequence checks that the tokens after the refit equal a fresh engine's on the new weights
(sampled at temperature 1 with slime's ``sampling_seed``) with logprobs equal to
``transformers``' on those weights, that nothing is left asleep, and that calls in the wrong
order get a typed error body and change nothing.
"""

from __future__ import annotations

import asyncio
import base64
import io
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file

from dormant.engine.async_llm import AsyncLLM
from dormant.executors.multiproc import free_port
from tests.engine.conftest import write_checkpoint

GROUP = "slime-pp_0"  # distributed.py L81: f"slime-pp_{pp_rank}"
WEIGHTS, KV_CACHE, CUDA_GRAPH = "weights", "kv_cache", "cuda_graph"  # sglang.srt.constants
PROMPTS = [[5, 17, 99, 3, 250, 42], [101, 202, 33, 44, 55, 66, 77, 88, 99, 11]]
SEEDS = [7, 8]  # slime: sampling_seed = rollout_seed + j (sglang_rollout.py L319-322)
MAX_NEW_TOKENS = 12
OPTIONS = dict(max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=4 << 20, seed=0)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("slime")
    return {seed: write_checkpoint(root / f"seed{seed}", seed=seed) for seed in (1, 2)}


# ── the server, and slime's client of it ────────────────────────────────────────────────────


class Server:
    """dormant's server over an AsyncLLM, on 127.0.0.1 and a free port."""

    def __init__(self, model: Path, device: str) -> None:
        # Imported here, so that the module is collected where the server's packages (the test
        # extra) are missing, as on a bare GPU machine: the tests skip there.
        pytest.importorskip("uvicorn", reason="the server's packages are in the test extra")
        from dormant.server import ServerSettings, ServerThread, build_app

        self.engine = AsyncLLM(str(model), enable_sleep_mode=True, device=device, **OPTIONS)
        settings = ServerSettings(served_model_names=("tiny",), port=0)
        self.thread = ServerThread(build_app(self.engine, settings), settings).start()
        self.url = self.thread.url

    def close(self) -> None:
        self.thread.stop()
        self.engine.shutdown()


class SlimeEngine:
    """The HTTP calls of slime's ``SGLangEngine`` (sglang_engine.py), returning the replies:
    ``_make_request`` (L201-221) posts ``json=payload or {}``."""

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=120)

    def make_request(self, endpoint: str, payload: dict[str, Any] | None = None) -> httpx.Response:
        return self.http.post(f"/{endpoint}", json=payload or {})

    def health_generate(self) -> httpx.Response:  # L223-243
        return self.http.get("/health_generate")

    def flush_cache(self) -> httpx.Response:  # L270-289: a GET, retried until 200
        return self.http.get("/flush_cache")

    def release_memory_occupation(self) -> httpx.Response:  # L328-330
        assert self.flush_cache().status_code == 200
        return self.make_request("release_memory_occupation")

    def resume_memory_occupation(self, tags: list[str] | None = None) -> httpx.Response:
        return self.make_request("resume_memory_occupation", {"tags": tags})  # L332-339

    def pause_generation(self) -> httpx.Response:  # L423-428
        return self.http.post("/pause_generation", json={})

    def continue_generation(self) -> httpx.Response:  # L430-435
        return self.http.post("/continue_generation", json={})

    def init_weights_update_group(self, **fields: Any) -> httpx.Response:  # L372-383
        return self.make_request("init_weights_update_group", fields)

    def update_weights_from_distributed(  # L397-421
        self,
        names: list[str],
        dtypes: list[Any],
        shapes: list[Any],
        group_name: str,
        flush_cache: bool = False,
        weight_version: str | None = None,
        load_format: str | None = None,
    ) -> httpx.Response:
        payload = {
            "names": names,
            "dtypes": [str(dtype).replace("torch.", "") for dtype in dtypes],
            "shapes": [list(shape) for shape in shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            payload["weight_version"] = weight_version
        if load_format is not None:
            payload["load_format"] = load_format
        return self.make_request("update_weights_from_distributed", payload)

    def update_weights_from_tensor(  # L245-268
        self,
        serialized_named_tensors: list[str],
        load_format: str | None = None,
        flush_cache: bool = False,
        weight_version: str | None = None,
    ) -> httpx.Response:
        payload: dict[str, Any] = {
            "serialized_named_tensors": serialized_named_tensors,
            "load_format": load_format,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            payload["weight_version"] = weight_version
        return self.make_request("update_weights_from_tensor", payload)

    def get_weight_version(self) -> str:  # L320-326
        reply = self.http.get("/get_weight_version")
        reply.raise_for_status()
        return reply.json()["weight_version"]

    def generate(self, prompt_ids: list[int], seed: int) -> httpx.Response:
        """sglang_rollout.py: GenerateState's sampling params (L95-105, slime's argument
        defaults: temperature 1, top_p 1, top_k -1, no stops, skip_special_tokens False) with
        ``sampling_seed`` (L319-322) and the payload of L176-191."""
        sampling_params = dict(
            temperature=1.0,
            top_p=1.0,
            top_k=-1,
            max_new_tokens=MAX_NEW_TOKENS,
            stop=None,
            stop_token_ids=None,
            skip_special_tokens=False,
            no_stop_trim=True,
            spaces_between_special_tokens=False,
        )
        sampling_params["sampling_seed"] = seed
        payload = {"sampling_params": sampling_params, "return_logprob": True}
        payload["input_ids"] = prompt_ids
        return self.http.post("/generate", json=payload)

    def close(self) -> None:
        self.http.close()


def rollout(slime: SlimeEngine) -> list[tuple[list[int], list[float], str]]:
    """What sglang_rollout.py L206-218 keeps of each reply: tokens, logprobs, text."""
    samples = []
    for prompt, seed in zip(PROMPTS, SEEDS, strict=True):
        reply = slime.generate(prompt, seed)
        assert reply.status_code == 200, reply.text
        output = reply.json()
        items = output["meta_info"]["output_token_logprobs"]
        samples.append(([item[1] for item in items], [item[0] for item in items], output["text"]))
    return samples


def assert_refused(reply: httpx.Response, status: int, kind: str) -> None:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["type"] == kind and error["code"] == status and error["message"]


@pytest.fixture(scope="module")
def fresh() -> dict[tuple[str, int], list[Any]]:
    """Each checkpoint's rollout on a fresh engine, by (device, seed), filled on demand by
    ``fresh_rollout``: what a refit to that checkpoint must reproduce."""
    return {}


def fresh_rollout(fresh: dict, checkpoints: dict[int, Path], device: str, seed: int) -> list:
    if (device, seed) not in fresh:
        server = Server(checkpoints[seed], device)
        slime = SlimeEngine(server.url)
        try:
            fresh[device, seed] = rollout(slime)
        finally:
            slime.close()
            server.close()
    return fresh[device, seed]


def assert_logprobs_are_the_models(checkpoint: Path, samples: list) -> None:
    """Each logprob is the sampled token's under ``transformers``' model of ``checkpoint``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    for prompt, (tokens, logprobs, _) in zip(PROMPTS, samples, strict=True):
        ids = torch.tensor([prompt + tokens])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        reference = torch.log_softmax(logits, dim=-1)[torch.arange(len(tokens)), tokens]
        torch.testing.assert_close(torch.tensor(logprobs), reference, atol=1e-4, rtol=0)


# ── the trainer's side ──────────────────────────────────────────────────────────────────────


def _init_process_group(port: int, world_size: int) -> Any:
    """Rank 0 of the weight-update group, built as slime's ``init_process_group``
    (slime/utils/distributed_utils.py L55-108): a TCP rendezvous, a PrefixStore named after the
    group, torch's process-group helper, group ranks equal to global ranks."""
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=60)
    store, rank, world_size = next(
        c10d.rendezvous(f"tcp://127.0.0.1:{port}", 0, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    store = c10d.PrefixStore(GROUP, store)
    group, _ = c10d._new_process_group_helper(
        world_size, rank, [], c10d.Backend("gloo"), store, group_name=GROUP,
        backend_options=None, timeout=timeout,
    )  # fmt: skip
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def trained_weights(checkpoint: Path) -> list[tuple[str, torch.Tensor]]:
    """What the trainer holds after a step: here, a checkpoint's tensors (HF names)."""
    return list(load_file(str(checkpoint / "model.safetensors")).items())


def _distributed_trainer(port: int, conn: Connection) -> None:
    """distributed.py L328-356: for each checkpoint asked for, the metadata, then one async
    broadcast per tensor from rank 0, waited on together."""
    import torch.distributed as dist

    group = _init_process_group(port, world_size=2)
    while (checkpoint := conn.recv()) is not None:
        named = trained_weights(checkpoint)
        conn.send(([n for n, _ in named], [t.dtype for _, t in named], [t.shape for _, t in named]))
        handles = [dist.broadcast(t.data, 0, group=group, async_op=True) for _, t in named]
        for handle in handles:
            handle.wait()


def _flattened_bucket_trainer(port: int, checkpoint: Path, conn: Connection) -> None:
    """SGLang's ``load_format="flattened_bucket"`` over the group: the metadata, then one
    broadcast of the bucket's buffer (``update_weights_from_distributed`` takes the field),
    beside each call, whatever the engine answers; answers how it ended. Where it failed (the
    engine destroyed the group), it hosts a new group on the port it is sent."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    named = trained_weights(checkpoint)
    conn.send(([n for n, _ in named], [t.dtype for _, t in named], [t.shape for _, t in named]))
    while port is not None:
        group = _init_process_group(port, world_size=2)
        try:
            dist.broadcast(flattened_bucket(named)["flattened_tensor"], 0, group=group)
            conn.send("ok")
        except RuntimeError as error:
            conn.send(str(error))
            c10d._abort_process_group(group)  # its name is free again
        del group
        port = conn.recv()


@dataclass
class FlattenedTensorMetadata:
    """SGLang's bucket metadata (sglang/srt/weight_sync/tensor_bucket.py): byte offsets.

    A copy on purpose, not ``dormant.worker.ipc_payload``'s: a trainer pickles its own class
    (SGLang's, or slime's copy) from its own module, and the engine must resolve it by name."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def flattened_bucket(named: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """SGLang's multi-dtype ``FlattenedTensorBucket``: every tensor's bytes back to back."""
    parts, metadata, offset = [], [], 0
    for name, tensor in named:
        flat = tensor.flatten().view(torch.uint8)
        metadata.append(
            FlattenedTensorMetadata(name, tensor.shape, tensor.dtype, offset, offset + flat.numel(),
                                    flat.numel())
        )  # fmt: skip
        parts.append(flat)
        offset += flat.numel()
    return {"flattened_tensor": torch.cat(parts), "metadata": metadata}


def serialize(obj: Any) -> str:
    """SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)``."""
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(obj)
    return base64.b64encode(buffer.getvalue()).decode("utf-8")


def _tensor_trainer(device: str, checkpoint: Path, num_chunks: int, conn: Connection) -> None:
    """from_tensor.py L295-311 and L360-425 for one engine of TP 1: the weights in chunks, one
    flattened bucket each (all dtypes together, ``supports_multi_dtypes``), kept alive until the
    engine answered (``long_lived_tensors``)."""
    named = [(n, t.to(device)) for n, t in trained_weights(checkpoint)]
    size = -(-len(named) // num_chunks)
    long_lived = [flattened_bucket(named[i : i + size]) for i in range(0, len(named), size)]
    conn.send([[serialize(data)] for data in long_lived])  # one entry per TP rank, per chunk
    conn.recv()


def assert_fully_awake(server: Server, slime: SlimeEngine) -> None:
    assert slime.http.get("/is_sleeping").json() == {"is_sleeping": False}
    assert asyncio.run(server.engine.asleep_tags()) == ()


# ── the sequences ───────────────────────────────────────────────────────────────────────────


def test_slime_cycle_over_a_gloo_weight_update_group(checkpoints, fresh, spawn) -> None:
    """``UpdateWeightFromDistributed`` (non-colocated engines): gloo here, NCCL on GPUs."""
    after = fresh_rollout(fresh, checkpoints, "cpu", 2)
    server = Server(checkpoints[1], "cpu")
    slime = SlimeEngine(server.url)
    try:
        assert slime.health_generate().status_code == 200
        fresh["cpu", 1] = rollout(slime)  # fresh on checkpoint 1: what refitting 1 must give
        assert [s[0] for s in fresh["cpu", 1]] != [s[0] for s in after]
        assert slime.release_memory_occupation().status_code == 200
        assert_refused(slime.generate(PROMPTS[0], SEEDS[0]), 503, "EngineAsleepError")
        port = free_port()
        trainer = spawn(_distributed_trainer, port)
        reply = slime.init_weights_update_group(
            master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2,
            group_name=GROUP, backend="gloo",
        )  # fmt: skip
        assert reply.status_code == 200, reply.text
        # Wrong order: a refit before the weights are back is refused, and nothing is written;
        # the trainer broadcasts beside the call, as slime does, so the refused call receives
        # and drops them (the group stays in step). An unknown group is refused likewise.
        trainer.send(checkpoints[2])
        names, dtypes, shapes = trainer.recv()
        reply = slime.update_weights_from_distributed(names, dtypes, shapes, GROUP)
        assert_refused(reply, 503, "EngineAsleepError")
        for seed, version in ((2, "1"), (1, "2")):
            assert slime.resume_memory_occupation([WEIGHTS]).status_code == 200
            assert_refused(slime.generate(PROMPTS[0], SEEDS[0]), 503, "EngineAsleepError")
            reply = slime.update_weights_from_distributed(list(names), dtypes, list(shapes), "x")
            assert_refused(reply, 400, "UpdateGroupError")
            assert slime.pause_generation().status_code == 200
            assert slime.flush_cache().status_code == 200
            trainer.send(checkpoints[seed])
            names, dtypes, shapes = trainer.recv()
            reply = slime.update_weights_from_distributed(
                names, dtypes, shapes, GROUP, weight_version=version
            )
            assert reply.status_code == 200, reply.text
            assert slime.continue_generation().status_code == 200
            assert slime.resume_memory_occupation([KV_CACHE, CUDA_GRAPH]).status_code == 200
            samples = rollout(slime)
            assert samples == fresh_rollout(fresh, checkpoints, "cpu", seed)
            assert slime.get_weight_version() == version
            assert_fully_awake(server, slime)
            if seed == 2:
                assert_logprobs_are_the_models(checkpoints[2], samples)
                assert slime.release_memory_occupation().status_code == 200  # the next step
        trainer.send(None)
        assert all(0 < len(tokens) <= MAX_NEW_TOKENS for tokens, _, _ in samples)
    finally:
        slime.close()
        server.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_slime_cycle_over_flattened_tensor_buckets(checkpoints, fresh, spawn, device) -> None:
    """``UpdateWeightFromTensor`` (colocated engines): the trainer's tensors as IPC handles in
    flattened buckets (CUDA IPC on the GPU; shared memory on the CPU)."""
    expected = fresh_rollout(fresh, checkpoints, device, 2)
    server = Server(checkpoints[1], device)
    slime = SlimeEngine(server.url)
    try:
        assert slime.health_generate().status_code == 200
        assert slime.release_memory_occupation().status_code == 200
        trainer = spawn(_tensor_trainer, device, checkpoints[2], 3)
        chunks = trainer.recv()
        reply = slime.update_weights_from_tensor(chunks[0], load_format="flattened_bucket")
        assert_refused(reply, 503, "EngineAsleepError")  # the weights are still released
        assert slime.resume_memory_occupation([WEIGHTS]).status_code == 200
        assert slime.pause_generation().status_code == 200
        assert slime.flush_cache().status_code == 200
        for chunk in chunks:
            reply = slime.update_weights_from_tensor(
                chunk, load_format="flattened_bucket", weight_version="1"
            )
            assert reply.status_code == 200, reply.text
        trainer.send(None)
        assert slime.continue_generation().status_code == 200
        assert_refused(slime.generate(PROMPTS[0], SEEDS[0]), 503, "EngineAsleepError")
        assert slime.resume_memory_occupation([KV_CACHE, CUDA_GRAPH]).status_code == 200
        assert rollout(slime) == expected
        assert slime.get_weight_version() == "1"
        assert_fully_awake(server, slime)
    finally:
        slime.close()
        server.close()


def test_update_weights_from_distributed_takes_sglangs_load_format(checkpoints, fresh, spawn):
    """SGLang's field, which slime passes when set (sglang_engine.py L416-417): a
    ``"flattened_bucket"`` arrives as one broadcast. With an unknown format the engine cannot
    tell what the trainer broadcasts beside the call: it receives nothing and destroys the
    group, so that the trainer's broadcast fails instead of hanging; joined again, it works."""
    expected = fresh_rollout(fresh, checkpoints, "cpu", 2)
    server = Server(checkpoints[1], "cpu")
    slime = SlimeEngine(server.url)
    try:
        port = free_port()
        trainer = spawn(_flattened_bucket_trainer, port, checkpoints[2])
        reply = slime.init_weights_update_group(
            master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2,
            group_name=GROUP, backend="gloo",
        )  # fmt: skip
        assert reply.status_code == 200, reply.text
        names, dtypes, shapes = trainer.recv()
        reply = slime.update_weights_from_distributed(
            names, dtypes, shapes, GROUP, load_format="bogus"
        )
        assert_refused(reply, 400, "UpdateGroupDestroyedError")
        outcome = trainer.recv()
        assert outcome != "ok" and "timed out" not in outcome.lower(), outcome
        reply = slime.update_weights_from_distributed(
            names, dtypes, shapes, GROUP, load_format="flattened_bucket"
        )
        assert_refused(reply, 400, "UpdateGroupError")  # the group is gone
        port = free_port()
        trainer.send(port)
        reply = slime.init_weights_update_group(
            master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2,
            group_name=GROUP, backend="gloo",
        )  # fmt: skip
        assert reply.status_code == 200, reply.text
        reply = slime.update_weights_from_distributed(
            names, dtypes, shapes, GROUP, weight_version="1", load_format="flattened_bucket"
        )
        assert reply.status_code == 200, reply.text
        assert trainer.recv() == "ok"
        trainer.send(None)
        assert rollout(slime) == expected
        assert slime.get_weight_version() == "1"
    finally:
        slime.close()
        server.close()


def test_slime_finds_dormant_as_an_external_engine(checkpoints) -> None:
    """``--rollout-external-engine-addrs``: ``discover_external_engines``
    (slime/backends/sglang_utils/external.py L76-120) reads ``/server_info`` for the engine's
    size and kind, and ``SGLangEngine._init_external`` (sglang_engine.py L157-170) asserts that
    each checked field equals what slime would have launched (``_compute_server_args``
    L527-573: for a regular worker, ``enable_memory_saver`` is ``--offload-rollout``)."""
    server = Server(checkpoints[1], "cpu")
    slime = SlimeEngine(server.url)
    try:
        reply = slime.http.get("/server_info")
        reply.raise_for_status()
        server_info = reply.json()
        pp_size = int(server_info.get("pp_size") or server_info.get("pipeline_parallel_size") or 1)
        tp_size = int(server_info.get("tp_size") or server_info.get("tensor_parallel_size") or 1)
        num_gpus = int(server_info.get("num_gpus") or tp_size * pp_size)
        assert (tp_size, pp_size, num_gpus) == (1, 1, 1)
        assert not server_info.get("encoder_only")
        assert server_info.get("disaggregation_mode") not in ("prefill", "decode")  # "regular"
        expected = {"enable_memory_saver": True}  # dormant serve sleeps: --offload-rollout
        for name, value in expected.items():
            assert server_info.get(name) == value, (name, server_info.get(name))
    finally:
        slime.close()
        server.close()
