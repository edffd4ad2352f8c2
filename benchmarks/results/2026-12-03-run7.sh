#!/bin/bash
# Run 7 (thirteenth session): #16 async scheduling. The engine GPU tests it touches (a call queued
# ahead takes its tokens from the FULL graph's or the fused multi-step graph's output on the
# device; graphs, logprobs, the residual census, multi-step sampling, fault recovery), then the
# rollout with every variant run with async scheduling off and on, side by side on one engine.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/dormant-site .whl/*.whl
export PYTHONPATH=/tmp/dormant-site:$PWD PYTHONUNBUFFERED=1
P=$OUT/2026-12-03-run7
timeout 200 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/gpu/test_async_scheduling_gpu.py \
    tests/gpu/test_engine_graphs.py tests/gpu/test_logprobs_gpu.py tests/gpu/test_residual.py \
    tests/gpu/test_multi_step_sampling_gpu.py tests/gpu/test_engine_fault_recovery.py > $P-gpu-tests.log 2>&1; echo "rc=$?" >> $P-gpu-tests.log
timeout 350 python3 benchmarks/rollout.py --multi-steps 4 --async-scheduling both --out $P-rollout-ms4.jsonl > $P-rollout-ms4.log 2>&1; echo "rc=$?" >> $P-rollout-ms4.log
tail -5 $P-gpu-tests.log; grep -v '^{' $P-rollout-ms4.log | tail -16
