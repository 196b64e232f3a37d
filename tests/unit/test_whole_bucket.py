"""A caller's bucket sent as one tensor (``Grace.start_whole``, the DDP hook's path for FP16, BF16
and no compression): the same bits and counts as the tensors started one by one, an inf or NaN of
any rank in every rank's result (what makes GradScaler skip the step everywhere), and only where
that holds."""

import pytest
import torch

from grace_legacy import BF16, FP16, Allgather, Grace, Legacy, Residual, TopK
from grace_legacy.compressors import NoCompression
from grace_legacy.core.state import UndoLog
from tests.helpers import bucket_of, run_ranks

SHAPES = {"conv.weight": (8, 3, 3, 3), "conv.bias": (8,), "fc.weight": (10, 40), "fc.bias": (10,)}


def gradients(rank: int, dtype: torch.dtype = torch.float32, poison: tuple[int, str] | None = None):
    grads = [torch.randn(shape, generator=torch.Generator().manual_seed(100 * rank + i)).to(dtype)
             for i, shape in enumerate(SHAPES.values())]
    if poison is not None and poison[0] == rank:
        grads[list(SHAPES).index(poison[1])].view(-1)[3] = float(poison[1] == "fc.bias" and "nan" or "inf")
    return grads


def one_step(backend, bundle: Grace, whole: bool, dtype=torch.float32, poison=None):
    """One bucket's step through ``bundle``: (results by name, flagged names, stats)."""
    names = list(SHAPES)
    flat, views = bucket_of(gradients(backend.rank(), dtype, poison))
    if whole:
        pending = bundle.start_whole("b0", flat, views, names, backend, average=True)
        if pending is None:
            return None  # started one by one
        assert pending() is flat
        results = {n: v.clone() for n, v in zip(names, views, strict=True)}
    else:
        started = {n: bundle.start(v, n, backend, average=True, hold=True) for n, v in zip(names, views, strict=True)}
        bundle.fusion.launch_held("b0", backend, average=True, into=flat)
        results = {n: p().clone() for n, p in started.items()}
    flagged = bundle.guard.nonfinite_names(sorted(names), backend)
    bundle.end_step(backend)
    return results, flagged, bundle.stats


@pytest.mark.parametrize("make", [FP16, BF16, NoCompression], ids=["FP16", "BF16", "none"])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("poison", [None, (1, "fc.weight"), (0, "fc.bias")], ids=["finite", "inf", "nan"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp64", "fp16", "bf16"])
def test_a_bucket_sent_whole_equals_its_tensors_sent_one_by_one(make, world, poison, dtype):
    if poison is not None and poison[0] >= world:
        pytest.skip("the poisoned rank is not in this world")

    def body(backend):
        return [one_step(backend, Grace(make()), whole, dtype, poison) for whole in (True, False)]

    for (whole, one_by_one) in run_ranks(world, body):
        assert whole is not None  # every gradient dtype these casts take goes whole
        results, flagged, stats = whole
        want_results, want_flagged, want_stats = one_by_one
        assert results.keys() == want_results.keys()
        for name in results:
            assert torch.equal(results[name], want_results[name]) or (
                torch.equal(results[name].isnan(), want_results[name].isnan())
                and torch.equal(results[name].nan_to_num(), want_results[name].nan_to_num())), name
        assert want_flagged == (set() if poison is None else {poison[1]})
        # Whole, nothing is looked at: the results show it, and there is no state to undo.
        assert flagged == set()
        assert all(bool(results[name].isfinite().all()) == (poison is None or name != poison[1])
                   for name in results)
        assert stats == want_stats  # bytes handed over, wire bytes, tensors by route


class _FP16WithState(FP16):
    """FP16 with per-tensor state a skipped step must roll back: the whole path, which looks at no
    tensor for infs, cannot take it."""

    def __init__(self) -> None:
        super().__init__()
        self.undo_log = UndoLog()


@pytest.mark.parametrize("bundle", [
    lambda: Grace(TopK(0.1)),                                   # not elementwise
    lambda: Grace(FP16(), memory=Residual()),                   # a memory keeps per-tensor state
    lambda: Grace(FP16(), communicator=Allgather()),            # another route
    lambda: Grace(Legacy(TopK(), by="layer", values=[0.5, 0.1], splits=[100])),  # a schedule
    lambda: Grace(_FP16WithState()),                            # a skipped step would undo state
], ids=["topk", "residual", "allgather", "legacy", "undo-log"])
def test_what_cannot_go_whole_is_started_one_by_one(bundle):
    def body(backend):
        flat, views = bucket_of(gradients(backend.rank()))
        return bundle().start_whole("b0", flat, views, list(SHAPES), backend, average=True)

    assert run_ranks(2, body) == [None, None]


def test_a_flat_that_does_not_hold_exactly_its_tensors_is_started_one_by_one():
    def body(backend):
        flat, views = bucket_of(gradients(backend.rank()))
        longer = torch.cat([flat, torch.zeros(3)])
        return Grace(FP16()).start_whole("b0", longer, views, list(SHAPES), backend, average=True)

    assert run_ranks(2, body) == [None, None]


def test_tensors_that_only_give_the_shapes_and_dtypes_do_as_the_bucket_s_views():
    """The DDP hook hands over the parameters, not views of the bucket: only shapes and dtypes count."""
    def body(backend):
        out = []
        for stand_ins in (False, True):
            flat, views = bucket_of(gradients(backend.rank()))
            tensors = [torch.empty_like(v) for v in views] if stand_ins else views
            bundle = Grace(FP16())
            pending = bundle.start_whole("b0", flat, tensors, list(SHAPES), backend, average=True)
            assert pending is not None
            out.append((pending().clone(), bundle.stats))
        return out

    for (views_result, views_stats), (stand_in_result, stand_in_stats) in run_ranks(2, body):
        assert torch.equal(views_result, stand_in_result) and views_stats == stand_in_stats
