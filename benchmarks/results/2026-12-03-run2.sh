#!/bin/bash
# Run 2 (twelfth session): #13 the IPC GPU tests with the server's wheels (run 1 lacked uvicorn);
# #16 PDL above batch 1: its GPU tests (bit-exact chains at batch 64/128, the engine's tokens and
# logprobs) with the batch-1 chain tests beside, and dense_decode_sweep.py (the dense layer at
# batch 64/128/256, context 768: PDL and the split count against the defaults).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/dormant-site .whl/*.whl
export PYTHONPATH=/tmp/dormant-site:$PWD PYTHONUNBUFFERED=1
P=$OUT/2026-12-03-run2
timeout 130 python3 benchmarks/dense_decode_sweep.py --budget-s 100 --out $P-dense-sweep.jsonl > $P-dense-sweep.log 2>&1; echo "rc=$?" >> $P-dense-sweep.log
timeout 150 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/gpu/test_pdl_above_batch_1.py \
    tests/gpu/test_pdl_layer_chain.py > $P-pdl-tests.log 2>&1; echo "rc=$?" >> $P-pdl-tests.log
timeout 200 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/gpu/test_ipc_refit_gpu.py \
    tests/gpu/test_ipc_release_gpu.py tests/gpu/test_ipc_reuse_gpu.py tests/worker/test_ipc_weights.py \
    tests/frameworks/test_slime_calls.py > $P-ipc-tests.log 2>&1; echo "rc=$?" >> $P-ipc-tests.log
tail -5 $P-pdl-tests.log $P-ipc-tests.log
grep -v '^{' $P-dense-sweep.log | tail -40
