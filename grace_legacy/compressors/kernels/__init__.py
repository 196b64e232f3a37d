"""The compressors' inner loops, one module per algorithm: its torch formula (the reference, which
every device other than the CPU runs), its loops compiled by numba for the CPU, held to the same
results by the tests, and one function per pass that picks between them; beside them the counter-based
random draws, bit packing, and what the compiled loops share (:mod:`~grace_legacy.compressors.kernels.compiled`)."""
