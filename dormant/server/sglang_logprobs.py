"""SGLang's logprob fields of ``/generate``'s ``meta_info`` with ``return_logprob`` (its
``TokenizerManager.add_logprob_to_meta_info``), built from dormant's vLLM-shaped outputs.

| key                           | entries                                                    |
|-------------------------------|------------------------------------------------------------|
| input_token_logprobs          | ``[logprob, token id, text]`` for each of ``prompt[start:]``; |
|                               | the first one's logprob is None                            |
| output_token_logprobs         | ``[logprob, token id, text]`` per generated token          |
| output_token_logprobs_length  | how many ``output_token_logprobs`` there are               |
| input_top_logprobs (top > 0)  | per input entry: None for the first, else its top ``k``    |
| output_top_logprobs (top > 0) | per generated token: its top ``k``, most likely first      |

``text`` is None unless ``return_text_in_logprobs``. ``start`` is ``logprob_start_len`` resolved
as SGLang's scheduler does (``Scheduler.handle_generate_request``): -1 is the prompt's length
(no input entries: the output's logprobs only), ``0 .. len(prompt)`` the first prompt position
returned, anything larger a 400. The first input entry has no logprob whatever ``start`` is:
SGLang computes a position's logprob from the logits of the position before, which it computes
only from ``start`` on (``input_token_logprobs_val = [None] + input_token_logprobs[:-1]``).

The engine computes the logprobs of every prompt position (vLLM's ``prompt_logprobs``), and only
when some prompt has an input entry after its first; the entries before ``start`` are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dormant.engine.outputs import CompletionOutput, LogprobsOnePosition, RequestOutput
from dormant.server.errors import BadRequestError
from dormant.server.responses import token_texts
from dormant.server.serving import Prepared

Entry = list[Any]  # [logprob or None, token id, text or None]


def resolve_start(logprob_start_len: int, num_prompt_tokens: int) -> int:
    """The first prompt position ``input_token_logprobs`` covers; raises BadRequestError past
    the prompt (SGLang aborts such a request with a 400)."""
    if logprob_start_len == -1:
        return num_prompt_tokens
    if logprob_start_len > num_prompt_tokens:
        raise BadRequestError(
            f"logprob_start_len={logprob_start_len} is higher than the number of input tokens "
            f"({num_prompt_tokens}); give at most {num_prompt_tokens}, or -1 for the output "
            "tokens' logprobs only"
        )
    return logprob_start_len


class SGLangLogprobs:
    """One ``/generate`` call's logprob fields. ``num_output`` and ``num_prompt`` are the
    ``logprobs`` and ``prompt_logprobs`` to ask the engine for (None: none)."""

    def __init__(
        self,
        prompts: Sequence[Prepared],
        return_logprob: bool,
        logprob_start_len: int,
        top_logprobs_num: int,
        tokenizer: Any,
        return_text: bool,
    ) -> None:
        self.top, self.tokenizer, self.return_text = top_logprobs_num, tokenizer, return_text
        lengths = [len(p.token_ids) for p in prompts]
        self.starts: list[int] = []  # without return_logprob, SGLang ignores logprob_start_len
        if return_logprob:
            self.starts = [resolve_start(logprob_start_len, n) for n in lengths]
        self.num_output = top_logprobs_num if return_logprob else None
        # Entry 0 has no logprob: prompt logprobs are needed only where there is an entry 1.
        is_needed = return_logprob and any(
            s < n - 1 for s, n in zip(self.starts, lengths, strict=True)
        )
        self.num_prompt = top_logprobs_num if is_needed else None
        self._inputs: dict[int, dict[str, Any]] = {}  # per prompt, once its logprobs are in

    def fields(
        self, prompt_index: int, output: RequestOutput, completion: CompletionOutput
    ) -> dict[str, Any]:
        """The keys for ``completion``, a sample of prompt ``prompt_index``."""
        inputs = self._inputs.get(prompt_index) or self._input_fields(prompt_index, output)
        positions = completion.logprobs or []
        chosen = [
            [pos[t].logprob, t, None]
            for t, pos in zip(completion.token_ids, positions, strict=False)
        ]
        result: dict[str, Any] = {
            "input_token_logprobs": inputs["input_token_logprobs"],
            "output_token_logprobs": self._with_texts(chosen),
            "output_token_logprobs_length": len(chosen),
        }
        if self.top > 0:  # as SGLang: these keys only when asked for
            result["input_top_logprobs"] = inputs["input_top_logprobs"]
            result["output_top_logprobs"] = [self._top(pos) for pos in positions]
        return result

    def _input_fields(self, prompt_index: int, output: RequestOutput) -> dict[str, Any]:
        prompt_ids = list(output.prompt_token_ids)
        start = self.starts[prompt_index]
        ids = prompt_ids[start:]
        positions = output.prompt_logprobs or []
        if len(ids) > 1 and len(positions) < len(prompt_ids):
            # Not computed (aborted before its prefill): SGLang's abort sends no input entries.
            return {"input_token_logprobs": [], "input_top_logprobs": []}
        entries: list[Entry] = [[None, ids[0], None]] if ids else []
        tops: list[list[Entry] | None] = [None] if ids else []
        for t, pos in zip(ids[1:], positions[start + 1 :], strict=True):
            assert pos is not None  # only a prompt's first position has none
            entries.append([pos[t].logprob, t, None])
            if self.top > 0:
                tops.append(self._top(pos))
        fields = {"input_token_logprobs": self._with_texts(entries), "input_top_logprobs": tops}
        self._inputs[prompt_index] = fields
        return fields

    def _top(self, position: LogprobsOnePosition) -> list[Entry]:
        """The top ``top`` of one position (ranks 1..top: the chosen token only if among them)."""
        ranked = sorted(position.items(), key=lambda item: item[1].rank or 0)
        top = [[lp.logprob, t, None] for t, lp in ranked if 0 < (lp.rank or 0) <= self.top]
        return self._with_texts(top)

    def _with_texts(self, entries: list[Entry]) -> list[Entry]:
        if self.return_text:
            texts = token_texts(self.tokenizer, [e[1] for e in entries])
            for entry, text in zip(entries, texts, strict=True):
                entry[2] = text
        return entries
