"""A rank's model steps, once its KV cache exists: plain ones (``ModelRunner``) or, with a draft
model, speculative ones (``SpecStep``), and the CUDA graphs each captures once.

A speculative rank's decodes run its rounds rather than the plain fused multi-step graph, so its
runner captures single-step graphs only. Speculative steps read their drafts back on the way:
they run to their results, and cannot be queued behind a step in flight.
"""

from __future__ import annotations

from dormant.core.config import EngineConfig
from dormant.core.step_input import StepInput
from dormant.core.step_output import StepOutput
from dormant.memory import MemoryManager
from dormant.models import CausalLM
from dormant.worker.draft_model import DraftModel
from dormant.worker.model_runner import ModelRunner
from dormant.worker.mtp_draft import MTPDraftModel
from dormant.worker.pending_step import PendingStep
from dormant.worker.spec_step import SpecStep


class RankSteps:
    """Builds the runner (and the speculative step) over an allocated KV cache of
    ``num_blocks`` blocks plus the null block, guards their buffers, captures their graphs."""

    def __init__(
        self,
        config: EngineConfig,
        mm: MemoryManager,
        model: CausalLM,
        draft: DraftModel | MTPDraftModel | None,
        num_blocks: int,
    ) -> None:
        self.runner = ModelRunner(config, model, mm, null_block=num_blocks)
        mm.guard_addresses("model_runner.inputs", self.runner.inputs.tensors)
        # its KV, guarded, and the step that drafts and verifies
        self.spec_step = None if draft is None else SpecStep.create(self.runner, draft, num_blocks)
        if mm.backend.device.type == "cuda" and not config.enforce_eager:
            self.runner.capture_graphs(multi_steps=1 if self.spec_step is not None else None)
            if self.spec_step is not None:
                self.spec_step.capture_graphs()

    @property
    def max_multi_step_rows(self) -> int:
        """The largest batch one multi-step call takes (0: no such graph was captured)."""
        if self.spec_step is not None:
            return self.spec_step.max_rounds_rows
        graphs = self.runner.graphs
        return 0 if graphs is None else max(graphs.multi_step, default=0)

    def execute(self, step: StepInput) -> StepOutput:
        if self.spec_step is not None:
            return self.spec_step.execute(step)
        return self.runner.execute(step)

    def execute_multi_step(self, step: StepInput) -> StepOutput:
        """``cuda_graph_multi_steps`` decode steps, or speculative rounds, in one call."""
        if self.spec_step is not None:
            return self.spec_step.execute_rounds(step)
        return self.runner.execute_multi_step(step)

    def launch(self, step: StepInput, multi_step: bool = False) -> PendingStep:
        """Queues ``step`` (``execute``, or ``execute_multi_step`` when ``multi_step``) and
        returns before its results are on the host. A speculative step runs to its results,
        and one after a step in flight (``previous_rows``) raises ``ValueError``."""
        if self.spec_step is not None:
            if step.previous_rows is not None:
                raise ValueError("speculative decoding's steps cannot be queued ahead")
            run = self.execute_multi_step if multi_step else self.execute
            return PendingStep.done(run(step))
        if multi_step:
            return self.runner.launch_multi_step(step)
        return self.runner.launch(step)
