#!/bin/bash
# Run 12 (twenty-first session): a receiver "ContextPrimer" (a one-byte memset on the model's
# device's current stream, first thing in IpcReceiver.update_weights_from_tensor: run 11's memset
# prod) in refit.py, against refit.py --no-prime, alternating twice; then the IPC GPU tests with
# it (cut at 80 s). It showed no gain and was not committed: the primer, and refit.py's
# --no-prime, existed only in the working tree this ran from (RESULTS.md says what they did).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=$OUT/${RUN:-run12}
nvidia-smi > $P-nvidia-smi.txt 2>&1
refit=(benchmarks/refit.py --bucket-mib 512 --repeats 3 --modes new,reuse)
for round in 1 2; do
  timeout 55 python3 "${refit[@]}" --out $P-refit-prime.jsonl > /dev/null 2>>$P-errors.log; echo "prime rc=$?"
  timeout 55 python3 "${refit[@]}" --no-prime --out $P-refit-noprime.jsonl > /dev/null 2>>$P-errors.log; echo "no prime rc=$?"
done
for way in prime noprime; do
python3 - $P-refit-$way.jsonl $way <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["case"].startswith("ipc buckets"):
        print(sys.argv[2], r["case"][23:45], "engine", round(r["engine_of_limit"], 3), "end to end", round(r["of_limit"], 3), "verified", r["verified"])
PY
done
timeout 80 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_ipc_refit_gpu.py tests/gpu/test_ipc_reuse_gpu.py > $P-ipc-tests.log 2>&1; echo "tests rc=$?"; tail -2 $P-ipc-tests.log
