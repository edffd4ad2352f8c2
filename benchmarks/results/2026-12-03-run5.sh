#!/bin/bash
# Run 5 (twelfth session, the same warm machine): the PDL chain tests (batch 1 with the merge
# tickets; above batch 1) and moe.py at 48 layers with the merge tickets, defaults only.
cd .gpu_snap && export PYTHONPATH=/tmp/dormant-site:$PWD PYTHONUNBUFFERED=1
P=$OUT/2026-12-03-run5
timeout 80 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/gpu/test_pdl_layer_chain.py tests/gpu/test_pdl_above_batch_1.py > $P-pdl-tests.log 2>&1; echo "rc=$?" >> $P-pdl-tests.log
timeout 110 python3 benchmarks/moe.py --layers 48 --skip-kernels --skip-sorted --skip-unfused --skip-peer --skip-plain --skip-knobs-off --out $P-moe48.jsonl > $P-moe48.log 2>&1; echo "rc=$?" >> $P-moe48.log
