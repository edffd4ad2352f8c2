#!/bin/bash
# Run 2 (twenty-third session), on the H100 of run 1: the CUDA cases of tests/engine and
# tests/frameworks (the vLLM and async fidelity fixes, the stop-token order, the async
# scheduling tests fixed last session), then tests/gpu's engine-level files as time allows.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=$OUT/${RUN:-run2}
timeout 400 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=10 tests/engine tests/frameworks \
  > $P-engine-tests.log 2>&1; echo "engine rc=$?"
tail -15 $P-engine-tests.log
timeout 150 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=5 tests/gpu/test_logprobs_gpu.py \
  tests/gpu/test_async_scheduling_gpu.py tests/gpu/test_engine_graphs.py > $P-gpu-tests.log 2>&1; echo "gpu rc=$?"
tail -8 $P-gpu-tests.log
