#!/bin/bash
# Run 3 (twenty-fourth session): run 2 again at 8920ac6 (AsyncLLM pending ids, counts, FINAL_ONLY abort outputs, get_metrics). Run 2 was: the GPU cases of what this session changed: AsyncLLM (verl's
# abort path, EngineGenerateError, duplicate ids), the server (generation-config defaults, TRL's
# fields, chat template options, SGLang logprob_start_len and /v1/loads, weight-transfer routes),
# the weight-update group's refusals, vLLM's weight-transfer API (its NCCL refit needs a second
# GPU: skipped here), and the frameworks' call sequences.
P=$OUT/${RUN:-run3}
OUT=$OUT timeout 500 scripts/gpu_suite.sh tests tests/engine/test_async_llm.py \
  tests/engine/test_async_fidelity.py tests/engine/test_async_errors.py \
  tests/engine/test_generation_config.py tests/engine/test_weight_transfer.py \
  tests/engine/test_vllm_fidelity.py tests/engine/test_refit_paths.py \
  tests/gpu/test_async_scheduling_gpu.py tests/server tests/frameworks tests/worker \
  > $P-gpu-tests.log 2>&1; echo "rc=$?"
grep -E "passed|failed|error" $P-gpu-tests.log | tail -5
