"""Every registered compressor case (``tests/registry.py``), trained through the stock
``hvd.DistributedOptimizer`` and compared at every step with an independent aggregation of its
twin's decompressed payloads.

Run with ``--cases FAMILY ...`` to pick families of cases (``zoo.FAMILIES``); all by default, and
``--dtypes`` to train the model in float32 (the default), float16 and/or bfloat16, each case once
per dtype: its gradients, the twin's and every rule's arithmetic are then in that dtype.
"""

from __future__ import annotations

import horovod.torch as hvd
import torch

from grace_legacy.grace import _DENSE
from grace_legacy.runtime import paths, wire
from tests.distributed.checks import Recorder, gather_from_ranks, gathered_goes_dense, parse_args
from tests.distributed.harness import STEPS, Net, batch, local_gradients, loss_of
from tests.distributed.zoo import FAMILIES, Observation, cases, mean_rule
from tests.reference import beyond_bound, expected_and_bound, twin_contributions

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def predicted_packed_bytes(concrete, tensor: torch.Tensor) -> int | None:
    try:
        spec = concrete.payload_spec_for(tensor.shape, tensor.dtype)
    except NotImplementedError:
        return None
    return wire.packed_size_of(spec, with_header=not concrete.traits.uniform_payload)


def twin_step(twin, memory, grad: torch.Tensor, name: str, communicator, dense_fallback: bool,
              world_size: int | None = None) -> tuple[torch.Tensor, int, str]:
    """What this rank contributes for ``grad``: the decompressed payload, its bytes and route.

    Bytes are counted with the gather layout, which every non-additive route (Allgather,
    Broadcast) hands to the backend byte for byte. The twin models the routes that carry each
    rank's payload whole, those a bundle with no ``communicator`` named takes at any number of
    ranks; the scatter-gather is checked against ``tests/two_phase.py``."""
    return twin_step_sent(twin, memory, grad, name, communicator, dense_fallback, world_size)[:3]


def twin_step_sent(twin, memory, grad: torch.Tensor, name: str, communicator, dense_fallback: bool,
                   world_size: int | None = None) -> tuple[torch.Tensor, int, str, list[torch.dtype]]:
    """:func:`twin_step`, and the floating dtypes its payload travels in."""
    compensated = memory.compensate(grad, name)
    concrete = twin.compressor_for(compensated, name)
    world = hvd.size() if world_size is None else world_size
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


def compare_with_rule(rec: Recorder, label: str, actual: torch.Tensor, combined: torch.Tensor, twin_memory,
                      name: str, route: str, dtypes: list[torch.dtype], contributions: list[torch.Tensor],
                      step: int, case) -> torch.Tensor:
    """Check ``actual`` against the rule's ``combined`` as the twin's memory turns it into the
    gradient, and return that. Where the backend sums in 16 bits (a 16-bit model, or a payload
    such as FP16's or BF16's) it sums in its own order and precision: held to
    :func:`summed_bound` instead of the case's tolerances. ``dtypes``: the model's, then the payload's."""
    expected, bound = expected_and_bound(combined, twin_memory, name, route, dtypes, contributions, step)
    if bound is None:
        rec.close(actual, expected, label, case.rtol, case.atol)
        return expected
    why = beyond_bound(actual, expected, bound)
    rec.check(f"{label} (within the rounding of a 16-bit sum)", why is None, why or "")
    return expected


def run_case(rec: Recorder, case, dtype: torch.dtype) -> None:
    label = f"{case.label} in {str(dtype).removeprefix('torch.')}"
    compression, twin, twin_memory = case.build()
    twin.set_rank(hvd.rank())
    torch.manual_seed(0)
    model = Net().to(dtype)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), compression=compression)
    communicator = getattr(compression, "communicator", None)
    expected_bytes, routes, observations = 0, set(), []
    for step in range(STEPS + 1):
        opt.zero_grad()
        local = local_gradients(model, step, 1)
        loss_of(model, batch(step, hvd.rank())).backward()
        opt.synchronize()
        twins = twin_contributions(lambda grad, name: twin_step_sent(
            twin, twin_memory, grad, name, communicator, getattr(compression, "dense_fallback", True)),
            {name: local[name] for name, _ in model.named_parameters()}, compression.compressor.traits.spans_step)
        # Every parameter's contribution in one gather per step, exact in float64: far fewer
        # collectives to wait for than one per parameter.
        flat = torch.cat([contribution.reshape(-1).double() for contribution, *_ in twins.values()])
        sizes = [contribution.numel() for contribution, *_ in twins.values()]
        per_rank = [torch.split(row, sizes) for row in gather_from_ranks(flat)]
        for i, (name, p) in enumerate(model.named_parameters()):
            contribution, sent, route, dtypes = twins[name]
            expected_bytes += sent
            routes.add(route)
            contributions = [parts[i].view(contribution.shape).to(contribution.dtype) for parts in per_rank]
            observations.append(Observation(step, name, contributions, route))
            # Dense tensors are averaged whatever the compressor's rule; as the bundle does, the
            # memory then turns the aggregate into the gradient (EF21, EF-signSGD).
            combined = mean_rule(contributions) if route.startswith("dense") else case.rule(contributions)
            compare_with_rule(rec, f"{label}: step {step} {name}", p.grad, combined, twin_memory, name, route,
                              [dtype, *dtypes], contributions, step, case)
            rec.check(f"{label}: step {step} {name} shape and dtype",
                      p.grad.shape == p.shape and p.grad.dtype == p.dtype)
        twin.end_step()
        with opt.skip_synchronize():
            opt.step()
    stats = compression.stats
    rec.check(f"{label}: stats bytes_sent equals the twin's payload bytes", stats["bytes_sent"] == expected_bytes,
              f"{stats['bytes_sent']} != {expected_bytes}")
    required = case.routes if dtype == torch.float32 or case.half_routes is None else case.half_routes
    rec.check(f"{label}: routes used", required <= routes, f"used {routes}, expected {required}")
    rec.check(f"{label}: the bundle's routes are the twin's", set(stats["tensors_by_route"]) == routes,
              f"bundle {stats['tensors_by_route']}, twin {routes}")
    if case.check is not None:
        rec.guard(f"{label}: final check", case.check, compression, observations)


def main() -> None:
    args = parse_args([(("--cases",), {"nargs": "*", "default": None}),
                       (("--dtypes",), {"nargs": "+", "choices": sorted(DTYPES), "default": ["float32"]})])
    hvd.init()
    torch.set_num_threads(1)
    rec = Recorder(args.out)
    labels = []
    for family in args.cases or FAMILIES:
        for case in cases(family):
            labels.append(case.label)
            for dtype in args.dtypes:
                rec.guard(f"{case.label} in {dtype}", run_case, rec, case, DTYPES[dtype])
    rec.extra["cases"] = labels
    rec.extra["device_path"] = paths.FORCE_DEVICE_PATH  # GRACE_LEGACY_DEVICE_PATH, as this process read it
    rec.extra["dtypes"] = args.dtypes
    rec.write()


if __name__ == "__main__":
    main()
