#!/bin/bash
# Run 1 (twenty-third session). On an H200: the pending work (2026-12-06c-pending.sh: the overlap
# probe with carveouts, refit.py plain and under MPS, the caching-off rollout). On an H100: the
# GPU tests of what changed since the last GPU run: the memory layer's free path (a failed free
# now waits in BlockTable.dying; the pools give an allocation up before destroying it), the IPC
# receiver and skeleton fixes, the spec-decode tests (the MTP draft catch-up after a prefix hit),
# and the server's CUDA tests with the server's wheels.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=$OUT/${RUN:-run1}
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  RUN=${RUN:-run1} bash benchmarks/results/2026-12-06c-pending.sh
  exit $?
fi
nvidia-smi > $P-nvidia-smi.txt 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/dormant-site .whl/*.whl > /dev/null 2>&1 && export PYTHONPATH=$PYTHONPATH:/tmp/dormant-site
timeout 420 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=8 \
  tests/gpu/test_cuda_memory.py tests/gpu/test_cuda_fault_recovery.py tests/gpu/test_shutdown_memory_gpu.py \
  tests/gpu/test_ipc_refit_gpu.py tests/gpu/test_ipc_release_gpu.py tests/gpu/test_ipc_reuse_gpu.py \
  tests/gpu/test_spec_decode_gpu.py tests/gpu/test_prefix_cache_gpu.py tests/server \
  > $P-tests.log 2>&1; echo "tests rc=$?"
tail -25 $P-tests.log
