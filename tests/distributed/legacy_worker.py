"""LEGACY checks, run on every rank under horovodrun with Horovod's tensor fusion off, at any
number of ranks: with no communicator named the bundle keeps GRACE's result (the mean of every
rank's own top-k) however many ranks there are, and ``communicator="auto"`` may take the two-phase
route instead.

The parameter each parameter should get is computed here from the rules written out literally
(first group with n < split; first phase with e < (i + 1) * E / P), and the synchronized gradient
is compared with the mean over ranks of each rank's own top-k at that density. Layers the rule
leaves dense must equal a plain ``hvd.allreduce`` of the local gradient bit for bit (fusion is off
so that both run the same ring over the same tensor).
"""

from __future__ import annotations

import itertools

import horovod.torch as hvd
import torch

from grace_legacy import Grace, Legacy, NoMemory, Residual, TopK
from tests.distributed.checks import Recorder, gather_from_ranks, mean_of, parse_args, topk_goes_dense, topk_reference
from tests.distributed.harness import STEPS, Net, train_and_compare

SPLITS = [30, 500]
LAYER_VALUES = [1.0, 0.2, 0.05]
_dense_calls = itertools.count()


def group_rule(numel: int) -> int:
    return next((i for i, split in enumerate(SPLITS) if numel < split), len(SPLITS))


def phase_rule(epoch: float, epochs: int, phases: int) -> int:
    return next((i for i in range(phases) if epoch < (i + 1) * epochs / phases), phases - 1)


def dense_allreduce(grad: torch.Tensor) -> torch.Tensor:
    return hvd.allreduce(grad, op=hvd.Average, name=f"dense-reference.{next(_dense_calls)}")


def sent_dense(density: float, numel: int) -> bool:
    """Dense by the schedule (1.0) or by the bundle's dense fallback."""
    return density == 1.0 or topk_goes_dense(numel, density, hvd.size())


def reference_for(density_of, memory: dict | None = None):
    """``density_of(numel, step)`` -> density or 1.0; ``memory`` carries residuals if given."""
    def reference(name, grad, step):
        density = density_of(grad.numel(), step)
        compensated = grad if memory is None else grad + memory.get(name, torch.zeros_like(grad))
        if sent_dense(density, grad.numel()):
            memory is not None and memory.pop(name, None)
            return dense_allreduce(compensated)
        sent = topk_reference(compensated, density)
        if memory is not None:
            memory[name] = compensated - sent
        return mean_of(gather_from_ranks(sent))
    return reference


def dense_names(density_of, step_set=range(STEPS)) -> frozenset:
    model = Net()
    return frozenset(n for n, p in model.named_parameters()
                     if all(sent_dense(density_of(p.numel(), s), p.numel()) for s in step_set))


def main() -> None:
    args = parse_args()
    hvd.init()
    torch.set_num_threads(1)
    rec = Recorder(args.out)

    # The spelling: uniform Top-k, no memory, the default communicator.
    uniform = Grace(TopK(0.1), memory=NoMemory())
    rec.guard("uniform", train_and_compare, rec, "uniform", uniform, reference_for(lambda numel, step: 0.1))
    rec.check("uniform: no tensor took the two-phase route", "scattergather" not in uniform.stats["tensors_by_route"],
              str(uniform.stats["tensors_by_route"]))

    # The mission's spelling: a bare schedule, its recommended memory (error feedback).
    def layer_density(numel, step):
        return LAYER_VALUES[group_rule(numel)]

    bare_residuals: dict[str, torch.Tensor] = {}
    bare = Legacy(TopK(), by="layer", values=LAYER_VALUES, splits=SPLITS)
    rec.guard("bare", train_and_compare, rec, "bare", bare, reference_for(layer_density, bare_residuals),
              exact=dense_names(layer_density))

    # One argument away: the route of fewest link bytes, the two-phase one among them from 3 ranks.
    auto = Grace(TopK(0.1), memory=NoMemory(), communicator="auto")
    rec.guard("auto", train_and_compare, rec, "auto", auto, None)
    took_two_phase = "scattergather" in auto.stats["tensors_by_route"]
    rec.check("auto: the two-phase route from 3 ranks", took_two_phase == (hvd.size() >= 3),
              str(auto.stats["tensors_by_route"]))
    rec.check("auto: no more link bytes than the default", auto.stats["wire_bytes"] <= uniform.stats["wire_bytes"],
              f"{auto.stats['wire_bytes']} > {uniform.stats['wire_bytes']}")

    # by="layer", no memory.
    layer = Legacy(TopK(), by="layer", values=LAYER_VALUES, splits=SPLITS)
    layer_bundle = Grace(layer, memory=NoMemory())
    rec.guard("layer", train_and_compare, rec, "layer", layer_bundle,
              reference_for(layer_density), exact=dense_names(layer_density))
    stats = layer_bundle.stats
    rec.check("layer: every group was used", set(stats["group"]) == {0, 1, 2}, str(stats))
    rec.check("layer: dense group went by dense allreduce",
              stats["tensors_by_route"].get("dense", 0) == STEPS * sum(
                  1 for p in Net().parameters() if group_rule(p.numel()) == 0), str(stats["tensors_by_route"]))

    # by="layer" with error feedback: the dense group must carry no residual.
    residuals: dict[str, torch.Tensor] = {}
    layer_ef = Grace(Legacy(TopK(), by="layer", values=LAYER_VALUES, splits=SPLITS), memory=Residual())
    rec.guard("layer+residual", train_and_compare, rec, "layer+residual", layer_ef,
              reference_for(layer_density, residuals), exact=dense_names(layer_density))
    kept_names, expected_names = sorted(layer_ef.memory.residuals), sorted(residuals)
    rec.check("layer+residual: residuals kept exactly for compressed layers", kept_names == expected_names,
              f"{kept_names} vs {expected_names}")
    for name, expected in residuals.items():
        rec.close(layer_ef.memory.residuals[name], expected, f"layer+residual: residual {name}")

    # by="epoch", counting steps: one phase per step, so the run crosses two phase changes.
    epoch_values = [0.3, 0.1, 0.02]

    def epoch_density(numel, step):
        return epoch_values[phase_rule(step, 3, 3)]

    by_epoch = Legacy(TopK(), by="epoch", values=epoch_values, epochs=3, steps_per_epoch=1)
    epoch_bundle = Grace(by_epoch, memory=NoMemory())
    rec.guard("epoch", train_and_compare, rec, "epoch", epoch_bundle, reference_for(epoch_density))
    rec.check("epoch: counted one step per synchronize", by_epoch.steps == STEPS, f"steps={by_epoch.steps}")
    rec.check("epoch: every phase was used", set(epoch_bundle.stats["phase"]) == {0, 1, 2},
              str(epoch_bundle.stats))

    # by="both", driven by set_epoch: 2 equal phases over 2 epochs, epoch 2 stays in the last.
    table = [[1.0, 0.2, 0.05], [1.0, 0.1, 0.01]]

    def both_density(numel, step):
        return table[phase_rule(step, 2, 2)][group_rule(numel)]

    both = Legacy(TopK(), by="both", values=table, splits=SPLITS, epochs=2)
    rec.guard("both", train_and_compare, rec, "both", Grace(both, memory=NoMemory()),
              reference_for(both_density),
              before_step=both.set_epoch, exact=dense_names(both_density))

    # Budget matching: a shaped schedule spends what uniform Top-k spends, measured.
    target = 0.05
    sizes = [p.numel() for p in Net().parameters()]
    uniform = TopK(target)
    matched = Legacy.budget_matched(TopK(), target, by="both", sizes=sizes, splits=SPLITS, layer_factors=[4, 2, 1],
                                    phase_factors=[2, 1, 0.5], epochs=3, steps_per_epoch=1, world_size=hvd.size())
    volumes = {}
    for label, compression in (("uniform", uniform), ("matched", matched)):
        bundle = Grace(compression, memory=NoMemory())
        rec.guard(f"budget/{label}", train_and_compare, rec, f"budget/{label}", bundle, None)
        volumes[label] = bundle.stats["volume"]
    gap = abs(volumes["matched"] - volumes["uniform"]) / volumes["uniform"]
    rec.check("budget: matched volume within 2% of uniform", gap < 0.02,
              f"matched {volumes['matched']:.5f} vs uniform {volumes['uniform']:.5f} ({gap:.2%})")
    rec.extra["budget"] = {"uniform": volumes["uniform"], "matched": volumes["matched"],
                           "schedule": repr(matched)}
    rec.write()


if __name__ == "__main__":
    main()
