#!/bin/bash
# Run 3 (twenty-third session), on the H100 of runs 1-2: the rest of tests/gpu (runs 1-2 ran
# the memory, IPC, spec, prefix-cache, logprobs, async-scheduling and graph files), the Triton
# MoE tests last (the twenty-second session's run stopped before their last cases).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=$OUT/${RUN:-run3}
done_files="cuda_memory cuda_fault_recovery shutdown_memory_gpu ipc_refit_gpu ipc_release_gpu ipc_reuse_gpu
spec_decode_gpu prefix_cache_gpu logprobs_gpu async_scheduling_gpu engine_graphs triton_moe"
files=()
for f in tests/gpu/test_*.py; do
  name=${f#tests/gpu/test_}; name=${name%.py}
  [[ " $(echo $done_files) " == *" $name "* ]] || files+=("$f")
done
files+=(tests/gpu/test_triton_moe.py)
timeout 560 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=10 "${files[@]}" \
  > $P-gpu-tests.log 2>&1; echo "gpu rc=$?"
tail -25 $P-gpu-tests.log
