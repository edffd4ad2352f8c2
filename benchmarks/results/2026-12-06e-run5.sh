#!/bin/bash
# Run 5 (twenty-third session): the GPU cases that stream through AsyncLLM and the server,
# after run 4's last commit (a slow reader now holds the newest output, not one per step).
# With tests/worker: the refit fixes (a refused refit drains its broadcasts; keyword-built workers).
P=$OUT/${RUN:-run5}
OUT=$OUT timeout 400 scripts/gpu_suite.sh tests tests/engine/test_async_scheduling.py tests/engine/test_async_llm.py \
  tests/engine/test_async_fidelity.py tests/gpu/test_async_scheduling_gpu.py tests/server tests/frameworks tests/worker \
  > $P-gpu-tests.log 2>&1; echo "rc=$?"
tail -8 $P-gpu-tests.log
