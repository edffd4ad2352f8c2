"""OpenRLHF's and NeMo-RL's engines with ``distributed_executor_backend="ray"`` (issue #21): each
framework's placement group, its engine actor on it (``placement_group_capture_child_tasks``),
the bundles it names in ``VLLM_RAY_BUNDLE_INDICES``, and its constructor call, with the file and
line of the snapshot read (see ``ray_framework_actors.py`` for the calls inside the actors).
dormant's workers land on exactly those bundles of the caller's group, which dormant leaves in
place at shutdown; the engine generates what an in-process engine generates, through a sleep."""

from __future__ import annotations

from pathlib import Path

import pytest

from dormant import LLM, SamplingParams
from tests.distributed.ray_framework_actors import NemoRLGenerationWorker, OpenRLHFRolloutActor
from tests.distributed.test_ray_executor import gone
from tests.engine.conftest import PROMPTS, write_checkpoint

EXTENSION = "tests.engine.worker_extensions.RefitExtension"  # for the frameworks' own


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("frameworks_ckpt"), seed=1)


def in_process(checkpoint: Path, params: SamplingParams, dtype: str) -> list[list[int]]:
    with LLM(str(checkpoint), device="cpu", max_model_len=256, dtype=dtype) as llm:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_openrlhf_create_vllm_engines_with_ray(ray_cluster, checkpoint) -> None:
    """create_vllm_engines (vllm_engine.py L211-313) with tensor_parallel_size=2, engine i=1 of
    num_engines=2: "ray" for TP > 1 (L242), one PACK group of {"GPU": 1, "CPU": 1} bundles
    (L249-253), the engine's bundles by node (utils.py get_bundle_indices L7-17: [2, 3] on one
    node), the actor on the first of them capturing child tasks (L257-264) with num_cpus =
    num_gpus = 0 (L244, L302-308), and the kwargs of L266-282 and L295-297."""
    ray = ray_cluster
    from ray.util.placement_group import placement_group, placement_group_table
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    num_engines, tensor_parallel_size, i = 2, 2, 1
    bundles = [{"GPU": 1, "CPU": 1} for _ in range(num_engines * tensor_parallel_size)]
    shared_pg = placement_group(bundles, strategy="PACK")
    ray.get(shared_pg.ready())
    bundle_indices = list(range(i * tensor_parallel_size, (i + 1) * tensor_parallel_size))
    scheduling_strategy = PlacementGroupSchedulingStrategy(
        placement_group=shared_pg,
        placement_group_capture_child_tasks=True,
        placement_group_bundle_index=bundle_indices[0],
    )
    actor_kwargs = {
        "model": str(checkpoint),
        "enforce_eager": False,
        "worker_extension_cls": EXTENSION,
        "tensor_parallel_size": tensor_parallel_size,
        "seed": 42 + i,
        "distributed_executor_backend": "ray",
        "max_model_len": 256,
        "enable_prefix_caching": True,
        "dtype": "bfloat16",
        "trust_remote_code": True,
        "full_determinism": False,
        "gpu_memory_utilization": 0.5,
        "bundle_indices": bundle_indices,
        "num_gpus": 1,
        "enable_sleep_mode": True,
        "logprobs_mode": "processed_logprobs",
        "max_logprobs": 1,
    }
    num_gpus = int(tensor_parallel_size == 1)
    engine = (
        ray.remote(OpenRLHFRolloutActor)
        .options(num_cpus=num_gpus, num_gpus=num_gpus, scheduling_strategy=scheduling_strategy)
        .remote(**actor_kwargs)
    )
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = in_process(checkpoint, params, "bfloat16")
    try:
        where = ray.get(engine.placement.remote())
        assert where["executor"] == "RayExecutor"
        assert where["group"] == shared_pg.id.hex() and where["bundles"] == [2, 3]
        assert not where["is_owned"]
        first = ray.get([engine.generate.remote(p, params) for p in PROMPTS])
        ray.get(engine.sleep.remote(level=1))
        ray.get(engine.wake_up.remote())
        assert ray.get(engine.collective_rpc.remote("where_am_i")) == [(0, "cpu"), (1, "cpu")]
        again = ray.get([engine.generate.remote(p, params) for p in PROMPTS])
        assert first == want and again == want
        ray.get(engine.shutdown.remote())
        assert gone(where["pids"])
        assert placement_group_table(shared_pg)["state"] == "CREATED"  # the caller's, kept
    finally:
        ray.kill(engine)
        ray.util.remove_placement_group(shared_pg)


def test_nemo_rl_vllm_generation_worker_with_ray(ray_cluster, checkpoint) -> None:
    """A tied worker group of TP=2 on bundles [0, 1] of NeMo-RL's per-node group
    (virtual_cluster.py L906-911, L934-941: {"CPU": max_colocated_worker_groups, "GPU": 1},
    PACK); the model owner scheduled on bundle 0 capturing child tasks (worker_groups.py
    L221-229) with num_gpus=0 and RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES (vllm_worker.py
    configure_worker L224-235, L243-245), seed node_idx * 1024 + bundle_id (L161-169)."""
    ray = ray_cluster
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    max_colocated_worker_groups, bundle_indices = 1, [0, 1]
    bundles = [{"CPU": max_colocated_worker_groups, "GPU": 1} for _ in bundle_indices]
    pg = placement_group(bundles=bundles, strategy="PACK", name="nemo-rl-node0")
    ray.get(pg.ready())
    env_vars = {
        "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_SKIP_P2P_CHECK": "1",
    }
    worker = (
        ray.remote(NemoRLGenerationWorker)
        .options(
            num_gpus=0,
            runtime_env={"env_vars": env_vars},
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg,
                placement_group_bundle_index=bundle_indices[0],
                placement_group_capture_child_tasks=True,
            ),
        )
        .remote(
            str(checkpoint),
            bundle_indices=bundle_indices,
            fraction_of_gpus=1.0,
            seed=0 * 1024 + bundle_indices[0] // len(bundle_indices),
            tensor_parallel_size=2,
            gpu_memory_utilization=0.5,
            precision="float32",
            max_model_len=256,
            worker_extension_cls=EXTENSION,
            logprobs_mode="processed_logprobs",
        )
    )
    params = SamplingParams(temperature=0.0, top_p=1.0, top_k=1, max_tokens=16, logprobs=0)
    want = in_process(checkpoint, params, "float32")
    try:
        where = ray.get(worker.placement.remote())
        assert where["group"] == pg.id.hex() and where["bundles"] == [0, 1]
        assert not where["is_owned"]
        assert ray.get(worker.generate.remote(PROMPTS, 16)) == want
        ray.get(worker.sleep.remote())
        ray.get(worker.wake_up.remote(tags=["weights"]))
        ray.get(worker.wake_up.remote(tags=["kv_cache"]))
        assert ray.get(worker.collective_rpc.remote("where_am_i")) == [(0, "cpu"), (1, "cpu")]
        assert ray.get(worker.generate.remote(PROMPTS, 16)) == want
        ray.get(worker.shutdown.remote())
        assert gone(where["pids"])
    finally:
        ray.kill(worker)
        ray.util.remove_placement_group(pg)
