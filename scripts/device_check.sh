#!/usr/bin/env bash
# The device check on a lent GPU machine: every zoo case on CUDA tensors, DDP over NCCL (one rank)
# and over Gloo with CUDA tensors (two ranks sharing the GPU), and the throughput benchmark on the
# GPU, within about 8 minutes. Installs nothing: the repository goes on PYTHONPATH.
#
#     scripts/device_check.sh OUT_DIR [extra options of python -m benchmarks.device_check]
#
# The report lands in OUT_DIR/gpu.md (commit it as benchmarks/results/gpu.md), OUT_DIR/gpu.json,
# OUT_DIR/throughput.json and OUT_DIR/throughput.png. See docs/DEVICES.md.
set -euo pipefail
if [ $# -lt 1 ]; then
    echo "usage: $0 OUT_DIR [--device cpu] [--quick] [--budget SECONDS]" >&2
    exit 2
fi
out="$1"
shift
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
cd "$repo"
PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 exec "$python" -m benchmarks.device_check --out "$out" "$@"
