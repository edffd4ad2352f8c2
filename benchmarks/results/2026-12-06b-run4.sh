#!/bin/bash
# Run 4 (twentieth session): issue 16's rollout on this card (the H100 the device lends; the
# rollout was measured only on H200s so far), async scheduling on only (the default), one RL
# cycle: is the caching-off decode at batch >= 64 within 1.4 x the roofline where the GEMMs at
# batch 512 weigh less against the HBM (3.35 TB/s) than on the H200 (4.8 TB/s)?
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=$OUT/${RUN:-run4}
nvidia-smi > $P-nvidia-smi.txt 2>&1
timeout 540 python3 benchmarks/rollout.py --multi-steps 4 --async-scheduling on --cycles 1 --out $P-rollout.jsonl > $P-rollout.log 2>&1; echo "rc=$?" >> $P-rollout.log
grep -v '^{' $P-rollout.log | tail -30
python3 - $P-rollout.jsonl <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["case"] == "decode_vs_roofline" and r["batch_bucket"] >= 64:
        print(r["variant"], r["batch_bucket"], {k: r.get(k) for k in ("num_steps", "step_s", "x_roofline", "x_roofline_p90", "x_compute_bound")})
PY
