#!/usr/bin/env bash
# One-time set-up of everything grace-legacy needs, in a virtualenv inside the repository:
# Debian's Open MPI and cmake, PyTorch 2.13 (CPU), Horovod 0.28.1 built from source, the package
# with its optional extras.
# Safe to run again: every step checks first and skips what is already there.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV="$ROOT/.venv"
cd "$ROOT"

# libgomp1: numba's OpenMP threading layer, which the compiled passes run on (docs/DESIGN.md#threads).
APT_PACKAGES=(libopenmpi-dev openmpi-bin cmake g++ make libgomp1)
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    echo "installing Debian packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}" \
        || { $SUDO apt-get update -q && $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"; }
fi

if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"

# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
"$PY" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null \
    || "$PY" -m pip install --quiet torch==2.13.0
"$PY" -m pip install --quiet numpy mpi4py cloudpickle psutil pyyaml packaging cffi

"$ROOT/scripts/build_horovod.sh" "$PY"

# The optional integrations too (Lightning, Accelerate, TensorBoard), for their tests; the pin keeps
# pip from pulling a CUDA torch for them.
"$PY" -m pip install --quiet --constraint "$ROOT/scripts/constraints.txt" \
    -e ".[horovod,examples,test,lightning,accelerate,tensorboard]"
# PyPI's torchvision is built for PyPI's CUDA torch; next to the CPU torch its compiled ops cannot
# load and its import fails unless two of its registrations are guarded (see the script).
"$PY" "$ROOT/scripts/torchvision_on_cpu_torch.py"
# Captured first: `grep -q` exits at its first match and would break horovodrun's pipe.
build_report=$("$VENV/bin/horovodrun" --check-build)
for framework in PyTorch MPI Gloo; do
    grep -q "\[X\] $framework" <<<"$build_report" \
        || { echo "Horovod was built without $framework:"; echo "$build_report"; exit 1; }
done
echo "set-up complete: $("$PY" -c 'import torch, horovod; print("torch", torch.__version__, "horovod", horovod.__version__)')"
