"""Speculative decoding on the GPU (issue 19): greedy output identical to decoding without it
(k = 1, 3, 5; self-speculation, an unrelated draft, MTP layers; MTP's passes from graphs equal
the eager ones across a level-2 cycle; the fused rounds, a draft model's and MTP's, equal one
round per step), and the seed's lifecycle with speculation on, CUDA graphs captured for the
target's decodes: record the graph-visible addresses (the target's and the draft's), generate,
``sleep(2)``, ``wake_up(["weights"])``, ``collective_rpc("reload_weights")``,
``wake_up(["kv_cache"])``, generate again: tokens identical, addresses unchanged, acceptance
rate unchanged (100 % for self-speculation)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dormant import LLM, SamplingParams
from dormant.engine.spec_stats import SpecDecodeStats
from tests.engine.conftest import PROMPTS, write_checkpoint
from tests.engine.test_spec_rounds_mtp import save_repeating_mimo

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from tiny_mimo import save_tiny_mimo

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=24, ignore_eos=True)
MiB = 1 << 20
OPTIONS = dict(device="cuda", max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=16 * MiB)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return (
        write_checkpoint(tmp_path_factory.mktemp("spec_a"), seed=1),
        write_checkpoint(tmp_path_factory.mktemp("spec_b"), seed=2),
    )


@pytest.fixture(scope="module")
def mimo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("spec_mimo")
    save_tiny_mimo(path, num_mtp_layers=1)
    return path


def make(
    engines: list[LLM],
    target: Path,
    draft: Path | str | None = None,
    k: int = 3,
    is_mimo: bool = False,
    engine_options: dict[str, object] | None = None,
    **spec_options: object,
) -> LLM:
    """An engine on the GPU, after shutting down the ones made before (one memory manager per
    device at a time). ``draft``: a checkpoint, or "mtp" for the target's MTP layers."""
    while engines:
        engines.pop().shutdown()
    options: dict[str, object] = {**OPTIONS, **(engine_options or {})}
    if is_mimo or draft == "mtp":  # the tiny MiMo has 128 positions and no tokenizer
        options.update(skip_tokenizer_init=True, max_model_len=128)
    if draft == "mtp":
        options["speculative_config"] = {
            "method": "mtp", "num_speculative_tokens": k, **spec_options
        }  # fmt: skip
    elif draft is not None:
        options["speculative_config"] = {
            "model": str(draft), "num_speculative_tokens": k, **spec_options
        }  # fmt: skip
    llm = LLM(str(target), **options)  # type: ignore[arg-type]
    engines.append(llm)
    return llm


def tokens(
    llm: LLM, params: SamplingParams = GREEDY, prompts: list | None = None
) -> list[tuple[int, ...]]:
    outputs = llm.generate(prompts or PROMPTS, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


MIMO_PROMPTS = [{"prompt_token_ids": [5, 17, 99, 3, 50, 42]}, {"prompt_token_ids": [7, 7, 7]}]


def graph_visible(llm: LLM) -> list[tuple[int, int]]:
    """(id, address) of every tensor a graph or a step reads at a fixed address: the target's
    inputs, KV and graph outputs, and the draft's weights and KV."""
    worker = llm.llm_engine.executor.worker
    tensors = [*worker.runner.inputs.tensors()]
    tensors += [a.kv_cache for a in worker.model.attention_layers()]
    graphs = worker.runner.graphs
    if graphs is not None:
        tensors += [g.output for g in (*graphs.full.values(), *graphs.multi_step.values())]
    draft = worker.draft
    tensors += [*draft.model.parameters(), *(a.kv_cache for a in draft.model.attention_layers())]
    tensors += [] if draft.hidden_cache is None else [draft.hidden_cache]
    rounds, decoder = worker.steps.spec_step.rounds, worker.steps.spec_step.decoder
    if rounds is not None:  # the fused rounds' state and outputs, the passes' inputs
        tensors += [*rounds.tensors(), *rounds.verifier.inputs.tensors()]
    if decoder is not None:
        tensors += decoder.inputs.tensors()
    mtp = worker.steps.spec_step.mtp
    if mtp is not None:  # MTP's static inputs and its graphs' outputs
        captured = [mtp.catch_up_graphs, *mtp.step_graphs.values()]
        tensors += [*mtp.tensors(), *(out for g in captured for _, out in g.values())]
    return [(id(t), t.data_ptr()) for t in tensors]


def assert_same_outputs(ours: list, theirs: list, tolerance: float) -> None:
    """The same tokens, and at each the same top tokens with logprobs within ``tolerance``."""
    for a, b in zip(ours, theirs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert set(x) == set(y)
            expected = pytest.approx([y[t].logprob for t in x], abs=tolerance)
            assert [x[t].logprob for t in x] == expected


def acceptance(llm: LLM) -> float | None:
    stats = llm.llm_engine.spec_decode_stats
    assert stats is not None
    llm.llm_engine.spec_decode_stats = SpecDecodeStats()  # the next reading starts afresh
    return stats.acceptance_rate


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_identical_with_and_without_speculation(engines, checkpoints, k: int) -> None:
    target, other = checkpoints
    reference = tokens(make(engines, target))
    self_spec = make(engines, target, target, k)
    assert tokens(self_spec) == reference
    assert acceptance(self_spec) == 1.0
    unrelated = make(engines, target, other, k)
    assert tokens(unrelated) == reference
    rate = acceptance(unrelated)
    assert rate is not None and rate < 0.5


def test_lifecycle_level_2_with_speculation(engines, checkpoints) -> None:
    target, _ = checkpoints
    llm = make(engines, target, target, k=3)
    worker = llm.llm_engine.executor.worker
    assert worker.runner.graphs is not None  # the target's decode graphs were captured
    rounds = worker.steps.spec_step.rounds
    assert rounds is not None and rounds.graphs  # greedy decodes replay the fused rounds
    addresses = graph_visible(llm)
    greedy = tokens(llm)
    replays = rounds.num_replays
    assert replays > 0
    assert acceptance(llm) == 1.0  # self-speculation, greedy: every draft
    seeded = tokens(llm, SEEDED)
    seeded_rate = acceptance(llm)  # argmax drafts of random rows: some
    assert seeded_rate is not None and 0.0 < seeded_rate < 1.0
    llm.sleep(level=2)
    llm.wake_up(["weights"])
    llm.collective_rpc("reload_weights")
    llm.wake_up(["kv_cache"])
    assert graph_visible(llm) == addresses
    assert tokens(llm) == greedy
    assert rounds.num_replays > replays  # the same graphs, replayed after the cycle
    assert acceptance(llm) == 1.0
    assert tokens(llm, SEEDED) == seeded
    assert acceptance(llm) == seeded_rate
    worker.mm.verify_guards()


@pytest.mark.parametrize("k", [1, 3, 5])
def test_mtp_greedy_identical(engines, mimo, k: int) -> None:
    reference = tokens(make(engines, mimo, is_mimo=True), prompts=MIMO_PROMPTS)
    llm = make(engines, mimo, "mtp", k)
    assert tokens(llm, prompts=MIMO_PROMPTS) == reference
    stats = llm.llm_engine.spec_decode_stats
    assert stats is not None and stats.num_drafts > 0


def test_mtp_lifecycle_level_2(engines, mimo) -> None:
    llm = make(engines, mimo, "mtp", k=3)
    rounds = llm.llm_engine.executor.worker.steps.spec_step.rounds
    assert rounds is not None and rounds.graphs  # greedy MTP decodes replay the fused rounds
    addresses = graph_visible(llm)
    before = tokens(llm, prompts=MIMO_PROMPTS), tokens(llm, SEEDED, MIMO_PROMPTS)
    stats = llm.llm_engine.spec_decode_stats
    assert stats is not None
    counts = (stats.num_drafts, stats.num_accepted_tokens)
    llm.llm_engine.spec_decode_stats = SpecDecodeStats()
    llm.sleep(level=2)
    llm.wake_up(["weights"])
    llm.collective_rpc("reload_weights")
    llm.wake_up(["kv_cache"])
    assert graph_visible(llm) == addresses
    replays = rounds.num_replays
    assert replays > 0
    assert (tokens(llm, prompts=MIMO_PROMPTS), tokens(llm, SEEDED, MIMO_PROMPTS)) == before
    assert rounds.num_replays == 2 * replays  # the same graphs, replayed after the cycle
    stats = llm.llm_engine.spec_decode_stats
    assert (stats.num_drafts, stats.num_accepted_tokens) == counts


@pytest.mark.parametrize("k", [1, 3])
def test_fused_rounds_equal_single_rounds_and_decoding_without_speculation(
    engines, checkpoints, k: int
) -> None:
    """Greedy decodes in 4 rounds per replay of the fused graph (``worker/spec_rounds.py``):
    the tokens and logprobs of one round per step (their own graphs), and of no speculation."""
    target, other = checkpoints
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
    reference = tokens(make(engines, target), params)
    single = make(engines, target, other, k, engine_options={"cuda_graph_multi_steps": 1})
    assert single.llm_engine.executor.worker.steps.spec_step.rounds is None
    single_outputs = single.generate(PROMPTS, params, use_tqdm=False)
    llm = make(engines, target, other, k)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.llm_engine.executor.worker.steps.spec_step.rounds.num_replays > 0
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert_same_outputs(outputs, single_outputs, tolerance=1e-5)


def test_spec_graphs_are_captured_and_match_the_eager_step(engines, checkpoints) -> None:
    target, other = checkpoints
    graphed = make(engines, target, other, k=3)
    spec_step = graphed.llm_engine.executor.worker.steps.spec_step
    assert spec_step.decoder.is_captured and spec_step.verifier.graphs
    expected = tokens(graphed), tokens(graphed, SEEDED)
    eager = make(engines, target, other, k=3, enforce_eager=True)
    assert not eager.llm_engine.executor.worker.steps.spec_step.verifier.graphs
    assert (tokens(eager), tokens(eager, SEEDED)) == expected


def test_mtp_passes_replay_graphs_and_match_eager_across_a_level_2_cycle(engines, mimo) -> None:
    """An all-decode MTP step drafts from graphs (the catch-up and each chained pass,
    ``worker/mtp_decoder.py``; one round per step, so no fused rounds): greedy tokens equal the
    eager MTP step's and decoding without speculation, the replay counter grows, and after
    sleep(2) + reload the same graphs replay at the same addresses with the same tokens and
    draft counts."""
    reference = tokens(make(engines, mimo, is_mimo=True), prompts=MIMO_PROMPTS)
    eager = make(engines, mimo, "mtp", k=3, enforce_eager=True)
    assert tokens(eager, prompts=MIMO_PROMPTS) == reference
    assert eager.llm_engine.executor.worker.steps.spec_step.mtp.num_graph_replays == 0
    llm = make(engines, mimo, "mtp", k=3, engine_options={"cuda_graph_multi_steps": 1})
    mtp = llm.llm_engine.executor.worker.steps.spec_step.mtp
    assert mtp.catch_up_graphs and mtp.step_graphs[0]  # MiMo's one layer drafts d_2, d_3
    addresses = graph_visible(llm)
    assert tokens(llm, prompts=MIMO_PROMPTS) == reference
    replays = mtp.num_graph_replays
    assert replays >= 10  # every decode step but each prompt's first
    stats = llm.llm_engine.spec_decode_stats
    counts = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    llm.llm_engine.spec_decode_stats = SpecDecodeStats()
    llm.sleep(level=2)
    llm.wake_up(["weights"])
    llm.collective_rpc("reload_weights")
    llm.wake_up(["kv_cache"])
    assert graph_visible(llm) == addresses
    assert tokens(llm, prompts=MIMO_PROMPTS) == reference
    assert mtp.num_graph_replays == 2 * replays  # the same steps replayed the same graphs
    stats = llm.llm_engine.spec_decode_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == counts
    llm.llm_engine.executor.worker.mm.verify_guards()


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_fused_rounds_equal_one_round_and_no_speculation(engines, tmp_path, k: int) -> None:
    """Greedy MTP decodes in 4 rounds per replay of the fused graph (``worker/mtp_rounds.py``),
    with a MiMo whose MTP layer accepts 0 .. k drafts per round: the tokens and logprobs of MTP
    one round per step (its own graphs) and of no speculation."""
    mimo = save_repeating_mimo(tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
    prompts = [*MIMO_PROMPTS, {"prompt_token_ids": list(range(10, 40))}]
    reference = tokens(make(engines, mimo, is_mimo=True), params, prompts)
    single = make(engines, mimo, "mtp", k, engine_options={"cuda_graph_multi_steps": 1})
    assert single.llm_engine.executor.worker.steps.spec_step.rounds is None
    single_outputs = single.generate(prompts, params, use_tqdm=False)
    llm = make(engines, mimo, "mtp", k)
    rounds = llm.llm_engine.executor.worker.steps.spec_step.rounds
    assert rounds is not None and rounds.graphs
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert rounds.num_replays >= 2
    assert int(rounds.live_top) == 2
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert_same_outputs(outputs, single_outputs, tolerance=1e-4)
    stats = llm.llm_engine.spec_decode_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    llm.llm_engine.executor.worker.mm.verify_guards()
