#!/usr/bin/env bash
# The GPU suite: the GPU tests and the benchmarks, in one command, on a CUDA machine.
#
#   scripts/gpu_suite.sh [tests|bench|demo|memory|rollout|multi|mps|pending|all] [test paths or pytest args...]
#   (default: all; "memory" runs the memory layer's probes of issue 17, not part of "all";
#   "rollout" runs benchmarks/rollout.py, issue 16's GRPO-shaped rollout, < 8 min, nor that;
#   "multi" runs issue 20's multi-GPU runs on a machine of 2+ GPUs, not part of "all": the TP
#   GPU test, benchmarks/tp_scenario.py with the communicator kept and suspended (suspend needs
#   NCCL >= 2.29.7 and is refused with a typed error before it), benchmarks/update_group.py;
#   "pending" runs what was built on the CPU and waits for its first GPU run, < 10 min:
#   the session note lists it; "mps" runs issue 13's IPC refit with and without MPS, and the
#   memory, graph and IPC GPU tests and the demo under it, < 8 min)
#
# The whole GPU test suite ("tests") takes about 14 minutes on an H100, more than one device
# call allows (2026-12-06d, runs 2 and 4): run it as two calls, "tests tests/gpu" and
# "tests tests/engine tests/frameworks tests/layers tests/memory tests/models tests/worker
# tests/server" (the second, less tests/engine and tests/frameworks, took 4 minutes).
#
# Logs and raw JSON go to $OUT (default ./out). Wheels for packages the machine lacks
# (torch_memory_saver for the benchmark) are installed offline from .whl/ when present. The GPU
# machine's image has none of the server's packages, so tests/server is left out there unless
# they travel too (run 5 of 2026-12-06d): fastapi starlette pydantic pydantic_core uvicorn
# annotated_types typing_inspection opentelemetry-api typing_extensions, at the versions
# installed here, fetched with the device README's `pip download` line for Python 3.12. (The
# tests of the official client and schemathesis need those too, and are left out without.)
set -uo pipefail
stage=${1:-all}
shift || true
OUT=${OUT:-out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/dormant-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/dormant-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
status=0
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1

if [[ $stage == tests || $stage == all ]]; then
  (($#)) || set -- tests
  if ! python3 -c "import fastapi, uvicorn" 2>/dev/null; then
    echo "gpu_suite: the server's packages are missing here: tests/server is not collected"
    args=()
    for arg in "$@"; do  # named, its conftest (which imports the server) would still load
      [[ $arg == tests/server* ]] || args+=("$arg")
    done
    if ((${#args[@]} == 0)); then  # pytest would fall back to every test path
      echo "gpu_suite: nothing left to run"
      exit 1
    fi
    set -- "${args[@]}" --ignore=tests/server
  fi
  python3 -m pytest -m gpu -q -rs -p no:cacheprovider "$@" 2>&1 | tee "$OUT/gpu-tests.log"
  status=$((status | PIPESTATUS[0]))
fi
if [[ $stage == bench || $stage == all ]]; then
  python3 benchmarks/decode.py --out "$OUT/decode.jsonl" 2>&1 | tee "$OUT/decode.log"
  status=$((status | PIPESTATUS[0]))
  for kernels in triton torch; do  # the fused kernels against the torch reference
    DORMANT_TRITON=$([[ $kernels == triton ]] && echo 1 || echo 0) python3 \
      benchmarks/decode_profile.py --out "$OUT/decode-profile.jsonl" 2>&1 | tee -a "$OUT/decode-profile.log"
    status=$((status | PIPESTATUS[0]))
  done
fi
if [[ $stage == demo || $stage == all ]]; then
  python3 -m dormant.cli demo --png "$OUT/demo-timeline.png" 2>&1 | tee "$OUT/demo.log"
  status=$((status | PIPESTATUS[0]))
fi
if [[ $stage == bench || $stage == all ]]; then
  python3 benchmarks/sleep_wake.py --cycles 3 --out "$OUT/sleep_wake.jsonl" 2>&1 | tee "$OUT/sleep_wake.log"
  status=$((status | PIPESTATUS[0]))
fi
if [[ $stage == rollout ]]; then
  python3 benchmarks/rollout.py "$@" --out "$OUT/rollout.jsonl" 2>&1 | tee "$OUT/rollout.log"
  status=$((status | PIPESTATUS[0]))
fi
if [[ $stage == multi ]]; then  # issue 20: needs 2+ GPUs (4 for the scenario's TP=4)
  python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/gpu/test_tp_gpu.py tests/gpu/test_nccl_residual.py 2>&1 | tee "$OUT/multi-tests.log"
  status=$((status | PIPESTATUS[0]))
  python3 benchmarks/tp_scenario.py --out "$OUT/tp-scenario.jsonl" 2>&1 | tee "$OUT/tp-scenario.log"
  status=$((status | PIPESTATUS[0]))
  python3 benchmarks/tp_scenario.py --comm-sleep suspend --out "$OUT/tp-scenario.jsonl" 2>&1 |
    tee -a "$OUT/tp-scenario.log"  # its status is not counted: an older NCCL refuses it
  python3 benchmarks/update_group.py --out "$OUT/update-group.jsonl" 2>&1 | tee "$OUT/update-group.log"
  status=$((status | PIPESTATUS[0]))
fi
if [[ $stage == memory ]]; then  # the memory layer's probes (issue 17), ~12 minutes
  python3 benchmarks/sleep_wake.py --cycles 3 --out "$OUT/sleep_wake.jsonl" 2>&1 | tee "$OUT/sleep_wake.log"
  status=$((status | PIPESTATUS[0]))
  for probe in wake_after_release first_sleep kv_release engine_wake residual_sources engine_succession; do
    extra=$([[ $probe == wake_after_release ]] && echo --engine)
    python3 benchmarks/$probe.py $extra --out "$OUT/$probe.jsonl" 2>&1 | tee "$OUT/$probe.log"
    status=$((status | PIPESTATUS[0]))
  done
fi
if [[ $stage == mps ]]; then  # issue 13: the trainer's and the engine's processes in one context
  refit=(benchmarks/refit.py --bucket-mib 512 --repeats 3 --modes new,reuse)
  for round in 1 2; do  # alternating, so the host's drift falls on both
    python3 "${refit[@]}" --out "$OUT/refit-plain.jsonl" >>"$OUT/refit-plain.log" 2>&1
    status=$((status | $?))
    scripts/with_mps.sh python3 "${refit[@]}" --out "$OUT/refit-mps.jsonl" >>"$OUT/refit-mps.log" 2>&1
    status=$((status | $?))
  done
  gap=(benchmarks/ipc_idle_gap.py --gaps-us 1000)
  python3 "${gap[@]}" --out "$OUT/idle-gap-plain.jsonl" >"$OUT/idle-gap-plain.log" 2>&1
  status=$((status | $?))
  scripts/with_mps.sh python3 "${gap[@]}" --out "$OUT/idle-gap-mps.jsonl" >"$OUT/idle-gap-mps.log" 2>&1
  status=$((status | $?))
  scripts/with_mps.sh python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/gpu/test_cuda_memory.py \
    tests/gpu/test_ipc_refit_gpu.py tests/gpu/test_ipc_reuse_gpu.py tests/gpu/test_ipc_release_gpu.py \
    tests/gpu/test_engine_graphs.py tests/gpu/test_release_context_mps.py 2>&1 | tee "$OUT/mps-gpu-tests.log"
  status=$((status | PIPESTATUS[0]))
  scripts/with_mps.sh python3 -m dormant.cli demo 2>&1 | tee "$OUT/mps-demo.log"
  status=$((status | PIPESTATUS[0]))
  tail -n 3 "$OUT"/refit-*.log "$OUT"/idle-gap-*.log
fi
if [[ $stage == pending ]]; then  # built on the CPU since the last call, < 10 min
  # The twenty-first session's, for an H200 (it got none): issue 16's overlap probe with the
  # GEMMs' SM carveouts and the caching-off rollout, issue 13's refit.py without and with MPS.
  RUN=pending bash benchmarks/results/2026-12-06c-pending.sh 2>&1 | tee "$OUT/pending.log"
  status=$((status | PIPESTATUS[0]))
fi
# The device tool brings back at most 8 files: more are packed into one archive.
if (($(find "$OUT" -type f | wc -l) > 8)); then
  tar -C "$OUT" -czf /tmp/gpu-suite-out.tgz . && find "$OUT" -mindepth 1 -delete &&
    mv /tmp/gpu-suite-out.tgz "$OUT/gpu-suite-out.tgz"
fi
exit $status
