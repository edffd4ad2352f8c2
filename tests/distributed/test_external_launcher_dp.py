"""The external launcher with data parallelism (issue #21): under ``torchrun --nproc-per-node 4``
with TP=2, ranks {0, 1} and {2, 3} form two engines (vLLM's layout, TRL's subgroups). Each
generates, sleeps, refits and generates the tokens a single TP=2 engine generates; each uses its
own TP subgroup only, so one sleeps while the other generates; seeds are vLLM's (``seed`` as
given, TRL's ``rank // tp`` per replica); ranks of one engine with different seeds are refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dormant import LLM
from dormant.engine import UnsupportedOptionError
from dormant.executors.external_launcher import tp_group_ranks
from dormant.executors.multiproc import free_port
from tests.distributed.dp_rank import OPTIONS, UNSEEDED
from tests.engine.conftest import GREEDY, PROMPTS, hf_state_dict, write_checkpoint

REPO = Path(__file__).resolve().parents[2]
MP_OPTIONS = {**OPTIONS, "distributed_executor_backend": "mp"}


def tokens(llm: LLM, params=GREEDY) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("dp_ckpt"), seed=1)


@pytest.fixture(scope="module")
def single_engine(checkpoint) -> dict[str, object]:
    """What one TP=2 engine (not under torchrun) generates, in the rank script's order."""
    reference: dict[str, object] = {}
    for seed in (0, 1):
        with LLM(str(checkpoint), seed=seed, **MP_OPTIONS) as llm:
            reference[f"greedy{seed}"] = tokens(llm)
            reference[f"unseeded{seed}"] = tokens(llm, UNSEEDED)
            if seed == 0:
                llm.sleep(level=2)
                llm.wake_up(["weights"])
                llm.update_weights(hf_state_dict(2))
                llm.wake_up(["kv_cache"])
                reference["refit_b"] = tokens(llm)
    return reference


def test_layout_is_consecutive_tp_groups() -> None:
    assert tp_group_ranks(8, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]  # TRL's enumeration
    assert tp_group_ranks(4, 4) == [[0, 1, 2, 3]]
    assert tp_group_ranks(3, 1) == [[0], [1], [2]]


def test_two_engines_under_torchrun(checkpoint, single_engine, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
        "--master-port", str(free_port()), str(REPO / "tests/distributed/dp_rank.py"),
        str(checkpoint), str(tmp_path),
    ]  # fmt: skip
    subprocess.run(command, env=env, check=True, timeout=900, cwd=REPO)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    greedy = single_engine["greedy0"]
    assert single_engine["greedy1"] == greedy  # greedy tokens do not depend on the seed
    assert single_engine["unseeded0"] != single_engine["unseeded1"]  # replicas sample apart
    for rank, result in enumerate(ranks):
        engine = rank // 2
        assert "were given the seeds [" in result["seed_mismatch"], rank
        assert result["data_parallel_rank"] == engine and result["data_parallel_size"] == 2
        assert result["tp_ranks"] == [2 * engine, 2 * engine + 1]
        assert result["tp_rank"] == rank % 2
        assert result["greedy"] == greedy
        assert result["unseeded"] == single_engine[f"unseeded{engine}"]  # seed = rank // tp
        assert result[f"while_engine{1 - engine}-asleep"] == greedy
        want = single_engine["refit_b"] if engine == 0 else greedy
        assert result["after_refit"] == want


def test_world_size_not_a_multiple_of_tp_is_refused(checkpoint, monkeypatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(UnsupportedOptionError, match="not a multiple of tensor_parallel_size=2"):
        LLM(str(checkpoint), **OPTIONS)


def test_external_launcher_outside_torchrun_says_so(checkpoint, monkeypatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(UnsupportedOptionError, match="start every rank with torchrun"):
        LLM(str(checkpoint), **OPTIONS)
