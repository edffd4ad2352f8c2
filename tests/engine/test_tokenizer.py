"""Tokenizers: the byte fallback, a local HF tokenizer, and the choice between them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dormant.engine.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    TokenizerError,
    load_tokenizer,
)

SENTENCES = ["hello world", "the quick brown fox", "hello brown fox", "the world"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny word-level tokenizer trained on SENTENCES and saved with no network access."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    model.decoder = tokenizers.decoders.WordPiece()
    trainer = tokenizers.trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"])
    model.train_from_iterator(SENTENCES, trainer)
    wrapped = transformers.PreTrainedTokenizerFast(
        tokenizer_object=model, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    path = tmp_path_factory.mktemp("hf_tokenizer")
    wrapped.save_pretrained(path)
    return path


def test_byte_tokenizer_round_trips_utf8() -> None:
    tokenizer = ByteTokenizer()
    text = "héllo, wörld ✓"
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text
    assert isinstance(tokenizer, Tokenizer)


def test_byte_tokenizer_special_ids() -> None:
    tokenizer = ByteTokenizer()
    assert tokenizer.bos_token_id == 256
    assert tokenizer.eos_token_ids == frozenset({257})
    assert tokenizer.vocab_size == 258


def test_byte_tokenizer_decode_skips_unknown_ids_and_replaces_bad_bytes() -> None:
    tokenizer = ByteTokenizer()
    assert tokenizer.decode([256, *b"ok", 257, 5000]) == "ok"
    assert tokenizer.decode([0xFF, *b"a"]) == "\ufffda"


def test_load_tokenizer_without_model_dir_is_bytes() -> None:
    assert isinstance(load_tokenizer(None, vocab_size=1000), ByteTokenizer)


def test_random_model_without_tokenizer_files_is_bytes(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    tokenizer = load_tokenizer(str(tmp_path), vocab_size=258, is_random_model=True)
    assert isinstance(tokenizer, ByteTokenizer)


def test_checkpoint_without_tokenizer_files_raises(tmp_path: Path) -> None:
    """A real checkpoint never silently gets the byte stand-in (it would make garbage text)."""
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TokenizerError, match="skip_tokenizer_init=True"):
        load_tokenizer(str(tmp_path), vocab_size=258)
    assert load_tokenizer(str(tmp_path), vocab_size=258, skip_tokenizer_init=True) is None


def test_hf_incremental_decoder_equals_full_decode(hf_dir: Path) -> None:
    tokenizer = load_tokenizer(str(hf_dir), vocab_size=64)
    assert tokenizer is not None
    prompt = tokenizer.encode("the quick")
    output = tokenizer.encode("brown fox world", add_special_tokens=False)
    decoder = tokenizer.incremental_decoder(prompt, skip_special_tokens=True)
    streamed = "".join(decoder.step(t) for t in output)
    assert streamed.strip() == tokenizer.decode(output) == "brown fox world"


def test_byte_incremental_decoder_joins_split_characters() -> None:
    decoder = ByteTokenizer().incremental_decoder([1], skip_special_tokens=True)
    pieces = [decoder.step(t) for t in "né".encode()]
    assert pieces == ["n", "", "é"]


def test_load_tokenizer_rejects_small_vocab() -> None:
    with pytest.raises(TokenizerError, match="258 ids but the model's vocabulary has only 100"):
        load_tokenizer(None, vocab_size=100)


def test_load_tokenizer_rejects_missing_dir(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing"), vocab_size=1000)


def test_hf_tokenizer_round_trips(hf_dir: Path) -> None:
    tokenizer = load_tokenizer(str(hf_dir), vocab_size=64)
    assert isinstance(tokenizer, HFTokenizer)
    assert isinstance(tokenizer, Tokenizer)
    ids = tokenizer.encode("hello brown fox")
    assert len(ids) == 3 and all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == "hello brown fox"
    eos = next(iter(tokenizer.eos_token_ids))
    assert tokenizer.decode([tokenizer.bos_token_id, *ids, eos]) == "hello brown fox"


def test_hf_tokenizer_special_ids(hf_dir: Path) -> None:
    tokenizer = HFTokenizer(str(hf_dir))
    assert tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_ids == frozenset({2})
    assert tokenizer.vocab_size == 3 + len({w for s in SENTENCES for w in s.split()})


def test_hf_tokenizer_merges_generation_config_eos(hf_dir: Path, tmp_path: Path) -> None:
    for source in hf_dir.iterdir():
        (tmp_path / source.name).write_bytes(source.read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    assert HFTokenizer(str(tmp_path)).eos_token_ids == frozenset({0, 2})
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    assert HFTokenizer(str(tmp_path)).eos_token_ids == frozenset({1, 2})


def test_hf_tokenizer_must_fit_model_vocab(hf_dir: Path) -> None:
    with pytest.raises(TokenizerError, match="vocabulary has only 4"):
        load_tokenizer(str(hf_dir), vocab_size=4)


def test_hf_tokenizer_load_failure_is_typed(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("not json")
    with pytest.raises(TokenizerError, match="cannot load a tokenizer"):
        HFTokenizer(str(tmp_path))
