"""Runs one step of the model on this rank: inputs in, one sampled token per sequence out.

Decode steps replay a captured CUDA graph when one fits (GPU, ``enforce_eager=False``); prefill
and everything on the CPU run eagerly. Both paths read the same static input buffers.
"""

from __future__ import annotations

import torch

from dormant.core.config import EngineConfig
from dormant.core.step_input import StepInput
from dormant.layers.context import forward_context
from dormant.memory import MemoryManager
from dormant.models import CausalLM
from dormant.worker.cuda_graphs import DecodeGraphs
from dormant.worker.input_buffers import InputBuffers
from dormant.worker.sampler import SamplingTensors, sample


class ModelRunner:
    """Owns the static input buffers and the graphs; the model and KV cache are the worker's."""

    def __init__(
        self, config: EngineConfig, model: CausalLM, mm: MemoryManager, null_block: int
    ) -> None:
        self.config = config
        self.model = model
        self.mm = mm
        self.device = mm.backend.device
        self.inputs = InputBuffers(mm, config, null_block)
        self.graphs: DecodeGraphs | None = None

    def capture_graphs(self) -> None:
        """Captures the decode graphs once (GPU only); they are never recaptured."""
        config = self.config
        powers = [s for s in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if s < config.max_num_seqs]
        sizes = config.cuda_graph_batch_sizes or (*powers, config.max_num_seqs)
        self.graphs = DecodeGraphs(
            self.model, self.inputs, self.mm, list(sizes), config.cuda_graph_multi_steps,
            config.max_model_len,
        )  # fmt: skip
        with torch.inference_mode():
            self.graphs.capture()

    @torch.inference_mode()
    def execute(self, step: StepInput) -> list[int]:
        """Computes ``step`` and returns its sampled tokens: one device-to-host copy."""
        num_seqs = len(step.seqs)
        padded = (
            None if step.is_prefill or self.graphs is None else self.graphs.padded_size(num_seqs)
        )
        if padded is not None:
            self.inputs.load(step, pad_to=padded)
            captured = self.graphs.full[padded]  # type: ignore[union-attr]
            captured.graph.replay()
            logits = captured.output[:num_seqs]
        else:
            logits = self._eager(step)
        sampling = SamplingTensors.from_sequences(
            step.seqs, self.model.config.vocab_size, self.device
        )
        return sample(logits, sampling).tolist()

    @torch.inference_mode()
    def execute_multi_step(self, step: StepInput) -> list[list[int]]:
        """Runs the fused multi-step graph: ``num_steps`` greedy tokens per sequence.

        Preconditions: a decode step of greedy requests whose block tables already cover
        positions up to ``start_position + num_steps - 1``, within ``max_model_len``.
        """
        if self.graphs is None or not self.graphs.multi_step:
            raise RuntimeError(
                "no multi-step graph: needs a GPU, enforce_eager=False and "
                "cuda_graph_multi_steps > 1"
            )
        padded = self.graphs.padded_size(len(step.seqs))
        if step.is_prefill or padded is None:
            raise ValueError("multi-step graphs run decode batches of at most the largest size")
        self.inputs.load(step, pad_to=padded)
        captured = self.graphs.multi_step[padded]
        captured.graph.replay()
        per_step = captured.output[:, : len(step.seqs)].tolist()
        return [list(tokens) for tokens in zip(*per_step, strict=True)]

    def _eager(self, step: StepInput) -> torch.Tensor:
        meta = self.inputs.load(step)
        num_tokens, num_seqs = step.num_tokens, len(step.seqs)
        with forward_context(meta):
            hidden = self.model(
                self.inputs.input_ids[:num_tokens], self.inputs.positions[:num_tokens]
            )
        return self.model.compute_logits(hidden[self.inputs.logits_indices[:num_seqs]])
