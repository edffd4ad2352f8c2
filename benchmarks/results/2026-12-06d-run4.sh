#!/bin/bash
# Run 4 (twenty-second session, H100): the GPU suite's second half, which run 2 did not reach in
# its 560 s (it stopped in tests/gpu/test_triton_moe.py), with the fixed async scheduling tests
# (run 3) and the self-launching MPS refusal test first. (A first try also named tests/server,
# whose conftest imports the server: without uvicorn on the machine it stopped at collection.)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=$OUT/${RUN:-run4}
timeout 400 python3 -m pytest -m gpu -q -rfs -p no:cacheprovider --tb=short --durations=10 \
  tests/engine/test_async_scheduling.py tests/gpu/test_release_context_mps.py tests/layers \
  tests/memory tests/models tests/worker > $P-gpu-tests.log 2>&1
echo "rc=$?" >> $P-gpu-tests.log
