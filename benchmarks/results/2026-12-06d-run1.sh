#!/bin/bash
# Run 1 (twenty-second session). On an H200: the twenty-first session's pending work
# (2026-12-06c-pending.sh: the overlap probe with carveouts, refit.py plain and under MPS, the
# caching-off rollout). On an H100: the MPS refusal test, now self-launching under a private
# daemon from a plain (non-MPS) pytest, beside the release and IPC GPU tests.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=$OUT/${RUN:-run1}
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  RUN=${RUN:-run1} bash benchmarks/results/2026-12-06c-pending.sh
  exit $?
fi
nvidia-smi > $P-nvidia-smi.txt 2>&1
timeout 300 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/gpu/test_release_context_mps.py \
  tests/gpu/test_residual_release.py tests/gpu/test_ipc_refit_gpu.py > $P-tests.log 2>&1; echo "tests rc=$?"
tail -6 $P-tests.log
