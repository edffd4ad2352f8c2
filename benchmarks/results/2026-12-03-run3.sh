#!/bin/bash
# Run 3 (twelfth session): #16 the rollout (multi-steps 4) with UNSPLIT_PAIRS_PER_SM = 3 (batch
# 50+ of 8 kv heads unsplit, no merge), side by side with the rule before it (1000); the decode
# attention's GPU tests (the splits merged by tickets among them) and the batch-1 PDL chains.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/dormant-site .whl/*.whl
export PYTHONPATH=/tmp/dormant-site:$PWD PYTHONUNBUFFERED=1
P=$OUT/2026-12-03-run3
timeout 150 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/layers/test_triton_attention.py tests/gpu/test_pdl_layer_chain.py \
    > $P-attention-tests.log 2>&1; echo "rc=$?" >> $P-attention-tests.log
timeout 190 python3 benchmarks/rollout.py --multi-steps 4 --out $P-rollout-ms4.jsonl > $P-rollout-ms4.log 2>&1; echo "rc=$?" >> $P-rollout-ms4.log
timeout 190 python3 benchmarks/rollout.py --multi-steps 4 --unsplit-pairs-per-sm 1000 --out $P-rollout-ms4-before.jsonl > $P-rollout-ms4-before.log 2>&1; echo "rc=$?" >> $P-rollout-ms4-before.log
tail -4 $P-attention-tests.log
for f in $P-rollout-ms4.jsonl $P-rollout-ms4-before.jsonl; do echo "== $f"; python3 -c "
import json,sys
for l in open(sys.argv[1]):
    d=json.loads(l)
    if 'batch_bucket' in d: print(d.get('variant'), d['batch_bucket'], d.get('median_batch'), round(d['x_roofline'],3), round(d.get('x_compute_bound',0),3))
    if d.get('case') in ('rollout','total'): print({k:v for k,v in d.items() if k in ('variant','generated_tokens_per_s','x_roofline_b64_plus','seconds')})
" $f; done
