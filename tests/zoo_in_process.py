"""The zoo's reference cases (:mod:`tests.registry`) over in-process ranks, on any device.

What ``tests/distributed/zoo_worker.py`` checks under horovodrun, without Horovod: ``P``
threads, one per rank, exchange through :class:`tests.helpers.ThreadBackend`. Each rank runs the
case's ``Grace`` bundle as the distributed optimizer does (buckets planned from the tensors, every
tensor started, then every result waited for, then ``end_step``) and its twin beside it on the same
gradient; the twins' decompressed payloads are gathered and combined by the case's rule (or
averaged where the route was dense), and the bundle's synchronized gradient must equal that on
every rank, within the case's tolerances (bit for bit for the quantizers), or, where the backend
sums in 16 bits (FP16's and BF16's payloads), within the rounding of such a sum
(:func:`tests.reference.summed_bound`). The bytes the bundle
counts must equal the twin's payload bytes, and the routes the twin's.

The cases' twins model the single-stage routes (allreduce, allgather, broadcast), which a default
bundle takes at two ranks; from three on it sends gathered payloads along the two-phase
scatter-gather, whose own reference (``tests/two_phase.py``) :func:`run_two_phase_case` holds it
to, bit for bit.

The gradients are made up, not a model's: shapes from a 0-dim scale to a tensor large enough that
the compiled CPU passes go by blocks on several threads (``huge``), values scaled per tensor and
rank as a small network's are (so that Threshold(0.1) leaves some tensors empty on some ranks
and some on every rank, as its case checks). They live on ``device``: the device check
(``python -m benchmarks.device_check``) runs these cases on a GPU, the unit tests on the CPU, there
along both paths (:mod:`grace_legacy.runtime.paths`).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch

from grace_legacy import Grace, ScatterGather
from grace_legacy.grace import _DENSE
from grace_legacy.runtime import wire
from tests import two_phase
from tests.helpers import ThreadBackend, bits, run_ranks
from tests.reference import Case, Observation, expected_and_bound, mean_rule, mismatch, twin_contributions

#: name -> (shape, scale of rank 0's entries; rank r's are (1 + r) times larger)
TENSORS: dict[str, tuple[tuple[int, ...], float]] = {
    "conv.weight": ((4, 2, 3), 0.05),
    "conv.bias": ((4,), 0.02),
    "fc1.weight": ((40, 24), 0.01),
    "fc1.bias": ((40,), 0.05),
    "wide.weight": ((300, 200), 0.002),
    "huge.weight": ((640, 1000), 0.001),
    "fc2.bias": ((5,), 0.1),
    "scale": ((), 0.01),
    "shift": ((1,), 1e-9),
}
#: Steps each case runs (the zoo worker's STEPS + 1).
STEPS = 4


def gradient(name: str, rank: int, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Rank ``rank``'s made-up gradient of ``name`` at ``step``: normal entries of the tensor's scale."""
    shape, scale = TENSORS[name]
    generator = torch.Generator().manual_seed(zlib.crc32(f"{name}/{rank}/{step}".encode()))
    return (torch.randn(shape, generator=generator) * (scale * (1 + rank))).to(device)


def predicted_packed_bytes(concrete, tensor: torch.Tensor) -> int | None:
    try:
        spec = concrete.payload_spec_for(tensor.shape, tensor.dtype)
    except NotImplementedError:
        return None
    return wire.packed_size_of(spec, with_header=not concrete.traits.uniform_payload)


def gathered_goes_dense(packed_bytes: int, numel: int, world: int, element_size: int) -> bool:
    """The documented dense fallback, written out: a gathered payload goes dense when it is at
    least the dense size times min(1, 2 / world)."""
    dense = numel * element_size
    return packed_bytes * world >= 2 * dense if world > 2 else packed_bytes >= dense


def twin_step(twin, memory, grad: torch.Tensor, name: str, communicator, dense_fallback: bool,
              world: int) -> tuple[torch.Tensor, int, str]:
    """What this rank contributes for ``grad`` by the twin: the decompressed payload, its bytes
    and its route (as ``zoo_worker.twin_step``, for any world)."""
    return twin_step_sent(twin, memory, grad, name, communicator, dense_fallback, world)[:3]


def twin_step_sent(twin, memory, grad: torch.Tensor, name: str, communicator, dense_fallback: bool,
                   world: int) -> tuple[torch.Tensor, int, str, list[torch.dtype]]:
    """:func:`twin_step`, and the floating dtypes its payload travels in."""
    compensated = memory.compensate(grad, name)
    concrete = twin.compressor_for(compensated, name)
    route = "dense"
    if concrete is not None and dense_fallback and concrete.traits.aggregates_by_mean:
        gathered = communicator.carries_non_additive if communicator is not None else not concrete.traits.additive
        packed = predicted_packed_bytes(concrete, compensated) if gathered else None
        if packed is not None and gathered_goes_dense(packed, grad.numel(), world, grad.element_size()):
            concrete, route = None, "dense-fallback"
    if concrete is None:
        memory.update(compensated, name, _DENSE, [compensated], None)
        return compensated, compensated.numel() * compensated.element_size(), route, [compensated.dtype]
    payload, ctx = concrete.compress(compensated, name)
    memory.update(compensated, name, concrete, payload, ctx)
    if concrete.traits.additive and communicator is None:
        sent, route = sum(p.numel() * p.element_size() for p in payload), "allreduce"
    else:
        sent = wire.packed_size(payload, with_header=not concrete.traits.uniform_payload)
        route = communicator.route if communicator is not None else "allgather"
    return concrete.decompress(payload, ctx), sent, route, [p.dtype for p in payload if p.is_floating_point()]


@dataclass
class RankReport:
    """What one rank saw: failed checks, and every step's twin contributions (for ``case.check``)."""

    failures: list[str] = field(default_factory=list)
    observations: list[Observation] = field(default_factory=list)
    compression: object = None


def _gather(backend: ThreadBackend, tensor: torch.Tensor, name: str) -> list[torch.Tensor]:
    rows = backend.wait(backend.allgather_async(tensor.detach().reshape(1, -1).clone(), name))
    return [row.view(tensor.shape) for row in rows]


def _rank(case: Case, backend: ThreadBackend, device: torch.device, steps: int, names: list[str]) -> RankReport:
    report = RankReport()
    rank, world = backend.rank(), backend.size()
    compression, twin, twin_memory = case.build()
    report.compression = compression
    twin.set_rank(rank)
    compression.plan_buckets([(name, gradient(name, 0, 0).numel() * 4) for name in names])
    communicator = getattr(compression, "communicator", None)
    expected_bytes, routes = 0, set()
    for step in range(steps):
        local = {name: gradient(name, rank, step, device) for name in names}
        pending = {name: compression.start(local[name].clone(), name, backend, True) for name in names}
        results = {name: wait() for name, wait in pending.items()}
        twins = twin_contributions(lambda grad, name: twin_step_sent(
            twin, twin_memory, grad, name, communicator, getattr(compression, "dense_fallback", True), world),
            local, compression.compressor.traits.spans_step)
        for name in names:
            contribution, sent, route, dtypes = twins[name]
            expected_bytes += sent
            routes.add(route)
            contributions = _gather(backend, contribution, f"reference.{step}.{name}")
            report.observations.append(Observation(step, name, contributions, route))
            combined = mean_rule(contributions) if route.startswith("dense") else case.rule(contributions)
            expected, bound = expected_and_bound(combined, twin_memory, name, route, [local[name].dtype, *dtypes],
                                                 contributions, step)
            got = results[name]
            where = f"{case.label}: rank {rank} step {step} {name}"
            if got.shape != local[name].shape or got.dtype != local[name].dtype or got.device != local[name].device:
                report.failures.append(f"{where}: {tuple(got.shape)} {got.dtype} on {got.device}, expected "
                                       f"{tuple(local[name].shape)} {local[name].dtype} on {local[name].device}")
                continue
            why = mismatch(got, expected, bound, case.rtol, case.atol)
            if why is not None:
                report.failures.append(f"{where}: {why}")
        compression.end_step(backend)
        twin.end_step()
    stats = compression.stats
    if stats["bytes_sent"] != expected_bytes:
        report.failures.append(f"{case.label}: rank {rank}: bytes_sent {stats['bytes_sent']} != the twin's "
                               f"{expected_bytes}")
    if not case.routes <= routes:
        report.failures.append(f"{case.label}: rank {rank}: routes used {routes}, expected {case.routes}")
    if set(stats["tensors_by_route"]) != routes:
        report.failures.append(f"{case.label}: rank {rank}: the bundle's routes {sorted(stats['tensors_by_route'])} "
                               f"are not the twin's {sorted(routes)}")
    return report


def run_case(case: Case, world: int = 2, device: torch.device | str = "cpu", steps: int = STEPS,
             names: list[str] | None = None) -> list[str]:
    """Run ``case`` on ``world`` in-process ranks with gradients on ``device`` (the tensors ``names``,
    default all of :data:`TENSORS`); every failed check, described (empty when the case holds)."""
    device = torch.device(device)
    chosen = list(TENSORS) if names is None else list(names)
    reports = run_ranks(world, lambda backend: _rank(case, backend, device, steps, chosen))
    failures = [failure for report in reports for failure in report.failures]
    if case.check is not None and not failures:
        try:
            case.check(reports[0].compression, reports[0].observations)
        except AssertionError as err:
            failures.append(f"{case.label}: final check: {err}")
    return failures


def run_two_phase_case(label: str, world: int = 3, device: torch.device | str = "cpu") -> list[str]:
    """The scatter-gather's case ``label`` (:data:`tests.two_phase.SETUPS`) on ``world`` in-process
    ranks, the bucket's tensors fused, gradients on ``device``: every rank's synchronized tensors
    must be, bit for bit, the independent two-phase reference's (run on the same device); every
    failed check, described."""
    device = torch.device(device)
    make, memory = two_phase.SETUPS[label]
    # Without the dense fallback, so that every tensor takes the scatter-gather, as in the reference.
    bundles = [Grace(make(), memory=memory(), communicator=ScatterGather(), dense_fallback=False,
                     bucket_bytes=1 << 20) for _ in range(world)]
    for bundle in bundles:
        bundle.plan_buckets([(name, 4) for name in two_phase.SIZES])

    def body(backend: ThreadBackend) -> list[list[torch.Tensor]]:
        bundle, results = bundles[backend.rank()], []
        for step in range(two_phase.STEPS):
            mine = two_phase.gradients(world, step, device=device)[backend.rank()]
            pending = {name: bundle.start(g, name, backend, average=True)
                       for name, g in zip(two_phase.SIZES, mine, strict=True)}
            results.append([pending[name]() for name in two_phase.SIZES])
            bundle.end_step()
        return results

    per_rank = run_ranks(world, body)
    expected = two_phase.reference(label, world, torch.float32, device)
    failures = []
    for rank, steps in enumerate(per_rank):
        for step, (got, want) in enumerate(zip(steps, expected, strict=True)):
            for name, g, e in zip(two_phase.SIZES, got, want, strict=True):
                where = f"scatter-gather {label}: rank {rank} step {step} {name}"
                if g.shape != e.shape or g.dtype != e.dtype or g.device != e.device:
                    failures.append(f"{where}: {tuple(g.shape)} {g.dtype} on {g.device}, expected "
                                    f"{tuple(e.shape)} {e.dtype} on {e.device}")
                elif not torch.equal(bits(g), bits(e)):
                    failures.append(f"{where}: not the reference's bits (largest difference "
                                    f"{(g.double() - e.double()).abs().max().item():.3g})")
    return failures
