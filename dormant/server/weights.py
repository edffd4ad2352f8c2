"""Checks before ``/update_weights_from_disk`` lets the engine read a checkpoint:

1. the directory lies below one of ``--allowed-weight-dirs`` (none given: every path is
   refused), after resolving symlinks; a path outside gets the same answer whether it exists
   or not, so the server cannot be used to probe the file system;
2. every weight file, and every file a ``*.safetensors.index.json`` names, resolves inside the
   directory (no ``..``, no absolute names, no symlinks out);
3. every tensor is finite (no NaN or Inf), checked on the engine's device one tensor at a time
   (``torch.isfinite(t).all()``), before anything is written.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from dormant.server.errors import BadRequestError, ForbiddenError


def checked_weight_dir(model_path: str, allowed_roots: Sequence[Path]) -> Path:
    """The resolved checkpoint directory, or a refusal that says nothing about the path."""
    if not allowed_roots:
        raise ForbiddenError(
            "this server loads weights from disk only below --allowed-weight-dirs, and none "
            "was given; restart it with --allowed-weight-dirs DIR"
        )
    resolved = Path(os.path.realpath(model_path))
    roots = [Path(os.path.realpath(root)) for root in allowed_roots]
    if not any(resolved == root or resolved.is_relative_to(root) for root in roots):
        raise ForbiddenError(
            "model_path must name a checkpoint directory below one of the allowed weight "
            f"directories ({', '.join(str(r) for r in allowed_roots)})"
        )
    if not resolved.is_dir() or not any(resolved.glob("*.safetensors")):
        raise BadRequestError(
            f"no safetensors checkpoint in {model_path!r} (inside the allowed directories)"
        )
    return resolved


def weight_files(directory: Path) -> list[Path]:
    """Every weight file of the checkpoint, each checked to lie inside ``directory``."""
    names = {p.name for p in directory.glob("*.safetensors")}
    for index in directory.glob("*.safetensors.index.json"):
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as error:
            raise BadRequestError(f"{index.name} is not a safetensors index: {error}") from error
        if not isinstance(weight_map, dict):
            raise BadRequestError(f"{index.name}: weight_map must be an object")
        names.update(str(v) for v in weight_map.values())
    files = []
    for name in sorted(names):
        path = Path(os.path.realpath(directory / name))
        if os.path.isabs(name) or path.parent != directory:
            raise BadRequestError(
                f"the checkpoint names a weight file outside its directory ({name!r}); "
                "every weight file must be in the checkpoint directory itself"
            )
        files.append(path)
    return files


def check_finite(files: Sequence[Path], device: str | torch.device) -> int:
    """Raises BadRequestError naming the first tensor with a NaN or Inf; returns the bytes
    checked. Reads one tensor at a time onto ``device`` and checks it there."""
    from safetensors import safe_open

    nbytes = 0
    for path in files:
        with safe_open(str(path), framework="pt", device=str(device)) as file:
            for name in file.keys():  # noqa: SIM118 - safe_open has no __iter__
                tensor = file.get_tensor(name)
                nbytes += tensor.numel() * tensor.element_size()
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    raise BadRequestError(
                        f"weight {name!r} in {path.name} holds NaN or Inf values; nothing was "
                        "written (the served weights are unchanged)"
                    )
                del tensor
    return nbytes
