#!/bin/bash
# Run 11 (fifteenth session): the fourteenth session's refactors (rank_steps, step_sampler,
# step_pipeline) on the GPU: the engine GPU tests that capture graphs, sample with logprobs,
# run speculative decoding and MoE; then the rollout at max_num_seqs 64, async on (the default).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/dormant-site .whl/*.whl
export PYTHONPATH=/tmp/dormant-site:$PWD PYTHONUNBUFFERED=1
P=$OUT/2026-12-03-run11
nvidia-smi > $P-nvidia-smi.txt 2>&1
timeout 300 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/gpu/test_async_scheduling_gpu.py \
    tests/gpu/test_engine_graphs.py tests/gpu/test_logprobs_gpu.py \
    tests/gpu/test_multi_step_sampling_gpu.py tests/gpu/test_spec_decode_gpu.py \
    tests/gpu/test_moe_lifecycle.py --durations=15 > $P-gpu-tests.log 2>&1; echo "rc=$?" >> $P-gpu-tests.log
tail -30 $P-gpu-tests.log
timeout 260 python3 benchmarks/rollout.py --multi-steps 4 --max-num-seqs 64 --async-scheduling on --out $P-rollout-64.jsonl > $P-rollout-64.log 2>&1; echo "rc=$?" >> $P-rollout-64.log
grep -v '^{' $P-rollout-64.log | tail -14
