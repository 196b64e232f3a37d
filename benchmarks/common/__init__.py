"""What the benchmark scripts of ``benchmarks/accuracy`` and ``benchmarks/performance`` share; none of
them is a benchmark (see ``benchmarks/README.md``)."""
