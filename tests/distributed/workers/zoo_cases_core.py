"""Zoo cases for the compressors of the foundation and LEGACY issues."""

from zoo import Case

from grace_legacy import FP16, Grace, Legacy, NoCompression, NoMemory, RandomK, Residual, TopK


def pair(make_compressor, make_memory):
    """The optimizer's Grace bundle and an identical, separate twin."""
    return Grace(make_compressor(), memory=make_memory()), make_compressor(), make_memory()


CASES = [
    Case("NoCompression", lambda: pair(NoCompression, NoMemory), routes={"allreduce"}),
    Case("FP16", lambda: pair(FP16, NoMemory), rtol=2e-3, atol=1e-4, routes={"allreduce"}),
    Case("TopK+Residual", lambda: pair(lambda: TopK(0.1), Residual), routes={"allgather"}),
    Case("RandomK+Residual", lambda: pair(lambda: RandomK(0.1, seed=11), Residual), routes={"allreduce"}),
    Case("Legacy(TopK) by both", lambda: pair(
        lambda: Legacy(TopK(), by="both", values=[[1.0, 0.2], [0.5, 0.05]], splits=[100], epochs=2,
                       steps_per_epoch=2), Residual), routes={"allgather", "dense"}),
]
