"""One rank of ``torchrun --nproc-per-node 4`` with TP=2: two engines (data-parallel replicas) of
two ranks each. Run by ``test_external_launcher_dp.py``; writes ``rank<R>.json`` into the output
folder given as the second argument (the first is the checkpoint).

Each engine is seeded the way TRL seeds its replicas (``seed=rank // tensor_parallel_size``).
The two engines never wait on each other: one sleeps, and stays asleep until the other tells it
(through marker files) that it generated; then the other way round. If the generating engine's
collectives needed the sleeping one, it would block, the sleeper's wait would time out, and the
run would fail.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from dormant import LLM, SamplingParams
from dormant.engine import UnsupportedOptionError
from tests.engine.conftest import GREEDY, PROMPTS, hf_state_dict

TP = 2
OPTIONS = dict(
    tensor_parallel_size=TP,
    distributed_executor_backend="external_launcher",
    device="cpu",
    max_model_len=256,
    max_num_seqs=8,
    kv_cache_memory_bytes=4 << 20,
)
UNSEEDED = SamplingParams(temperature=0.9, top_k=50, max_tokens=24, ignore_eos=True)
WAIT_S = 120.0


def tokens(llm: LLM, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def mark(out: Path, name: str, rank: int) -> None:
    (out / f"{name}.rank{rank}").touch()


def wait_for(out: Path, name: str, ranks: list[int]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not all((out / f"{name}.rank{r}").exists() for r in ranks):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {name!r} from ranks {ranks} in {WAIT_S} s")
        time.sleep(0.05)


def main(checkpoint: str, out: Path) -> None:
    rank = int(os.environ["RANK"])
    engine = rank // TP
    others = [r for r in range(int(os.environ["WORLD_SIZE"])) if r // TP != engine]
    result: dict[str, object] = {}
    try:  # the ranks of one engine with different seeds: refused on each of them
        LLM(checkpoint, seed=rank, **OPTIONS)
    except UnsupportedOptionError as error:
        result["seed_mismatch"] = str(error)
    llm = LLM(checkpoint, seed=engine, **OPTIONS)
    executor = llm.llm_engine.executor
    result.update(
        data_parallel_rank=executor.data_parallel_rank,
        data_parallel_size=executor.data_parallel_size,
        tp_ranks=executor.tp_ranks,
        tp_rank=executor.worker.rank,
        greedy=tokens(llm),
        unseeded=tokens(llm, UNSEEDED),
    )
    for sleeper in range(2):  # engine 0 sleeps at level 1, then engine 1 at level 2
        phase = f"engine{sleeper}-asleep"
        if engine == sleeper:
            llm.sleep(level=1 + sleeper)
            mark(out, phase, rank)
            wait_for(out, phase + "-other-generated", others)
            llm.wake_up(["weights"])
            if sleeper == 1:
                llm.reload_weights()
            llm.wake_up(["kv_cache"])
        else:
            wait_for(out, phase, others)
            result[f"while_{phase}"] = tokens(llm)
            mark(out, phase + "-other-generated", rank)
    # the RL cycle on each engine, each with its own refit: engine 0 takes new weights,
    # engine 1 re-reads its checkpoint
    llm.sleep(level=2)
    llm.wake_up(["weights"])
    if engine == 0:
        llm.update_weights(hf_state_dict(2))
    else:
        llm.collective_rpc("reload_weights")
    llm.wake_up(["kv_cache"])
    result["after_refit"] = tokens(llm)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    llm.shutdown()
    import torch.distributed as dist

    dist.destroy_process_group()  # the world group the engines started from


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
