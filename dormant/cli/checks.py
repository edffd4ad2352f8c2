"""Checks the command line makes before any model loads, each failing with a sentence that
says what to do (``UsageError``: one line, exit code 2)."""

from __future__ import annotations

import os

DEVICES = ("auto", "cuda", "cpu")


class UsageError(Exception):
    """A mistake on the command line; its message is the whole answer."""


def check_model_dir(path: str, *, allow_random: bool = False) -> None:
    if not os.path.exists(path):
        raise UsageError(f"{path!r} does not exist; give a Hugging Face model directory")
    if not os.path.isdir(path):
        raise UsageError(f"{path!r} is a file; give the model's directory (with config.json)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UsageError(
            f"{path!r} has no config.json, so it is not a Hugging Face model directory; give "
            "the directory that holds config.json and the *.safetensors files"
        )
    if not allow_random and not any(f.endswith(".safetensors") for f in os.listdir(path)):
        raise UsageError(
            f"{path!r} has no *.safetensors weights; give a checkpoint directory, or "
            "--load-format dummy for random weights"
        )


def check_device(device: str) -> None:
    if device not in DEVICES:
        raise UsageError(f"--device {device!r} is not one of {', '.join(DEVICES)}")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError(
                "--device cuda, but PyTorch sees no CUDA GPU here; use --device cpu (or auto)"
            )
