"""MTP inside the fused speculative rounds (issue 19), on the CPU, with the tiny MiMo: the rounds'
body is "captured" eagerly (``worker/eager_graphs.py``), so greedy MTP decodes replay
``cuda_graph_multi_steps`` rounds of (MTP catch-up, chained drafts, verify, accept, feed back)
as on a GPU (``worker/mtp_rounds.py``). Greedy tokens and logprobs equal decoding without
speculation and MTP one round per step; every pass the replay runs (ids, positions, slots,
sequence lengths, the catch-up's valid and last positions, and the drafts) is the one the single
rounds run for the same rows (``SpecLayout.of`` with lag 1, padded); the acceptance counts are
theirs; a level-2 sleep and reload change nothing."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dormant import LLM, SamplingParams
from dormant.engine.spec_stats import SpecDecodeStats
from dormant.worker.mtp_decoder import MTPDecoder
from dormant.worker.target_verifier import TargetVerifier
from tests.engine.conftest import tokens
from tests.engine.test_spec_rounds import assert_same_logprobs, eager_rounds, replays

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from tiny_mimo import save_tiny_mimo

__all__ = ["eager_rounds"]  # the fixture, used by name

ROUNDS = 4
OPTIONS = dict(
    device="cpu", max_model_len=128, max_num_seqs=8, kv_cache_memory_bytes=4 << 20,
    skip_tokenizer_init=True, cuda_graph_multi_steps=ROUNDS,
)  # fmt: skip
PROMPTS = [{"prompt_token_ids": p} for p in ([5, 17, 99, 3, 50, 42], [7, 7, 7], [*range(10, 40)])]
LOGPROBS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)


def save_repeating_mimo(path: Path) -> Path:
    """A tiny MiMo whose MTP layer mostly repeats its input token (a strong identity on the
    token half of its input projection, tied embeddings, the layer's other weights random): the
    target's greedy output has runs of one token, so rounds accept 0 .. k drafts and every
    catch-up length from 1 to k + 1 occurs."""
    _, tensors = save_tiny_mimo(path, num_mtp_layers=1, tie_word_embeddings=True)
    prefix = "model.mtp_layers.0."
    projection = tensors[prefix + "input_proj.weight"]
    hidden = projection.shape[0]
    projection[:, hidden:] += 4.0 * torch.eye(hidden)
    for leaf in ("token_layernorm.weight", "final_layernorm.weight"):
        tensors[prefix + leaf] = torch.ones_like(tensors[prefix + leaf])
    save_file(tensors, path / "model.safetensors")
    return path


@pytest.fixture(scope="module")
def mimo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_repeating_mimo(tmp_path_factory.mktemp("mimo_rounds"))


@pytest.fixture
def make() -> Iterator:
    made: list[LLM] = []

    def make(path: Path, k: int | None = 3, **options: object) -> LLM:
        if k is not None:
            options["speculative_config"] = {"method": "mtp", "num_speculative_tokens": k}
        llm = LLM(str(path), **{**OPTIONS, **options})  # type: ignore[arg-type]
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.shutdown()


def spec_step(llm: LLM):  # type: ignore[no-untyped-def]
    return llm.llm_engine.executor.worker.steps.spec_step


def counts(llm: LLM) -> tuple:
    stats = llm.llm_engine.spec_decode_stats
    return (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
            tuple(stats.num_accepted_tokens_per_pos))  # fmt: skip


@pytest.mark.usefixtures("eager_rounds")
@pytest.mark.parametrize("k", [1, 3])
def test_mtp_rounds_equal_no_speculation_and_one_round_per_step(make, mimo, k: int) -> None:
    plain = make(mimo, k=None).generate(PROMPTS, LOGPROBS, use_tqdm=False)
    one_round = make(mimo, k, cuda_graph_multi_steps=1)
    assert spec_step(one_round).rounds is None
    single = one_round.generate(PROMPTS, LOGPROBS, use_tqdm=False)
    llm = make(mimo, k)
    outputs = llm.generate(PROMPTS, LOGPROBS, use_tqdm=False)
    assert tokens(outputs) == tokens(plain) == tokens(single)
    assert_same_logprobs(outputs, plain)
    assert_same_logprobs(outputs, single)
    assert replays(llm) >= 2  # 40 tokens per row, up to 4 (k + 1) per replay
    rounds = spec_step(llm).rounds
    assert int(rounds.live_top) == 2  # the top logprobs the batch asked for, of 20 carried
    llm.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False
    )
    assert int(rounds.live_top) == 0


class PassLog:
    """Every MTP pass and verification on the worker's static buffers: for each real row (its
    block table not the null block's), what the pass reads and the argmax it proposes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.records: dict[int, list[tuple]] = {}  # id(the MTP decoder) -> its passes
        self.logits: dict[int, list[float]] = {}  # -> their rows' top logits, in order
        body, forward = MTPDecoder._body, TargetVerifier._forward
        log = self

        def logged_body(self: MTPDecoder, num_rows: int, layer: int | None) -> torch.Tensor:
            width = self.width if layer is None else 1
            rows = log.rows(self.inputs, num_rows, width, self.null_block)
            if layer is None:  # the catch-up: which positions are real, and the last one
                valid, last = self.valid[: num_rows * width].view(num_rows, width), self.last
                rows = [(n, (*r, valid[n].tolist(), int(last[n]) - n * width)) for n, r in rows]
            logits = body(self, num_rows, layer)
            log.add(self, layer, rows, logits)
            return logits

        def logged_forward(self: TargetVerifier, num_rows: int) -> torch.Tensor:
            rows = log.rows(self.inputs, num_rows, self.width, self.null_block)
            logits = forward(self, num_rows)
            log.add(self, "verify", rows, logits.view(num_rows, self.width, -1))
            return logits

        monkeypatch.setattr(MTPDecoder, "_body", logged_body)
        monkeypatch.setattr(TargetVerifier, "_forward", logged_forward)

    def add(self, owner: object, name: object, rows: list, logits: torch.Tensor) -> None:
        """A pass of ``owner``'s: each real row's inputs, its argmax and the logit there
        (``logits[row]``: [V] or [k + 1, V]), which depend on every hidden state it read."""
        best, top = logits.argmax(dim=-1), logits.amax(dim=-1)
        passes = self.records.setdefault(id(owner), [])
        passes.append((name, [(*r, best[n].tolist()) for n, r in rows]))
        self.logits.setdefault(id(owner), []).extend(v for n, _ in rows for v in
                                                     top[n].reshape(-1).tolist())  # fmt: skip

    @staticmethod
    def rows(inputs, num_rows: int, width: int, null_block: int) -> list[tuple[int, tuple]]:  # type: ignore[no-untyped-def]
        """(row, what it reads) of each real row among the pass's first ``num_rows``."""
        out = []
        starts = inputs.query_start_loc[: num_rows + 1].tolist()
        for n in range(num_rows):
            table = inputs.block_tables[n]
            if int(table[0]) == null_block:
                continue  # a padding row
            first, end = n * width, (n + 1) * width
            assert starts[n + 1] - starts[n] == width
            seq_len = int(inputs.seq_lens[n])
            blocks = table[: -(-seq_len // inputs.block_size)].tolist()
            out.append((n, (
                inputs.input_ids[first:end].tolist(), inputs.positions[first:end].tolist(),
                inputs.slot_mapping[first:end].tolist(), seq_len, blocks,
            )))  # fmt: skip
        return out


@pytest.mark.usefixtures("eager_rounds")
def test_mtp_rounds_run_the_passes_of_single_rounds(make, mimo, monkeypatch) -> None:
    """Two engines scheduling the same rounds: one replays them fused, the other runs them as
    single padded MTP steps (``SpecRounds.fits`` refused). Every pass reads the same indices and
    tokens for the same rows and proposes the same drafts, and the acceptance counts agree."""
    log = PassLog(monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    single = make(mimo, k=3)
    spec_step(single).rounds.fits = lambda *args: False
    expected = single.generate(PROMPTS, params, use_tqdm=False)
    llm = make(mimo, k=3)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert tokens(outputs) == tokens(expected)
    assert replays(single) == 0 and replays(llm) >= 2
    assert single.llm_engine.scheduler.config.num_decode_steps == ROUNDS  # rounds planned
    ours = log.records[id(spec_step(llm).mtp)] + log.records[id(spec_step(llm).verifier)]
    theirs = log.records[id(spec_step(single).mtp)] + log.records[id(spec_step(single).verifier)]
    assert len(ours) == len(theirs) > 3 * ROUNDS * 3
    assert ours == theirs
    for owner in ("mtp", "verifier"):
        ours_top = log.logits[id(getattr(spec_step(llm), owner))]
        assert ours_top == pytest.approx(
            log.logits[id(getattr(spec_step(single), owner))], abs=1e-4
        )
    stats = llm.llm_engine.spec_decode_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # catch-ups of 1 .. k + 1
    assert counts(llm) == counts(single)


@pytest.mark.usefixtures("eager_rounds")
def test_mtp_rounds_after_a_level_2_sleep_and_reload_are_unchanged(make, mimo) -> None:
    llm = make(mimo, k=3, enable_sleep_mode=True)
    before = llm.generate(PROMPTS, LOGPROBS, use_tqdm=False)
    before_counts, replays_before = counts(llm), replays(llm)
    assert replays_before > 0
    llm.sleep(level=2)
    llm.wake_up(["weights"])
    llm.collective_rpc("reload_weights")
    llm.wake_up(["kv_cache"])
    llm.llm_engine.spec_decode_stats = SpecDecodeStats()  # counted afresh
    after = llm.generate(PROMPTS, LOGPROBS, use_tqdm=False)
    assert tokens(after) == tokens(before)
    assert_same_logprobs(after, before)
    assert replays(llm) == 2 * replays_before
    assert counts(llm) == before_counts
