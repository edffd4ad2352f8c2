#!/bin/bash
# Run 4 (twenty-third session), on the H100 of runs 1-3: the GPU cases of the remaining test
# folders (the memory layer's state machine and unchanged-skip on CUDA after the free-path
# change, layers, models, worker), with the server's wheels for tests/server.
P=$OUT/${RUN:-run4}
OUT=$OUT timeout 300 scripts/gpu_suite.sh tests tests/layers tests/memory tests/models tests/worker tests/server \
  --durations=5 > $P-gpu-tests.log 2>&1; echo "rc=$?"
tail -14 $P-gpu-tests.log
