#!/bin/bash
# Run 6 (thirteenth session): what the twelfth session built and no GPU ran: the engine GPU tests
# with the splits merged by merge tickets (graphs, MoE lifecycle, spec decode, prefix cache,
# logprobs), the PDL-above-batch-1 engine test as fixed, the decode attention tests (the merge
# kernel as rebuilt on _merge_group is the path of the tests without tickets), and the batch-1
# attention sweep (tickets against the merge kernel).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/dormant-site .whl/*.whl
export PYTHONPATH=/tmp/dormant-site:$PWD PYTHONUNBUFFERED=1
P=$OUT/2026-12-03-run6
nvidia-smi > $P-nvidia-smi.txt 2>&1
timeout 290 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/gpu/test_pdl_above_batch_1.py \
    tests/gpu/test_engine_graphs.py tests/gpu/test_moe_lifecycle.py tests/gpu/test_spec_decode_gpu.py \
    tests/gpu/test_prefix_cache_gpu.py tests/gpu/test_logprobs_gpu.py > $P-engine-tests.log 2>&1; echo "rc=$?" >> $P-engine-tests.log
timeout 200 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider --durations=5 tests/layers/test_triton_attention.py \
    > $P-attention-tests.log 2>&1; echo "rc=$?" >> $P-attention-tests.log
timeout 80 python3 benchmarks/moe_b1_sweep.py --only attention --out $P-moe-b1-attention.jsonl > $P-moe-b1-attention.log 2>&1; echo "rc=$?" >> $P-moe-b1-attention.log
tail -6 $P-engine-tests.log $P-attention-tests.log; tail -15 $P-moe-b1-attention.log
