"""Rollout logprobs against the trainer's: dormant's sampled-token logprobs (bf16, CUDA graphs)
against Hugging Face ``transformers``' teacher-forced ``log_softmax`` of the same tokens over the
same weights, on the GPU. Prints the max and mean absolute difference, per sampling mode.

    python benchmarks/logprobs_vs_hf.py [--out results.jsonl] [--dtype bfloat16]

This is the number RL users watch for training/inference mismatch; it is recorded, not asserted.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from benchmarks.common import Recorder
from dormant import LLM, SamplingParams

PROMPTS = [[5 + i, 17, 99, 3, 250 + i, 42, 7 * i + 1] for i in range(16)]
CONFIG = dict(
    vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
    num_attention_heads=16, num_key_value_heads=8, head_dim=64, max_position_embeddings=2048,
    initializer_range=0.02, tie_word_embeddings=False, eos_token_id=31999,
    architectures=["Qwen3ForCausalLM"],
)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tiny", action="store_true", help="a tiny model, on the CPU")
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    if args.tiny:
        CONFIG.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=512)
        CONFIG.update(num_attention_heads=4, num_key_value_heads=2, head_dim=16, eos_token_id=511)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(Qwen3Config(**CONFIG, torch_dtype=args.dtype)).to(device, dtype).eval()
    recorder = Recorder(args.out)
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(Path(folder), safe_serialization=True)
        llm = LLM(
            folder, skip_tokenizer_init=True, dtype=args.dtype, max_model_len=512, device=device
        )
        cases = {
            "greedy": SamplingParams(temperature=0.0, max_tokens=64, logprobs=0, ignore_eos=True),
            "sampled T=1": SamplingParams(
                temperature=1.0, max_tokens=64, logprobs=0, seed=1, ignore_eos=True
            ),
        }
        for name, params in cases.items():
            outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
            diffs = []
            for prompt, out in zip(PROMPTS, outputs, strict=True):
                completion = out.outputs[0]
                pairs = zip(completion.logprobs, completion.token_ids, strict=True)
                ours = torch.tensor([lp[t].logprob for lp, t in pairs])
                ids = torch.tensor([prompt + list(completion.token_ids)], device=device)
                with torch.no_grad():
                    logits = hf(ids).logits[0].float()
                reference = logits.log_softmax(-1)[len(prompt) - 1 : -1]
                theirs = reference.gather(-1, ids[0, len(prompt) :, None]).squeeze(-1).cpu()
                diffs.append((ours - theirs).abs())
            delta = torch.cat(diffs)
            recorder.emit(
                case=name,
                dtype=args.dtype,
                num_tokens=int(delta.numel()),
                max_abs_diff=float(delta.max()),
                mean_abs_diff=float(delta.mean()),
            )
        llm.shutdown()


if __name__ == "__main__":
    main()
