"""The simulator in one process (``grace_legacy.simulate``): its collectives and orders of addition
against references written from the algorithms, its lock-step against an independent in-process
world (``tests/helpers.py``'s threads), its shortcuts against the long way, its gradients, data
and participation, and what it refuses. Real launches: ``tests/distributed/test_simulate.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from grace_legacy import (
    QSGD,
    Allgather,
    Grace,
    Legacy,
    NoCompression,
    NoMemory,
    Residual,
    ScatterGather,
    Threshold,
    TopK,
)
from grace_legacy.grace import as_bundle
from grace_legacy.simulate import (
    Deadlock,
    LockStep,
    Shards,
    SimulatedWorld,
    Simulation,
    WorkerGradients,
    participants,
    plan_buckets,
    synchronize,
)
from grace_legacy.simulate.sums import REDUCTIONS, gloo_ring, recursive_doubling, ring_chunks
from tests.distributed.harness import Net, batch
from tests.helpers import bits, run_ranks

# -- the orders of addition, against the algorithms run message by message ------------------------

def ring_reference(rows: list[np.ndarray], max_segment: int) -> np.ndarray:
    """Gloo's ring allreduce, run as its loop runs it: every rank's buffer, segments sent to rank
    ``r - 1`` and added there (reduce-scatter), then passed on whole (allgather)."""
    size, n = len(rows), rows[0].size
    e = rows[0].itemsize
    total = n * e

    def up(value: int, multiple: int) -> int:
        return (value + multiple - 1) // multiple * multiple

    largest = e * max(1, max_segment // e)
    segments = up(max((total + largest - 1) // largest, 2 * size), size)
    seg = up((total + segments - 1) // segments, e)
    per_rank = segments // size
    out = [r.copy() for r in rows]

    def span(offset: int) -> slice:
        return slice(offset // e, min(n, (offset + seg) // e))

    for i in range(segments - per_rank):
        sends = [(((r + 1) * per_rank + i) * seg) % (segments * seg) for r in range(size)]
        received = [out[(r + 1) % size][span(sends[(r + 1) % size])].copy() for r in range(size)]
        for r in range(size):
            where = span((((r + 2) * per_rank + i) * seg) % (segments * seg))
            if where.start < where.stop:
                out[r][where] = out[r][where] + received[r]
    owner = [None] * n
    for r in range(size):
        for k in range(per_rank):
            where = span((r * per_rank + k) * seg)
            for j in range(where.start, where.stop):
                owner[j] = r
    return np.array([out[owner[j]][j] for j in range(n)], dtype=rows[0].dtype)


def doubling_reference(rows: list[np.ndarray]) -> np.ndarray:
    """Open MPI's recursive doubling, rank by rank (``ompi_coll_base_allreduce_intra_recursivedoubling``)."""
    size = len(rows)
    adjsize = 1 << (size.bit_length() - 1)
    extra = size - adjsize
    value = {r: rows[r].copy() for r in range(size)}
    newrank = {}
    for r in range(size):
        if r < 2 * extra:
            if r % 2:
                value[r] = rows[r - 1] + value[r]
                newrank[r] = r >> 1
        else:
            newrank[r] = r - extra
    distance = 1
    while distance < adjsize:
        sent = dict(value)
        for r, nr in newrank.items():
            remote_new = nr ^ distance
            remote = remote_new * 2 + 1 if remote_new < extra else remote_new + extra
            value[r] = sent[remote] + sent[r]
        distance <<= 1
    return value[max(newrank)]


def spread(size: int, n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g, dtype=torch.float64)
             * torch.exp(5 * torch.randn(n, generator=g, dtype=torch.float64))).float() for _ in range(size)]


@pytest.mark.parametrize("size", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("n", [1, 7, 300])
def test_the_orders_of_addition_are_the_algorithms(size, n):
    tensors = spread(size, n, 100 * size + n)
    rows = [t.numpy() for t in tensors]
    assert np.array_equal(gloo_ring(tensors).numpy().view(np.int32), ring_reference(rows, 1 << 20).view(np.int32))
    assert np.array_equal(recursive_doubling(tensors).numpy().view(np.int32), doubling_reference(rows).view(np.int32))
    # Several segments to a chunk: the chunks' bounds follow Gloo's segments.
    small = ring_chunks(n, 4, size, max_segment_bytes=8)
    expected = ring_reference(rows, 8)
    got = torch.empty(n)
    for chunk in range(size):
        start, stop = small[chunk], small[chunk + 1]
        order = [(chunk - 1 - k) % size for k in range(size)]
        if start < stop:
            total = tensors[order[0]][start:stop].clone()
            for r in order[1:]:
                total += tensors[r][start:stop]
            got[start:stop] = total
    assert np.array_equal(got.numpy().view(np.int32), expected.view(np.int32))


def test_averages_divide_or_scale_as_each_backend_does():
    tensors = spread(3, 500, 7)
    total = gloo_ring(tensors)
    assert torch.equal(REDUCTIONS["torch-gloo"](tensors, True), total / 3)
    assert torch.equal(REDUCTIONS["horovod-gloo"](tensors, True), total * (1.0 / 3))
    halves = [t.bfloat16() for t in tensors]
    gathered = (halves[0].float() + halves[1].float() + halves[2].float()) / 3
    assert torch.equal(REDUCTIONS["horovod-mpi"](halves, True), gathered.bfloat16())


# -- the world's collectives and the lock-step --------------------------------------------------

def run_world(size: int, body, **options) -> list:
    lockstep = LockStep(size)
    world = SimulatedWorld(size, lockstep, **options)
    try:
        return lockstep.run([lambda r=r: body(world.backend(r)) for r in range(size)])
    finally:
        lockstep.close()


def test_collectives_deliver_what_every_rank_launched():
    def body(backend):
        r = backend.rank()
        rows = torch.full((r + 1, 2), float(r))
        gathered = backend.wait(backend.allgather_async(rows, "g"))
        summed = backend.wait(backend.allreduce_async(torch.tensor([1.0, r]), "s", average=False))
        root = backend.wait(backend.broadcast_async(torch.tensor([r, r]), 2, "b"))
        block = backend.wait(backend.alltoall_async(torch.arange(3) + 10 * r, [1, 1, 1], "a"))
        second = backend.wait(backend.allreduce_async(torch.tensor([2.0]), "s", average=True))  # a name used again
        return gathered, summed, root, block, second

    for result, r in zip(run_world(3, body), range(3), strict=True):
        gathered, summed, root, block, second = result
        assert gathered[:, 0].tolist() == [0, 1, 1, 2, 2, 2]
        assert summed.tolist() == [3.0, 3.0] and root.tolist() == [2, 2] and second.tolist() == [2.0]
        assert block.tolist() == [r, 10 + r, 20 + r]


def test_ranks_that_launch_different_collectives_deadlock_loudly_and_the_workers_recover():
    def body(backend):
        name = "x" if backend.rank() == 0 else "y"
        return backend.wait(backend.allreduce_async(torch.ones(2), name, average=False))

    lockstep = LockStep(2)
    world = SimulatedWorld(2, lockstep)
    with pytest.raises(Deadlock, match="allreduce 'x'.*launched by 1 of 2 ranks: 0"):
        lockstep.run([lambda r=r: body(world.backend(r)) for r in range(2)])
    world.abandon()
    with pytest.raises(RuntimeError, match="launched as allgather") as error:
        lockstep.run([lambda: world.backend(0).wait(world.backend(0).allgather_async(torch.ones(1), "z")),
                      lambda: world.backend(1).wait(world.backend(1).allreduce_async(torch.ones(1), "z", False))])
    assert "simulated worker" in str(error.value.__notes__)
    world.abandon()
    assert lockstep.run([lambda: 1, lambda: 2]) == [1, 2]  # still usable
    lockstep.close()


# -- a simulation against an independent in-process world ----------------------------------------

INIT = {}


def trained_by_threads(make, world: int, steps: int = 2) -> list[dict[str, torch.Tensor]]:
    """The synchronized gradients of every step by ``world`` threads exchanging through
    ``tests.helpers``' world (sums in rank order), each driven as the optimizer drives a rank."""
    if not INIT:
        torch.manual_seed(0)
        INIT.update(Net().state_dict())

    def body(backend):
        model = Net()
        model.load_state_dict(INIT)
        bundle = as_bundle(make(), "test")
        plan_buckets(bundle, model.named_parameters())
        sgd = torch.optim.SGD(model.parameters(), lr=0.05)
        out = []
        for step in range(steps):
            model.zero_grad()
            x, y = batch(step, backend.rank())
            nn.functional.cross_entropy(model(x), y).backward()
            synced = synchronize(bundle, {n: p.grad for n, p in model.named_parameters()}, backend)
            for n, p in model.named_parameters():
                p.grad = synced[n]
            sgd.step()
            out.append(synced)
        return out, bundle.stats

    return run_ranks(world, body)


def simulated(make, world: int, steps: int = 2, **options) -> tuple[list[dict[str, torch.Tensor]], list]:
    model = Net()
    model.load_state_dict(INIT)
    with Simulation(model, lambda w: make(), world, vectorize=False, check=True, **options) as sim:
        sgd = torch.optim.SGD(model.parameters(), lr=0.05)
        out = []
        for step in range(steps):
            sim.backward([batch(step, r) for r in range(world)])
            out.append({n: p.grad.clone() for n, p in model.named_parameters()})
            sgd.step()
        return out, sim.stats


@pytest.mark.parametrize("label,make", [
    ("Top-k gathered by part", lambda: Grace(TopK(0.1), Residual(), communicator=Allgather())),
    ("QSGD gathered, stacked", lambda: Grace(QSGD(4, seed=1), communicator=Allgather(), dense_fallback=False)),
    ("Threshold gathered with headers", lambda: Grace(Threshold(0.02), Residual(), communicator=Allgather())),
    ("QSGD two-phase with owners' feedback", lambda: Grace(QSGD(4, seed=2), Residual(), communicator=ScatterGather())),
    ("Legacy by layer, dense group", lambda: Grace(Legacy(TopK(), by="layer", values=[None, 0.2], splits=[10]))),
])
def test_a_simulation_equals_threads_exchanging_the_same_payloads(label, make):
    threads = trained_by_threads(make, 3)
    for share in (True, False):
        grads, stats = simulated(make, 3, share=share)
        for rank, (expected, rank_stats) in enumerate(threads):
            for step, step_grads in enumerate(expected):
                for name, tensor in step_grads.items():
                    assert torch.equal(bits(grads[step][name]), bits(tensor)), (label, share, rank, step, name)
            for key in ("bytes_sent", "wire_bytes", "tensors_by_route"):
                assert stats[rank][key] == rank_stats[key], (label, share, rank, key)


def test_partial_participation_forms_a_world_of_the_participants():
    torch.manual_seed(0)
    model = Net()
    with Simulation(model, lambda w: Grace(NoCompression(), NoMemory()), 6, vectorize=False) as sim:
        chosen = participants(6, 0.5, torch.Generator().manual_seed(3))
        assert len(chosen) == 3
        sim.backward({w: batch(0, w) for w in chosen})
        grads = WorkerGradients(model, nn.functional.cross_entropy, vectorize=False)(
            [batch(0, w)[0] for w in chosen], [batch(0, w)[1] for w in chosen], chosen)[0]
        for name, p in model.named_parameters():
            expected = (grads[name][0] + grads[name][1] + grads[name][2]) / 3
            assert torch.equal(p.grad, expected), name
        assert [s["bytes_sent"] > 0 for s in sim.stats] == [w in chosen for w in range(6)]


def test_partial_participation_refuses_schedules_only_participants_could_follow():
    model = Net()
    make = lambda w: Grace(Legacy(TopK(), by="epoch", values=[0.5, 0.1], epochs=2, steps_per_epoch=3))  # noqa: E731
    with Simulation(model, make, 4, vectorize=False) as sim, pytest.raises(ValueError, match="set_epoch"):
        sim.backward({0: batch(0, 0), 2: batch(0, 2)})


# -- gradients -----------------------------------------------------------------------------------

def test_looped_gradients_are_each_ranks_backward_and_vectorised_ones_agree_within_rounding():
    torch.manual_seed(0)
    model = Net()
    xs, ys = zip(*[batch(0, r) for r in range(4)], strict=True)
    looped, _ = WorkerGradients(model, nn.functional.cross_entropy, vectorize=False)(list(xs), list(ys), range(4))
    batched, _ = WorkerGradients(model, nn.functional.cross_entropy, vectorize=True)(list(xs), list(ys), range(4))
    for r in range(4):
        model.zero_grad()
        nn.functional.cross_entropy(model(xs[r]), ys[r]).backward()
        for name, p in model.named_parameters():
            assert torch.equal(looped[name][r], p.grad), name
            torch.testing.assert_close(batched[name][r], p.grad, rtol=1e-5, atol=1e-6)


def test_a_model_that_cannot_be_vectorised_falls_back_to_the_loop_or_fails_clearly():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    xs, ys = [torch.randn(5, 3) for _ in range(3)], [torch.randint(0, 2, (5,)) for _ in range(3)]
    with pytest.raises(RuntimeError, match="cannot vectorise"):
        WorkerGradients(model, nn.functional.cross_entropy, vectorize=True)(xs, ys, range(3))
    gradients = WorkerGradients(model, nn.functional.cross_entropy)
    with pytest.warns(RuntimeWarning, match="one worker after another"):
        gradients(xs, ys, range(3))
    assert gradients.vectorized is False and gradients.fallback_reason
    # Each worker keeps its own running statistics; the model holds worker 0's.
    assert not torch.equal(gradients._buffers[1]["1.running_mean"], gradients._buffers[0]["1.running_mean"])
    assert torch.equal(model[1].running_mean, gradients._buffers[0]["1.running_mean"])


# -- data --------------------------------------------------------------------------------------------

def test_iid_and_dirichlet_shards_split_the_samples_and_batches_go_through_each_shard():
    labels = torch.arange(200) % 5
    inputs = torch.arange(200).float()
    iid = Shards.iid(inputs, labels, 7, 4, seed=1)
    assert sorted(torch.cat(iid.shards).tolist()) == list(range(200)) and max(iid.sizes()) - min(iid.sizes()) <= 1
    seen = torch.cat([iid.batches([2])[2][0] for _ in range(len(iid.shards[2]) // 4)])
    assert len(set(seen.tolist())) == len(seen)  # one pass: no sample twice
    skewed = Shards.dirichlet(inputs, labels, 4, 2, alpha=0.1, seed=1)
    mixed = Shards.dirichlet(inputs, labels, 4, 2, alpha=100.0, seed=1)
    for shards in (skewed, mixed):
        assert sorted(torch.cat(shards.shards).tolist()) == list(range(200))

    def top_class_share(shards: Shards) -> float:
        return float(np.mean([torch.bincount(labels[s], minlength=5).max().item() / len(s) for s in shards.shards]))

    assert top_class_share(skewed) > 0.6 > 0.35 > top_class_share(mixed)
    assert Shards.dirichlet(inputs, labels, 4, 2, alpha=0.1, seed=1).sizes() == skewed.sizes()


# -- bad input ---------------------------------------------------------------------------------------

def test_bad_input_is_refused_naming_the_argument():
    model = Net()
    with pytest.raises(ValueError, match="workers must be a positive integer"):
        Simulation(model, lambda w: TopK(0.1), 0)
    with pytest.raises(TypeError, match="workers"):
        Simulation(model, lambda w: TopK(0.1), "2")
    shared = Grace(TopK(0.1))
    with pytest.raises(ValueError, match="share"):
        Simulation(model, lambda w: shared, 2)
    x, y = torch.randn(10, 3), torch.arange(10) % 2
    with pytest.raises(ValueError, match="at least 11 samples"):
        Shards.iid(x, y, 11, 1)
    with pytest.raises(ValueError, match="alpha"):
        Shards.dirichlet(x, y, 5, 2, alpha=1e-3)
    with pytest.raises(ValueError, match="fraction"):
        participants(4, 1.5, torch.Generator())
    with Simulation(model, lambda w: TopK(0.1), 2, vectorize=False) as sim, pytest.raises(ValueError, match="workers"):
        sim.backward({3: batch(0, 0)})
    with pytest.raises(ValueError, match="vectorize"):
        WorkerGradients(model, nn.functional.cross_entropy, vectorize="yes")
