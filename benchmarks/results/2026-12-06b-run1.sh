#!/bin/bash
# What the nineteenth session built and could not run on a GPU (its device time ran out), for
# `scripts/gpu_suite.sh pending`, ~5 min on one GPU:
# - issue 13: the IPC GPU tests with this session's receiver (a kept bucket's head unpickled as
#   one FRAME, a whole-bucket run not sliced, byte runs outside no_grad; refit.py verified its
#   writes on an H100 in run 2, the tests did not run), and refit.py at 512 MiB on this card;
# - issue 20: benchmarks/tp_scenario.py at TP=1 (4 layers of the MoE with self-speculation, FULL
#   and fused multi-step graphs), so that its GPU path has run before a multi-GPU machine is lent
#   (benchmarks/update_group.py needs two GPUs: the trainer has one of its own).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=$OUT/${RUN:-pending}
timeout 150 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/gpu/test_ipc_release_gpu.py tests/gpu/test_ipc_reuse_gpu.py tests/gpu/test_ipc_refit_gpu.py > $P-tests.log 2>&1; echo "rc=$?" >> $P-tests.log
tail -3 $P-tests.log
timeout 150 python3 benchmarks/tp_scenario.py --tp 1 --layers 4 --cycles 3 --out $P-tp-scenario.jsonl > $P-tp-scenario.log 2>&1; echo "rc=$?" >> $P-tp-scenario.log
tail -6 $P-tp-scenario.log
timeout 100 python3 benchmarks/refit.py --bucket-mib 512 --repeats 3 --out $P-refit.jsonl > $P-refit.log 2>&1; echo "rc=$?" >> $P-refit.log
grep -E "^ipc buckets of 512 MiB, (a new|one reused)|^limit|^bf16, one" $P-refit.log | cut -c1-40,100-160
