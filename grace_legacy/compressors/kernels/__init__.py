"""The compressors' inner loops: exact Top-k selection, counter-based random draws, bit packing,
and the passes compiled by numba that run them on a CPU (each with a tensor formula that other
devices run, held to the same results by the tests)."""
