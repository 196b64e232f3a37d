"""The device check: what grace-legacy does on a GPU, in one command of a few minutes.

    python -m benchmarks.device_check --out DIR              # on a GPU machine (scripts/device_check.sh)
    python -m benchmarks.device_check --device cpu --quick --out DIR   # the same code paths on a CPU

See :mod:`benchmarks.device_check.__main__` for the stages and docs/DEVICE_CHECK.md for when to run
it and where its report goes.
"""
