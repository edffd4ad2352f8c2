#!/bin/bash
# Run 1 (twelfth session): #13 on the GPU after 6a2a545 (RefitReport: no second SLEEP_STATE round
# trip per bucket): the IPC GPU tests and the frameworks' IPC calls, refit.py (the engine-side ratio,
# target >= 0.5 x), ipc_stages.py (where the receiver's time goes per bucket).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/dormant-site .whl/*.whl
export PYTHONPATH=/tmp/dormant-site:$PWD PYTHONUNBUFFERED=1
P=$OUT/2026-12-03-run1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $P-nvidia-smi.txt 2>&1
timeout 200 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/gpu/test_ipc_refit_gpu.py \
    tests/gpu/test_ipc_release_gpu.py tests/gpu/test_ipc_reuse_gpu.py tests/worker/test_ipc_weights.py \
    tests/frameworks/test_slime_calls.py > $P-ipc-tests.log 2>&1; echo "rc=$?" >> $P-ipc-tests.log
timeout 130 python3 benchmarks/refit.py --bucket-mib 512 --repeats 3 --out $P-refit.jsonl > $P-refit.log 2>&1; echo "rc=$?" >> $P-refit.log
timeout 120 python3 benchmarks/ipc_stages.py --synced --refits 3 --out $P-ipc-stages.jsonl > $P-ipc-stages.log 2>&1; echo "rc=$?" >> $P-ipc-stages.log
tail -4 $P-ipc-tests.log
grep -v '^{' $P-refit.log | tail -24
grep -v '^{' $P-ipc-stages.log | tail -24
