#!/bin/bash
# Run 2: #18 the 48-layer MoE step with the batch-1 PDL knobs on by default, against the knobs-off
# child of the same run; where the MoE layer's time goes now (12 layers, batch 1); #16 where the
# rollout's sampled 4-step decode call goes at batch 64 and 128 (context 768, caching off shape).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/dormant-site .whl/*.whl
export PYTHONPATH=/tmp/dormant-site:$PWD PYTHONUNBUFFERED=1
P=$OUT/2026-12-02f-run2
timeout 170 python3 benchmarks/moe.py --layers 48 --skip-kernels --skip-sorted --skip-unfused --skip-peer --skip-plain --out $P-moe48.jsonl > $P-moe48.log 2>&1; echo "rc=$?" >> $P-moe48.log
for b in 64 128; do
  timeout 110 python3 benchmarks/decode_profile.py --batch-size $b --context 768 --multi-steps 4 --sampled --top 25 --out $P-profile-b$b-ms4-sampled.jsonl > $P-profile-b$b-ms4-sampled.log 2>&1; echo "rc=$?" >> $P-profile-b$b-ms4-sampled.log
done
timeout 100 python3 benchmarks/decode_profile.py --model moe --layers 12 --top 25 --out $P-profile-moe-b1.jsonl > $P-profile-moe-b1.log 2>&1; echo "rc=$?" >> $P-profile-moe-b1.log
grep -E "^case|^decode|rc=|x_roof|triton" $P-moe48.log | tail -16
for f in $P-profile-*.log; do echo "== $f"; grep -v '^{' $f | grep -v Warn | head -34; done
