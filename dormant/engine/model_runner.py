"""Runs one step of the model on this rank: inputs in, one sampled token per sequence out."""

from __future__ import annotations

import torch

from dormant.engine.config import EngineConfig
from dormant.engine.input_buffers import InputBuffers
from dormant.engine.sampler import SamplingTensors, sample
from dormant.engine.step_input import StepInput
from dormant.layers.context import forward_context
from dormant.memory import MemoryManager
from dormant.models import CausalLM


class ModelRunner:
    """Owns the static input buffers; the model and its KV cache are the worker's."""

    def __init__(self, config: EngineConfig, model: CausalLM, mm: MemoryManager) -> None:
        self.config = config
        self.model = model
        self.device = mm.backend.device
        self.inputs = InputBuffers(mm, config)

    @torch.inference_mode()
    def execute(self, step: StepInput) -> list[int]:
        """Computes ``step`` and returns its sampled tokens: one device-to-host copy."""
        meta = self.inputs.load(step)
        num_tokens, num_seqs = step.num_tokens, len(step.seqs)
        with forward_context(meta):
            hidden = self.model(
                self.inputs.input_ids[:num_tokens], self.inputs.positions[:num_tokens]
            )
        logits = self.model.compute_logits(hidden[self.inputs.logits_indices[:num_seqs]])
        sampling = SamplingTensors.from_sequences(
            step.seqs, self.model.config.vocab_size, self.device
        )
        return sample(logits, sampling).tolist()
