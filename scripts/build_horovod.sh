#!/usr/bin/env bash
# Build Horovod 0.28.1 from its PyPI source release into the given Python environment.
#
# Why from source with a patch: 0.28.1 is Horovod's last release and compiles its PyTorch and
# Gloo parts as C++14, while PyTorch >= 2.1 headers need C++17. Raising CMAKE_CXX_STANDARD to 17
# in the two CMakeLists is enough. The built wheel is cached under .cache/ so a second set-up,
# or a rebuilt virtualenv, reuses it instead of compiling again.
set -euo pipefail

PYTHON=${1:?usage: build_horovod.sh PYTHON}
VERSION=0.28.1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CACHE="$ROOT/.cache/horovod"
WHEEL_DIR="$CACHE/wheel"
TORCH_VERSION=$("$PYTHON" -c 'import torch; print(torch.__version__)')
# A wheel is only reusable with the torch it was compiled against.
STAMP="$WHEEL_DIR/built-against-torch-$TORCH_VERSION"

if "$PYTHON" -c 'import horovod.torch' 2>/dev/null; then
    echo "horovod already importable in $PYTHON"
    exit 0
fi

if [ ! -f "$STAMP" ]; then
    rm -rf "$CACHE/src" "$WHEEL_DIR"
    mkdir -p "$CACHE/src" "$WHEEL_DIR"
    "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: "horovod==$VERSION" -d "$CACHE/src"
    tar -xzf "$CACHE/src/horovod-$VERSION.tar.gz" -C "$CACHE/src"
    SRC="$CACHE/src/horovod-$VERSION"
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
        "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
    grep -q 'set(CMAKE_CXX_STANDARD 17)' "$SRC/horovod/torch/CMakeLists.txt"

    export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1
    export HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
    if command -v nvcc >/dev/null 2>&1 && [ -n "${HOROVOD_CUDA_HOME:-${CUDA_HOME:-}}" ]; then
        export HOROVOD_GPU_OPERATIONS=NCCL
    fi
    export MAKEFLAGS="-j$(nproc)"
    # --no-build-isolation: Horovod's setup.py inspects the installed torch to pick its ABI.
    "$PYTHON" -m pip wheel --no-deps --no-build-isolation -w "$WHEEL_DIR" "$SRC"
    touch "$STAMP"
fi

"$PYTHON" -m pip install --quiet --no-deps "$WHEEL_DIR"/horovod-"$VERSION"-*.whl
"$PYTHON" -m pip install --quiet cloudpickle psutil pyyaml packaging cffi
"$PYTHON" -c 'import horovod.torch'
