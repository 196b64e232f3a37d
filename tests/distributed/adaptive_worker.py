"""The adaptive schedules under horovodrun: DGC's warm-up, Accordion and L-GreCo.

Each case trains the harness model through the stock ``hvd.DistributedOptimizer`` and, at every
step, compares each synchronized gradient with the mean of every rank's twin payload, decoded,
where the twin compresses this rank's own gradient at the parameter chosen *here*:

* DGC warm-up: the densities / levels are written out from the formula in the test;
* Accordion: an independent re-implementation of the rule (accumulated norms of the synchronized
  gradient, ratio against eta, learning-rate drop) picks the parameter, and must also agree with the
  schedule's own choice;
* L-GreCo: the twin takes the schedule's choice (the schedule's whole point is that choice), and
  rank 0 checks each solve against errors and sizes it computes independently (a sorted top-k and
  the byte rule ``8k``/``4n``) by brute force over every assignment.

The bundle takes the gather route (``Allgather()``), whose result the mean of decoded payloads is;
the scatter-gather, the default from 3 ranks, has its own reference (tests/two_phase.py) and tests.

Every rank also compares its decisions with every other rank's at every step. For L-GreCo, ranks
other than 0 zero their accumulated gradients right before every solve, so their own solution
differs from rank 0's: the broadcast must still make them apply rank 0's.
"""

from __future__ import annotations

import itertools
import math

import horovod.torch as hvd
import torch

from grace_legacy import DGC, QSGD, Accordion, Allgather, DGCMemory, DGCWarmup, Grace, LGreCo, NoMemory, Residual, TopK
from grace_legacy.core.seeds import derived_seed
from grace_legacy.schedules.lgreco import LGreCo as LGreCoClass
from tests.distributed.checks import Recorder, gather_from_ranks, kept, parse_args, topk_reference
from tests.distributed.harness import Net, batch, local_gradients, loss_of
from tests.distributed.zoo import mean_rule
from tests.distributed.zoo_worker import twin_step


class NamedRuleTwin:
    """Like zoo.RuleTwin, but the rule sees the tensor's name: ``choose(name, numel) -> value``."""

    def __init__(self, base, choose) -> None:
        self.base, self.choose = base, choose
        self.configured: dict = {}

    def set_rank(self, rank: int) -> None:
        self.base.set_rank(rank)
        for c in self.configured.values():
            c.set_rank(rank)

    def compressor_for(self, tensor: torch.Tensor, name: str):
        value = self.choose(name, tensor.numel())
        if self.base.parameter.is_dense(value):
            return None
        if value not in self.configured:
            self.configured[value] = self.base.with_value(value)
        return self.configured[value].compressor_for(tensor, name)


def run_case(rec: Recorder, label: str, schedule, memory, twin, twin_memory, steps: int, *, before_step=None,
             after_sync=None, rtol=1e-6, atol=1e-7, process_set=hvd.global_process_set,
             dense_fallback: bool = True) -> Grace:
    """Train ``steps`` steps; ``before_step(step, decided)`` sees the schedule's parameter per parameter
    for the step, ``after_sync(step, model)`` runs once the gradients are synchronized. Returns the
    bundle (its stats)."""
    grace = Grace(schedule, memory=memory, communicator=Allgather(), dense_fallback=dense_fallback)
    twin.set_rank(process_set.rank())
    torch.manual_seed(0)
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), compression=grace,
                                   process_set=process_set)
    expected_bytes, routes = 0, set()
    for step in range(steps):
        decided = {name: schedule.value_for(p, name) for name, p in model.named_parameters()}
        if before_step is not None:
            before_step(step, decided)
        opt.zero_grad()
        local = local_gradients(model, step, 1)
        loss_of(model, batch(step, hvd.rank())).backward()
        opt.synchronize()
        contributions = {}
        for name, _ in model.named_parameters():
            contributions[name], sent, route = twin_step(twin, twin_memory, local[name], name, grace.communicator,
                                                         grace.dense_fallback, process_set.size())
            expected_bytes += sent
            routes.add(route)
        # One gather per step, of this step's decisions (-1: dense) and every parameter's
        # contribution, all exact in float64: far fewer collectives to wait for.
        parameters = torch.tensor([-1.0 if v is None else float(v) for v in decided.values()], dtype=torch.float64)
        flat = torch.cat([parameters, *(c.reshape(-1).double() for c in contributions.values())])
        sizes = [len(parameters), *(c.numel() for c in contributions.values())]
        per_rank = [torch.split(f, sizes) for f in gather_from_ranks(flat, process_set)]
        rec.check(f"{label}: step {step} every rank made the same decisions",
                  all(torch.equal(parts[0], per_rank[0][0]) for parts in per_rank),
                  f"{[parts[0].tolist() for parts in per_rank]}")
        for i, (name, p) in enumerate(model.named_parameters(), start=1):
            ranks = [parts[i].view(p.shape).to(p.dtype) for parts in per_rank]
            expected = twin_memory.aggregated(name, mean_rule(ranks))
            rec.close(p.grad, expected, f"{label}: step {step} {name} at {decided[name]}", rtol, atol)
        if after_sync is not None:
            after_sync(step, model)
        with opt.skip_synchronize():
            opt.step()
    stats = grace.stats
    rec.check(f"{label}: stats bytes_sent equals the twin's payload bytes", stats["bytes_sent"] == expected_bytes,
              f"{stats['bytes_sent']} != {expected_bytes}")
    rec.check(f"{label}: the bundle's routes are the twin's", set(stats["tensors_by_route"]) == routes,
              f"bundle {stats['tensors_by_route']}, twin {routes}")
    rec.extra.setdefault("stats", {})[label] = {k: v for k, v in stats.items() if k not in ("lgreco",)}
    return grace


# -- DGC warm-up ----------------------------------------------------------------------------------


def dgc_warmup_case(rec: Recorder) -> None:
    # The paper's factor-of-4 warm-up to 1%, one step per epoch: 0.25, 0.0625, 0.015625, then 0.01.
    densities = [0.25, 0.0625, 0.015625, 0.01]
    now = {"step": 0}
    schedule = DGCWarmup(DGC(seed=5, min_samples=16), target=0.01, warmup_epochs=3, coeff=0.25, steps_per_epoch=1)
    twin = NamedRuleTwin(DGC(seed=5, min_samples=16), lambda name, n: densities[min(now["step"], 3)])

    def before(step, decided):
        now["step"] = step
        rec.check(f"dgc-warmup: step {step} density", set(decided.values()) == {densities[min(step, 3)]},
                  str(decided))

    stats = run_case(rec, "dgc-warmup", schedule, DGCMemory(0.9), twin, DGCMemory(0.9), 4, before_step=before).stats
    rec.check("dgc-warmup: every phase was used", set(stats["phase"]) == {0, 1, 2, 3}, str(stats["phase"]))


def qsgd_warmup_case(rec: Recorder) -> None:
    # An integer parameter: levels from 64 towards 4 over 2 epochs of one step, rounded to the nearest.
    levels = [math.floor(64 * (4 / 64) ** ((e + 1) / 3) + 0.5) for e in range(2)] + [4]
    now = {"step": 0}
    schedule = DGCWarmup(QSGD(seed=7), target=4, start=64, warmup_epochs=2, steps_per_epoch=1)
    twin = NamedRuleTwin(QSGD(seed=7), lambda name, n: levels[min(now["step"], 2)])

    def before(step, decided):
        now["step"] = step
        rec.check(f"qsgd-warmup: step {step} levels", set(decided.values()) == {levels[min(step, 2)]}, str(decided))

    # Bit for bit: without the dense fallback, whose allreduce sums in another order than the reference.
    run_case(rec, "qsgd-warmup", schedule, NoMemory(), twin, NoMemory(), 3, before_step=before, rtol=0, atol=0,
             dense_fallback=False)


# -- Accordion ------------------------------------------------------------------------------------


class AccordionRule:
    """Accordion written out again: norms of the interval's summed synchronized gradient,
    ``|prev - now| / prev >= eta`` (or nothing to compare yet) is critical, a learning-rate drop
    makes everything critical until the interval in progress ends."""

    def __init__(self, low, high, eta, interval) -> None:
        self.low, self.high, self.eta, self.interval = low, high, eta, interval
        self.sums: dict[str, torch.Tensor] = {}
        self.previous: dict[str, float] = {}
        self.critical: dict[str, bool] = {}
        self.until, self.step = -1, 0

    def value(self, name: str):
        hot = self.critical.get(name, True) or self.step < self.until
        return self.low if hot else self.high

    def observe(self, name: str, grad: torch.Tensor) -> None:
        self.sums[name] = self.sums.get(name, torch.zeros_like(grad)) + grad

    def end_step(self) -> None:
        self.step += 1
        if self.step % self.interval:
            return
        for name, total in self.sums.items():
            norm = math.sqrt(math.fsum(x * x for x in total.double().reshape(-1).tolist()))
            previous = self.previous.get(name)
            self.critical[name] = previous is None or previous == 0 or abs(previous - norm) / previous >= self.eta
            self.previous[name] = norm
        self.sums = {}

    def lr_drop(self) -> None:
        self.until = (self.step // self.interval + 1) * self.interval


def accordion_case(rec: Recorder) -> None:
    low, high, eta, interval, drop_at = 0.3, 0.05, 0.3, 1, 4
    rule = AccordionRule(low, high, eta, interval)
    schedule = Accordion(TopK(), low=low, high=high, eta=eta, interval=interval)
    twin = NamedRuleTwin(TopK(), lambda name, n: rule.value(name))

    def before(step, decided):
        ruled = {name: rule.value(name) for name in decided}
        rec.check(f"accordion: step {step} the schedule's regimes are the rule's", decided == ruled,
                  f"schedule {decided}, rule {ruled}")

    def after(step, model):
        for name, p in model.named_parameters():
            rule.observe(name, p.grad.detach().clone())
        rule.end_step()
        if rule.step == drop_at:
            rule.lr_drop()
            schedule.notify_lr_drop()

    bundle = run_case(rec, "accordion", schedule, Residual(), twin, Residual(), 6, before_step=before,
                      after_sync=after)
    regimes = set(bundle.stats["regime"])
    rec.check("accordion: critical, normal and lr-drop regimes all occurred",
              regimes == {"critical", "normal", "lr-drop"}, str(bundle.stats["regime"]))
    rec.extra["accordion"] = schedule.stats["accordion"]


# -- L-GreCo --------------------------------------------------------------------------------------

CHOICES = [1.0, 0.5, 0.2, 0.05]
REFERENCE = 2


def topk_error(total: torch.Tensor, ratio: float) -> float:
    if ratio == 1.0:
        return 0.0
    return float(((total - topk_reference(total, ratio)).double() ** 2).sum())


def topk_bytes(numel: int, ratio: float) -> int:
    return 4 * numel if ratio == 1.0 else 8 * kept(ratio, numel)


def lgreco_case(rec: Recorder) -> None:
    interval, resolution = 2, 1000
    schedule = LGreCo(TopK(), CHOICES, reference=CHOICES[REFERENCE], interval=interval, resolution=resolution)
    current: dict = {}
    twin = NamedRuleTwin(TopK(), lambda name, n: current[name])
    sums: dict[str, torch.Tensor] = {}
    own_solutions: list[list] = []
    applied: list[list] = []

    if hvd.rank() != 0:
        def perturbed_end_step(backend=None):
            # This rank's state no longer says what rank 0's does; only the broadcast can agree.
            if (schedule.steps + 1) % interval == 0:
                for name in schedule._accumulated.sums:
                    schedule._accumulated.sums[name] = torch.zeros_like(schedule._accumulated.sums[name])
                names = sorted(schedule._accumulated.sums)
                own_solutions.append([CHOICES[i] for i in schedule.solve(names)[0]])
            LGreCoClass.end_step(schedule, backend)

        schedule.end_step = perturbed_end_step

    def before(step, decided):
        current.clear()
        current.update(decided)

    def after(step, model):
        names = sorted(n for n, _ in model.named_parameters())
        for name, p in model.named_parameters():
            sums[name] = sums.get(name, torch.zeros_like(p.grad)) + p.grad
        if (step + 1) % interval:
            return
        chosen = [schedule.choice_of(n) for n in names]
        applied.append(chosen)
        everyone = gather_from_ranks(torch.tensor([derived_seed(chosen)]))
        rec.check(f"lgreco: solve at step {step + 1}: every rank applied the same choices",
                  all(torch.equal(d, everyone[0]) for d in everyone), str(chosen))
        if hvd.rank() == 0:
            rec.guard(f"lgreco: solve at step {step + 1} against brute force", check_solve, rec, step,
                      [sums[n] for n in names], chosen, schedule.stats["lgreco"]["solves"][-1], resolution)
        sums.clear()

    run_case(rec, "lgreco", schedule, Residual(), twin, Residual(), 6, before_step=before, after_sync=after)
    solves = schedule.stats["lgreco"]["solves"]
    rec.check("lgreco: solved at steps 2, 4 and 6", [s["step"] for s in solves] == [2, 4, 6], str(solves))
    summary = torch.tensor([[s["error"], s["budget"], s["bytes"], s["uniform_bytes"]] for s in solves],
                           dtype=torch.float64)
    gathered = gather_from_ranks(summary)
    rec.check("lgreco: every rank holds rank 0's solve summaries", all(torch.equal(s, gathered[0]) for s in gathered))
    if hvd.rank() != 0:
        rec.check("lgreco: this rank's own (perturbed) solution differed from the one applied",
                  all(own != got for own, got in zip(own_solutions, applied, strict=True)) and len(applied) == 3,
                  f"own {own_solutions}, applied {applied}")
    rec.extra["lgreco"] = {"choices": schedule.stats["lgreco"]["choices"], "solves": solves,
                           "overhead": schedule.stats["lgreco"]["overhead"]}


def lgreco_process_set_case(rec: Recorder) -> None:
    """L-GreCo on two process sets, {0, 1} and {2, 3}: the second leaves global rank 0 out, so
    its choices must come from its own first member (global rank 2)."""
    half = hvd.size() // 2
    sets = [hvd.add_process_set(list(range(half))), hvd.add_process_set(list(range(half, hvd.size())))]
    mine = sets[0] if hvd.rank() < half else sets[1]
    schedule = LGreCo(TopK(), CHOICES, reference=CHOICES[REFERENCE], interval=2)
    current: dict = {}
    twin = NamedRuleTwin(TopK(), lambda name, n: current[name])
    if mine.rank() != 0:
        real_solve = schedule.solve

        def perturbed_solve(names):  # never used by a member other than the first, if sharing works
            indices, info = real_solve(names)
            return [len(CHOICES) - 1 - i for i in indices], info

        schedule.solve = perturbed_solve
    try:
        run_case(rec, "lgreco/process-set", schedule, Residual(), twin, Residual(), 4,
                 before_step=lambda step, decided: current.update(decided), process_set=mine)
        solves = schedule.stats["lgreco"]["solves"]
        rec.check("lgreco/process-set: solved twice", [s["step"] for s in solves] == [2, 4], str(solves))
    finally:
        for process_set in sets:
            hvd.remove_process_set(process_set)


def check_solve(rec: Recorder, step: int, totals: list[torch.Tensor], chosen: list, solve: dict,
                resolution: int) -> None:
    errors = torch.tensor([[topk_error(t, c) for c in CHOICES] for t in totals], dtype=torch.float64)
    sizes = torch.tensor([[topk_bytes(t.numel(), c) for c in CHOICES] for t in totals], dtype=torch.float64)
    layers = len(totals)
    budget = float(errors[:, REFERENCE].sum())
    index = torch.tensor([CHOICES.index(c) for c in chosen])
    rows = torch.arange(layers)
    error, size = float(errors[rows, index].sum()), float(sizes[rows, index].sum())
    rec.check(f"lgreco: solve at step {step + 1} meets the uniform error", error <= budget * (1 + 1e-9),
              f"{error} > {budget}")
    combos = torch.tensor(list(itertools.product(range(len(CHOICES)), repeat=layers)))
    all_errors = errors[rows, combos].sum(dim=1)
    all_sizes = sizes[rows, combos].sum(dim=1)
    tightened = all_sizes[all_errors <= budget * (1 - layers / resolution)].min()
    uniform = float(sizes[:, REFERENCE].sum())
    rec.check(f"lgreco: solve at step {step + 1} is no larger than the tightened optimum and uniform",
              size <= min(float(tightened), uniform), f"{size} vs optimum {float(tightened)}, uniform {uniform}")
    rec.check(f"lgreco: solve at step {step + 1} is not uniform", size < uniform, f"{chosen}")
    rec.check(f"lgreco: solve at step {step + 1} reports the bytes", solve["bytes"] == size, f"{solve} vs {size}")
    rec.check(f"lgreco: solve at step {step + 1} reports the error",
              math.isclose(solve["error"], error, rel_tol=1e-6) and math.isclose(solve["budget"], budget,
                                                                                  rel_tol=1e-6),
              f"{solve} vs error {error}, budget {budget}")


def main() -> None:
    args = parse_args()
    hvd.init(process_sets="dynamic")
    torch.set_num_threads(1)
    rec = Recorder(args.out)
    for label, case in (("dgc-warmup", dgc_warmup_case), ("qsgd-warmup", qsgd_warmup_case),
                        ("accordion", accordion_case), ("lgreco", lgreco_case),
                        ("lgreco/process-set", lgreco_process_set_case)):
        rec.guard(label, case, rec)
    rec.write()


if __name__ == "__main__":
    main()
