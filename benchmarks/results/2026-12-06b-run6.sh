#!/bin/bash
# Run 6 (twentieth session): issue 20's cycle on one GPU at a rank's size. The prior art ran
# Qwen3-30B-A3B at TP=4 on 4 x H200 (about 15 GB of weights a rank); at TP=1 here: 12 of its 48
# layers with self-speculation (a draft of the same size: ~30 GB of weights), and MiMo-7B with its
# MTP layer (the MTP path dormant builds), three cycles each (levels 2, 1, 2).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=$OUT/${RUN:-run6}
nvidia-smi > $P-nvidia-smi.txt 2>&1
for spec in self mtp; do
  layers=12; [[ $spec == mtp ]] && layers=36
  timeout 240 python3 benchmarks/tp_scenario.py --tp 1 --spec $spec --layers $layers --kv-mib 4096 --cycles 3 --out $P-tp-scenario-$spec.jsonl > $P-tp-scenario-$spec.log 2>&1; echo "rc=$?" >> $P-tp-scenario-$spec.log
  echo "== $spec"; grep -v '^{' $P-tp-scenario-$spec.log; grep -h '"control"' $P-tp-scenario-$spec.jsonl
  grep -h '"rank"' $P-tp-scenario-$spec.jsonl | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(r['cycle'], r['level'], {k: r.get(k) for k in ('sleep_s', 'wake_weights_s', 'wake_kv_s', 'sleep_arena_s', 'sleep_copy_s', 'sleep_bytes_copied', 'residual_bytes')})"
done
