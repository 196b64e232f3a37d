#!/usr/bin/env bash
# Runs Horovod's own elastic harness (test/integration/elastic_common.py of a Horovod checkout at
# tag v0.28.1, every scenario of BaseElasticTests, without the skips of test_elastic_torch.py) on
# tests/distributed/elastic_faults_worker.py (LEGACY Top-k + error feedback in TorchState),
# RUNS times in a row; with SCRIPT=horovod, on Horovod's own test/integration/data/elastic_torch_main.py
# instead (the control). Horovod's files are copied from the checkout into a temporary folder, never
# into this repository; the standard library's unittest.mock stands in for the `mock` backport.
#
#   scripts/horovod_elastic_harness.sh HOROVOD_CHECKOUT [RUNS] [pytest arguments...]
#
# Writes RESULTS (default: ./horovod-elastic-harness) /<script>-run<i>.log and prints each run's summary;
# a run that outlasts RUN_TIMEOUT seconds (default 2400: a hang) is killed and reported as such.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
HOROVOD=$(cd "${1:?usage: $0 HOROVOD_CHECKOUT [RUNS] [pytest arguments...]}" && pwd)
RUNS=${2:-3}
shift $(( $# < 2 ? $# : 2 ))
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
RESULTS=${RESULTS:-$PWD/horovod-elastic-harness}
SCRIPT=${SCRIPT:-grace}
RUN_TIMEOUT=${RUN_TIMEOUT:-2400}

if [ "$(git -C "$HOROVOD" describe --tags 2>/dev/null)" != "v0.28.1" ]; then
    echo "warning: $HOROVOD is not at tag v0.28.1" >&2
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/test/utils" "$WORK/test/integration/data" "$RESULTS"
cp "$HOROVOD/test/utils/common.py" "$WORK/test/utils/"
cp "$HOROVOD/test/integration/elastic_common.py" "$WORK/test/integration/"
cp "$HOROVOD/test/integration/data/elastic_torch_main.py" "$WORK/test/integration/data/"
printf 'from unittest.mock import *  # noqa: F403\nfrom unittest.mock import patch  # noqa: F401\n' \
    > "$WORK/test/utils/mock.py"
if [ "$SCRIPT" = horovod ]; then
    TRAINING="$WORK/test/integration/data/elastic_torch_main.py"
else
    TRAINING="$ROOT/tests/distributed/elastic_faults_worker.py"
fi
cat > "$WORK/test/integration/test_elastic_harness.py" <<EOF
import unittest

from elastic_common import BaseElasticTests


class ElasticHarness(BaseElasticTests, unittest.TestCase):
    def __init__(self, *args, **kwargs):
        super().__init__("$TRAINING", *args, **kwargs)
EOF

cd "$WORK/test/integration"
# The harness starts 'python' from PATH; the training script imports grace_legacy and tests.faults.
export PATH="$(dirname "$PYTHON"):$PATH" PYTHONPATH="$ROOT:$WORK/test/utils" OMP_NUM_THREADS=1
for run in $(seq 1 "$RUNS"); do
    echo "=== $SCRIPT run $run, $(date +%T), load $(cut -d' ' -f1-3 /proc/loadavg)"
    timeout -k 30 "$RUN_TIMEOUT" "$PYTHON" -m pytest -v -s -rA -p no:cacheprovider test_elastic_harness.py "$@" \
        > "$RESULTS/$SCRIPT-run$run.log" 2>&1
    [ $? -eq 124 ] && echo "run $run killed after $RUN_TIMEOUT s (a hang)"
    grep -E "^(PASSED|FAILED|ERROR) test_elastic_harness|^=+ .*(passed|failed).* in " "$RESULTS/$SCRIPT-run$run.log"
done
