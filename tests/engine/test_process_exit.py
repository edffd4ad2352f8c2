"""The process exits cleanly with engine memory still alive at interpreter teardown."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_the_process_exits_cleanly_with_pool_tensors_still_alive() -> None:
    """Regression: storages freed by the interpreter's last garbage collection (here, a model
    kept in a reference cycle) called back into Python during teardown and segfaulted (CI)."""
    script = (
        "from dormant import LLM, SamplingParams\n"
        "from dormant.models import ModelConfig\n"
        "config = ModelConfig.from_dict({'architectures': ['Qwen3ForCausalLM'], 'vocab_size': 512,"
        " 'hidden_size': 64, 'intermediate_size': 128, 'num_hidden_layers': 2,"
        " 'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 16,"
        " 'max_position_embeddings': 512, 'torch_dtype': 'float32'})\n"
        "llm = LLM(config, device='cpu', max_model_len=128, max_num_seqs=4,"
        " kv_cache_memory_bytes=1 << 20)\n"
        "llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4))\n"
        "class Holder:\n"
        "    pass\n"
        "holder = Holder()\n"
        "holder.self, holder.llm = holder, llm\n"
        "holder.model = llm.llm_engine.executor.worker.model\n"
        "del llm\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, timeout=300, env=env, cwd=root
    )
    assert result.returncode == 0, result.stderr.decode()[-2000:]
