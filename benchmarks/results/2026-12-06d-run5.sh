#!/bin/bash
# Run 5 (twenty-second session, H100): the GPU tests that need the server's packages, which the
# GPU machine lacks (carried as wheels in .whl/): the server over a CUDA engine through an RL
# cycle (tests/server/test_server_devices.py) and slime's calls over the server on CUDA
# (tests/frameworks/test_slime_calls.py). Neither had run on a GPU before.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -m gpu -q -rfs -p no:cacheprovider --tb=short tests/server/test_server_devices.py \
  tests/frameworks/test_slime_calls.py > $OUT/run5-server-tests.log 2>&1
echo "rc=$?" >> $OUT/run5-server-tests.log
tail -25 $OUT/run5-server-tests.log
