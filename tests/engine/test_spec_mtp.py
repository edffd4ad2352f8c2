"""Speculative decoding with MTP layers (``{"method": "mtp"}``, Xiaomi MiMo's layout), on the
CPU: greedy output identical to decoding without it (k = 1, 3, 5); each step's first draft is
what the MTP layer predicts from the target's hidden states (a plain-torch reference, which
checks the hidden cache the drafts read across steps); a level-2 sleep leaves the MTP layers
stale until refit, and reload_weights (or a flattened bucket of the whole checkpoint, MTP names
included) brings back the very same drafts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from dormant import LLM, SamplingParams
from dormant.core.errors import UnsupportedOptionError, WeightsNotLoadedError
from dormant.models import ModelConfig, iterate_safetensors
from dormant.worker import spec_drafter
from dormant.worker.ipc_weights import FLATTENED_BUCKET, flattened_bucket_request
from tests.engine.conftest import tokens

# tests/models is not a package: its modules import each other by their plain names
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from test_mtp import _hf_pre_norm_hidden, reference_mtp
from tiny_mimo import save_tiny_mimo

OPTIONS = dict(
    device="cpu", max_model_len=128, max_num_seqs=8, kv_cache_memory_bytes=4 << 20,
    skip_tokenizer_init=True,
)  # fmt: skip
PROMPTS = [[5, 17, 99, 3, 50, 42], [7, 7, 7], list(range(10, 40))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def mimo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object, dict]:
    path = tmp_path_factory.mktemp("mimo_engine")
    hf_model, tensors = save_tiny_mimo(path, num_mtp_layers=1)
    return path, hf_model, tensors


@pytest.fixture(scope="module")
def reference(mimo: tuple) -> list[tuple[int, ...]]:
    llm = LLM(str(mimo[0]), **OPTIONS)
    try:
        return tokens(llm.generate(_prompts(), GREEDY, use_tqdm=False))
    finally:
        llm.shutdown()


def _prompts() -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": p} for p in PROMPTS]


def make(engines: list[LLM], path: Path, k: int = 3) -> LLM:
    spec = {"method": "mtp", "num_speculative_tokens": k}
    llm = LLM(str(path), speculative_config=spec, **OPTIONS)
    engines.append(llm)
    return llm


@pytest.fixture
def first_drafts(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """(context length, prompt's first token, first draft) of every drafting row of every step."""
    seen: list[tuple[int, int, int]] = []
    original = spec_drafter.Drafter.propose

    def spy(self, seqs, layout, views):  # type: ignore[no-untyped-def]
        drafts, probs = original(self, seqs, layout, views)
        for n, row in enumerate(layout.spec_rows):
            seq = seqs[row]
            seen.append((seq.seq_len, seq.draft_start, int(drafts[n, 0])))
        return drafts, probs

    monkeypatch.setattr(spec_drafter.Drafter, "propose", spy)
    return seen


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_identical_with_mtp(engines, mimo, reference, k: int) -> None:
    llm = make(engines, mimo[0], k)
    assert tokens(llm.generate(_prompts(), GREEDY, use_tqdm=False)) == reference
    stats = llm.llm_engine.spec_decode_stats
    assert stats is not None and stats.num_drafts > 0


def test_first_drafts_are_the_mtp_layers_prediction(engines, mimo, first_drafts) -> None:
    """One request at a time, so each step's drafting row is known: its context is the prompt
    and the outputs so far. d_1 predicts position L from h_{L-2} and the token at L - 1."""
    path, hf_model, tensors = mimo
    llm = make(engines, path, k=3)
    config = ModelConfig.from_pretrained(str(path))
    checked = 0
    for prompt in PROMPTS:
        first_drafts.clear()
        output = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
        context = [*prompt, *output.outputs[0].token_ids]
        for length, _, draft in first_drafts:
            seq = context[:length]  # L tokens; the newest is at L - 1
            with torch.no_grad():
                hidden = _hf_pre_norm_hidden(hf_model, seq[:-1])  # h_0 .. h_{L-2}
                logits = reference_mtp(tensors, 0, config, torch.tensor(seq[1:]), hidden)
            assert draft == int(logits[-1].argmax())
            checked += 1
    assert checked >= 10


def test_drafts_after_a_prefix_cache_hit_are_the_mtp_layers_prediction(
    engines, mimo, first_drafts
) -> None:
    """A request that found its first block cached (from one that never decoded, so never
    wrote its prompt's MTP KV) drafts what the MTP layer predicts: the draft catches up over
    the cached prefix (it took the cached blocks' unwritten draft KV as exact: 2 of 10 drafts
    were off, with tokens unchanged only because verification rejects them)."""
    path, hf_model, tensors = mimo
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    llm = LLM(str(path), speculative_config=spec, block_size=16, **OPTIONS)
    engines.append(llm)
    shared = list(range(20, 36))  # one full block
    first = {"prompt_token_ids": [*shared, 5, 6, 7]}
    llm.generate([first], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    first_drafts.clear()
    prompt = [*shared, 9, 8]
    output = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    assert output.num_cached_tokens == 16
    context = [*prompt, *output.outputs[0].token_ids]
    config = ModelConfig.from_pretrained(str(path))
    for length, _, draft in first_drafts:
        seq = context[:length]
        with torch.no_grad():
            hidden = _hf_pre_norm_hidden(hf_model, seq[:-1])
            logits = reference_mtp(tensors, 0, config, torch.tensor(seq[1:]), hidden)
        assert draft == int(logits[-1].argmax())
    assert len(first_drafts) >= 5


def test_level_2_sleep_and_refit_of_the_mtp_layers(engines, mimo, first_drafts) -> None:
    path = mimo[0]
    llm = make(engines, path, k=3)
    before = tokens(llm.generate(_prompts(), GREEDY, use_tqdm=False))
    drafts_before = list(first_drafts)
    llm.sleep(level=2)
    llm.wake_up(["weights"])
    target_only = [(n, t) for n, t in iterate_safetensors(str(path)) if "mtp_layers" not in n]
    llm.update_weights(target_only)
    llm.wake_up(["kv_cache"])
    with pytest.raises(WeightsNotLoadedError, match="mtp_layers"):
        llm.generate(_prompts(), GREEDY, use_tqdm=False)
    llm.collective_rpc("reload_weights")
    first_drafts.clear()
    assert tokens(llm.generate(_prompts(), GREEDY, use_tqdm=False)) == before
    assert first_drafts == drafts_before  # the same drafts: the MTP layers were refit


def test_mtp_names_refit_the_mtp_layers(engines, mimo, first_drafts) -> None:
    path = mimo[0]
    llm = make(engines, path, k=2)
    before = tokens(llm.generate(_prompts(), GREEDY, use_tqdm=False))
    drafts_before = list(first_drafts)
    mtp = [(n, t) for n, t in iterate_safetensors(str(path)) if "mtp_layers" in n]
    llm.update_weights([(n, torch.zeros_like(t)) for n, t in mtp])
    first_drafts.clear()
    assert tokens(llm.generate(_prompts(), GREEDY, use_tqdm=False)) == before
    assert first_drafts != drafts_before  # zeroed layers draft something else
    llm.update_weights(mtp)
    first_drafts.clear()
    llm.generate(_prompts(), GREEDY, use_tqdm=False)
    assert first_drafts == drafts_before


def test_mtp_needs_a_checkpoint_with_mtp_layers(checkpoint: Path) -> None:
    with pytest.raises(UnsupportedOptionError, match="MTP layers"):
        LLM(str(checkpoint), speculative_config={"method": "mtp", "num_speculative_tokens": 2},
            **OPTIONS)  # fmt: skip


def test_a_flattened_bucket_refits_the_mtp_layers_after_a_level_2_sleep(
    engines, mimo, first_drafts
) -> None:
    """The whole checkpoint, MTP names as they are, in one bucket of shared handles."""
    path = mimo[0]
    llm = make(engines, path, k=2)
    before = tokens(llm.generate(_prompts(), GREEDY, use_tqdm=False))
    drafts_before = list(first_drafts)
    llm.sleep(level=2)
    llm.wake_up(["weights"])
    entries, _flat = flattened_bucket_request(list(iterate_safetensors(str(path))))
    llm.update_weights_from_tensor(entries, load_format=FLATTENED_BUCKET)
    llm.wake_up(["kv_cache"])
    first_drafts.clear()
    assert tokens(llm.generate(_prompts(), GREEDY, use_tqdm=False)) == before
    assert first_drafts == drafts_before  # the MTP layers were refit from the bucket


def test_a_bucket_with_mtp_names_refits_a_target_without_speculation(mimo, reference) -> None:
    """Without MTP the target skips the MTP names, in a bucket as in ``load_weights``."""
    llm = LLM(str(mimo[0]), **OPTIONS)
    try:
        llm.sleep(level=2)
        llm.wake_up()
        entries, _flat = flattened_bucket_request(list(iterate_safetensors(str(mimo[0]))))
        llm.update_weights_from_tensor(entries, load_format=FLATTENED_BUCKET)
        assert tokens(llm.generate(_prompts(), GREEDY, use_tqdm=False)) == reference
    finally:
        llm.shutdown()


def test_the_model_objects_load_weights_refits_the_mtp_layers(engines, mimo, first_drafts) -> None:
    """TRL's and OpenRLHF's path, ``driver_worker.model_runner.model.load_weights``, one
    tensor per call after a level-2 sleep: the MTP names reach the MTP layers (the target alone
    would skip them, leaving the draft stale)."""
    path = mimo[0]
    llm = make(engines, path, k=2)
    before = tokens(llm.generate(_prompts(), GREEDY, use_tqdm=False))
    drafts_before = list(first_drafts)
    llm.sleep(level=2)
    llm.wake_up(["weights"])
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    for name, tensor in iterate_safetensors(str(path)):
        model.load_weights([(name, tensor)])
    llm.wake_up(["kv_cache"])
    first_drafts.clear()
    assert tokens(llm.generate(_prompts(), GREEDY, use_tqdm=False)) == before
    assert first_drafts == drafts_before


def _stand_in_graphs(llm: LLM, size: int = 8) -> list[int | None]:
    """Replaces the MTP decoder's graphs by stand-ins at batch size ``size`` that run the
    captured body eagerly (as a replay would, padding rows included); returns the replays'
    layers as they happen (None: the catch-up)."""
    mtp = llm.llm_engine.executor.worker.steps.spec_step.mtp
    vocab = llm.llm_engine.config.model_config.vocab_size
    replays: list[int | None] = []

    def stand_in(layer: int | None) -> tuple[object, torch.Tensor]:
        output = torch.empty((size, vocab))

        class Graph:
            def replay(self) -> None:
                replays.append(layer)
                output.copy_(mtp._body(size, layer))

        return Graph(), output

    mtp.catch_up_graphs = {size: stand_in(None)}
    mtp.step_graphs = {layer: {size: stand_in(layer)} for layer in mtp._chained_layers()}
    return replays


def test_mtp_passes_padded_to_graph_sizes_change_nothing(engines, mimo, reference, first_drafts):
    """An all-decode MTP step drafts through the static passes that replay graphs on a GPU
    (``mtp_decoder.py``): padded to a graph's batch size with dummy rows in the null block (the
    "graph" replays the captured body eagerly), the tokens and every step's first draft are as
    without padding, and the path was taken."""
    path = mimo[0]
    eager = make(engines, path, k=3)
    assert tokens(eager.generate(_prompts(), GREEDY, use_tqdm=False)) == reference
    expected = list(first_drafts)
    first_drafts.clear()
    llm = make(engines, path, k=3)
    replays = _stand_in_graphs(llm)
    assert tokens(llm.generate(_prompts(), GREEDY, use_tqdm=False)) == reference
    assert first_drafts == expected
    assert replays.count(None) >= 10 and replays.count(0) == 2 * replays.count(None)
    assert llm.llm_engine.executor.worker.steps.spec_step.mtp.num_graph_replays == len(replays)


def test_a_padding_that_writes_a_real_block_changes_the_drafts(engines, mimo, first_drafts):
    """The test above can fail: dummy rows that write block 0 (a sequence's) instead of the
    null block corrupt the MTP layers' KV there, and the drafts change."""
    path = mimo[0]
    eager = make(engines, path, k=3)
    eager.generate(_prompts(), GREEDY, use_tqdm=False)
    expected = list(first_drafts)
    first_drafts.clear()
    llm = make(engines, path, k=3)
    _stand_in_graphs(llm)
    llm.llm_engine.executor.worker.steps.spec_step.mtp.null_block = 0
    llm.generate(_prompts(), GREEDY, use_tqdm=False)
    assert first_drafts != expected
