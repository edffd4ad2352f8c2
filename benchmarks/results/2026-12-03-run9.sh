#!/bin/bash
# Run 9 (thirteenth session): the engine GPU tests that run with async scheduling on by default
# now and did not run in run 7 (prefix cache, MoE lifecycle, speculative decoding, whose calls
# now go through Worker.launch and run to their results, forks, the IPC refits under the drain
# rule, shutdown, residual release, local memory, the PDL engine test), then where the GRPO
# rollout's batch-512 call spends its device time (decode_profile, the fused 4-step sampled call).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/dormant-site .whl/*.whl
export PYTHONPATH=/tmp/dormant-site:$PWD PYTHONUNBUFFERED=1
P=$OUT/2026-12-03-run9
timeout 270 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/gpu/test_prefix_cache_gpu.py \
    tests/gpu/test_moe_lifecycle.py tests/gpu/test_spec_decode_gpu.py tests/gpu/test_fork_gpu.py \
    tests/gpu/test_ipc_refit_gpu.py tests/gpu/test_ipc_release_gpu.py tests/gpu/test_ipc_reuse_gpu.py \
    tests/gpu/test_shutdown_memory_gpu.py tests/gpu/test_residual_release.py tests/gpu/test_local_memory_gpu.py \
    tests/gpu/test_pdl_above_batch_1.py > $P-gpu-tests.log 2>&1; echo "rc=$?" >> $P-gpu-tests.log
timeout 160 python3 benchmarks/decode_profile.py --batch-size 512 --context 768 --multi-steps 4 --sampled --top 20 \
    --out $P-profile-b512.jsonl > $P-profile-b512.log 2>&1; echo "rc=$?" >> $P-profile-b512.log
tail -5 $P-gpu-tests.log; grep -v '^{' $P-profile-b512.log | tail -45
