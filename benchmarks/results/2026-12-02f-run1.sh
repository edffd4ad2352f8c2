#!/bin/bash
# Run 1 (eleventh session): what the tenth session left pending. sleep_wake.py on the SM-copy
# policy with the 48 GiB threshold (closes #17 if its rows hold); the engine GPU tests with every
# batch-1 PDL knob on (#18: if they pass, the knobs become defaults); refit.py (#13); the prefill,
# sampling and SM-copy GPU tests.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/dormant-site .whl/*.whl
export PYTHONPATH=/tmp/dormant-site:$PWD PYTHONUNBUFFERED=1
P=$OUT/2026-12-02f-run1
timeout 170 python3 benchmarks/sleep_wake.py --cycles 3 --out $P-sleep_wake.jsonl > $P-sleep_wake.log 2>&1; echo "rc=$?" >> $P-sleep_wake.log
DORMANT_TEST_PDL_KNOBS=1 timeout 200 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider \
    tests/gpu/test_moe_lifecycle.py tests/gpu/test_engine_graphs.py tests/gpu/test_spec_decode_gpu.py > $P-pdl-knobs-tests.log 2>&1; echo "rc=$?" >> $P-pdl-knobs-tests.log
timeout 100 python3 benchmarks/refit.py --bucket-mib 512 --repeats 3 --out $P-refit.jsonl > $P-refit.log 2>&1; echo "rc=$?" >> $P-refit.log
timeout 90 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/layers/test_triton_prefill.py \
    tests/layers/test_triton_sampling.py tests/gpu/test_sm_copy_gpu.py > $P-gpu-tests.log 2>&1; echo "rc=$?" >> $P-gpu-tests.log
tail -3 $P-pdl-knobs-tests.log $P-gpu-tests.log
grep -v '^{' $P-sleep_wake.log | tail -40
grep -v '^{' $P-refit.log | tail -20
