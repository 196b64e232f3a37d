"""Every registered compressor case (``tests/registry.py``), trained through the stock
``hvd.DistributedOptimizer`` and compared at every step with an independent aggregation of its
twin's decompressed payloads.

Run with ``--cases FAMILY ...`` to pick families of cases (``zoo.FAMILIES``); all by default.
"""

from __future__ import annotations

import horovod.torch as hvd
import torch

from grace_legacy.grace import _DENSE
from grace_legacy.runtime import wire
from tests.distributed.checks import Recorder, gather_from_ranks, gathered_goes_dense, parse_args
from tests.distributed.harness import STEPS, Net, batch, local_gradients, loss_of
from tests.distributed.zoo import FAMILIES, Observation, cases, mean_rule


def predicted_packed_bytes(concrete, tensor: torch.Tensor) -> int | None:
    try:
        spec = concrete.payload_spec_for(tensor.shape, tensor.dtype)
    except NotImplementedError:
        return None
    return wire.packed_size_of(spec, with_header=not concrete.uniform_payload)


def twin_step(twin, memory, grad: torch.Tensor, name: str, communicator, dense_fallback: bool,
              world_size: int | None = None) -> tuple[torch.Tensor, int, str]:
    """What this rank contributes for ``grad``: the decompressed payload, its bytes and route.

    Bytes are counted with the gather layout, which every non-additive route (Allgather,
    Broadcast) hands to the backend byte for byte."""
    compensated = memory.compensate(grad, name)
    concrete = twin.compressor_for(compensated, name)
    route = "dense"
    if concrete is not None and dense_fallback and concrete.aggregates_by_mean:
        gathered = communicator.carries_non_additive if communicator is not None else not concrete.additive
        packed = predicted_packed_bytes(concrete, compensated) if gathered else None
        world = hvd.size() if world_size is None else world_size
        if packed is not None and gathered_goes_dense(packed, grad.numel(), world, grad.element_size()):
            concrete, route = None, "dense-fallback"
    if concrete is None:
        memory.update(compensated, name, _DENSE, [compensated], None)
        return compensated, compensated.numel() * compensated.element_size(), route
    payload, ctx = concrete.compress(compensated, name)
    memory.update(compensated, name, concrete, payload, ctx)
    if concrete.additive and communicator is None:
        sent, route = sum(p.numel() * p.element_size() for p in payload), "allreduce"
    else:
        sent = wire.packed_size(payload, with_header=not concrete.uniform_payload)
        route = communicator.route if communicator is not None else "allgather"
    return concrete.decompress(payload, ctx), sent, route


def run_case(rec: Recorder, case) -> None:
    compression, twin, twin_memory = case.build()
    twin.set_rank(hvd.rank())
    torch.manual_seed(0)
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), compression=compression)
    communicator = getattr(compression, "communicator", None)
    expected_bytes, routes, observations = 0, set(), []
    for step in range(STEPS + 1):
        opt.zero_grad()
        local = local_gradients(model, step, 1)
        loss_of(model, batch(step, hvd.rank())).backward()
        opt.synchronize()
        for name, p in model.named_parameters():
            contribution, sent, route = twin_step(twin, twin_memory, local[name], name, communicator,
                                                  getattr(compression, "dense_fallback", True))
            expected_bytes += sent
            routes.add(route)
            contributions = gather_from_ranks(contribution)
            observations.append(Observation(step, name, contributions, route))
            # Dense tensors are averaged whatever the compressor's rule; as the bundle does, the
            # memory then turns the aggregate into the gradient (EF21, EF-signSGD).
            combined = mean_rule(contributions) if route.startswith("dense") else case.rule(contributions)
            expected = twin_memory.aggregated(name, combined)
            rec.close(p.grad, expected, f"{case.label}: step {step} {name}", case.rtol, case.atol)
            rec.check(f"{case.label}: step {step} {name} shape and dtype",
                      p.grad.shape == p.shape and p.grad.dtype == p.dtype)
        twin.end_step()
        with opt.skip_synchronize():
            opt.step()
    stats = compression.stats
    rec.check(f"{case.label}: stats bytes_sent equals the twin's payload bytes", stats["bytes_sent"] == expected_bytes,
              f"{stats['bytes_sent']} != {expected_bytes}")
    rec.check(f"{case.label}: routes used", case.routes <= routes, f"used {routes}, expected {case.routes}")
    rec.check(f"{case.label}: the bundle's routes are the twin's", set(stats["tensors_by_route"]) == routes,
              f"bundle {stats['tensors_by_route']}, twin {routes}")
    if case.check is not None:
        rec.guard(f"{case.label}: final check", case.check, compression, observations)


def main() -> None:
    args = parse_args([(("--cases",), {"nargs": "*", "default": None})])
    hvd.init()
    torch.set_num_threads(1)
    rec = Recorder(args.out)
    labels = []
    for family in args.cases or FAMILIES:
        for case in cases(family):
            labels.append(case.label)
            rec.guard(case.label, run_case, rec, case)
    rec.extra["cases"] = labels
    rec.write()


if __name__ == "__main__":
    main()
