"""Safetensors iteration: one file, a directory, sharded checkpoints, metadata only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dormant.models import iterate_safetensors, iterate_safetensors_metadata
from dormant.models.loader import safetensors_files

TENSORS = {"a": torch.arange(6.0).view(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}


def test_single_file_by_directory_and_by_path(tmp_path: Path) -> None:
    save_file(TENSORS, tmp_path / "model.safetensors")
    for path in (tmp_path, tmp_path / "model.safetensors"):
        loaded = dict(iterate_safetensors(path))
        assert loaded.keys() == TENSORS.keys()
        assert all(torch.equal(loaded[k], v) for k, v in TENSORS.items())


def test_sharded_by_index(tmp_path: Path) -> None:
    save_file({"a": TENSORS["a"]}, tmp_path / "model-00002-of-00002.safetensors")
    save_file({"b": TENSORS["b"]}, tmp_path / "model-00001-of-00002.safetensors")
    weight_map = {"a": "model-00002-of-00002.safetensors", "b": "model-00001-of-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert [p.name for p in safetensors_files(tmp_path)] == sorted(set(weight_map.values()))
    assert dict(iterate_safetensors(tmp_path)).keys() == {"a", "b"}
    metadata = sorted(iterate_safetensors_metadata(tmp_path))
    assert metadata == [
        ("a", torch.Size([2, 3]), torch.float32),
        ("b", torch.Size([4]), torch.bfloat16),
    ]


def test_missing_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        list(iterate_safetensors(tmp_path))
