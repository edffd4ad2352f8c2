"""Reading safetensors checkpoints: one file, or shards listed in
``model.safetensors.index.json``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def safetensors_files(path: str | Path) -> list[Path]:
    """The checkpoint files at ``path``: the file itself, the shards named by the index in a
    directory, or the directory's single ``model.safetensors``."""
    path = Path(path)
    if path.is_file():
        return [path]
    index = path / INDEX_FILE
    if index.is_file():
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    single = path / SINGLE_FILE
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")


def iterate_safetensors(path: str | Path) -> Iterator[tuple[str, Tensor]]:
    """Yields ``(name, cpu tensor)`` for every tensor of the checkpoint, one file at a time."""
    for file in safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                yield name, f.get_tensor(name)


def iterate_safetensors_metadata(
    path: str | Path,
) -> Iterator[tuple[str, torch.Size, torch.dtype]]:
    """Yields ``(name, shape, dtype)`` without reading tensor data (for ``check_weights``)."""
    for file in safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118
                tensor_slice = f.get_slice(name)
                dtype_name = tensor_slice.get_dtype()
                if dtype_name not in _SAFETENSORS_DTYPES:
                    raise ValueError(f"{file}: tensor {name} has unsupported dtype {dtype_name}")
                yield name, torch.Size(tensor_slice.get_shape()), _SAFETENSORS_DTYPES[dtype_name]
