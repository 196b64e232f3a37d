"""The DDP hook (``grace_legacy.ddp``) under real torchrun, Gloo; every rank runs this.

``--scenario checks`` runs, in one launch:

* the backend: allreduce (sum and average), broadcast from every root, allgathers whose ranks send
  different row counts (empty ones too) under each way of moving them;
* every registered compressor case of the zoo (``zoo.cases()``), its synchronized gradient
  compared at every step with an independent aggregation of its twin's decompressed payloads,
  exactly as the Horovod zoo worker does; DDP's options rotate over the cases (several buckets
  always; ``gradient_as_bucket_view``, ``static_graph``, ``find_unused_parameters``, two backward
  passes under ``no_sync()``), so each option meets several compressors;
* parameters unused on some ranks and on every rank (``find_unused_parameters=True``);
* ``set_epoch`` moving a schedule, and ``register_comm_hook`` spelled as PyTorch spells it;
* ranks that disagree: ``RanksDisagree`` on every rank, with one message, at registration and at
  the first backward pass;
* every compressor/memory pair of the state tests under ``torch.amp.GradScaler`` with an inf and
  later a NaN injected on one rank: seen on every rank, steps skipped as without the hook, state
  rolled back, parameters bit-identical on every rank at the end;
* flat memory: the hook's and the bundle's structures do not grow over many steps;
* with ``--checkpoint``, the first half of the resume test (as ``resume_worker.py``).

``--scenario routes --cases FAMILY ...``: the zoo's cases of those families only, at any number of
ranks (the default route keeps each compressor's own aggregation however many ranks there are).
``--scenario resume`` (fresh processes): resumes each checkpoint and compares bit for bit.
``--scenario dead``: rank 2 kills itself at step 3; the test times how long the job takes to end.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parallel.distributed import _MixedPrecision

import grace_legacy.ddp
from benchmarks.performance.memory import structure_size
from grace_legacy import Allgather, Grace, Legacy, NoCompression, NoMemory, PowerSGD, TopK
from grace_legacy.backends.torch_distributed import VARIABLE_GATHERS, TorchDistributedBackend
from tests.distributed.checks import Recorder, parse_args, topk_contribution
from tests.distributed.every_pair_worker import INIT_SCALE, parameter_digest, poisons, tensors_in
from tests.distributed.faults_worker import Branchy, expect_disagreement, takes_branch
from tests.distributed.harness import STEPS, Net, batch, loss_of
from tests.distributed.resume_worker import differences
from tests.distributed.zoo import Observation, cases, mean_rule
from tests.distributed.zoo_worker import compare_with_rule, twin_step_sent
from tests.reference import twin_contributions
from tests.registry import LR, RESUME_AT, RESUME_SETUPS, RESUME_STEPS, every_pair
from tests.torch_gather import torch_gather_from_ranks

#: DDP's bucket cap in MB: small, so the test model's 8 parameters span several buckets.
BUCKET_MB = 0.002
#: What DDP is told besides the bucket cap, rotated over the zoo's cases; "passes" is how many
#: backward passes (all but the last under no_sync()) make one step. Not static_graph with
#: no_sync(): DDP itself fails an internal assertion there, with or without a hook.
OPTIONS = [{}, {"gradient_as_bucket_view": True}, {"static_graph": True}, {"find_unused_parameters": True},
           {"passes": 2}, {"gradient_as_bucket_view": True, "find_unused_parameters": True, "passes": 2}]


#: Where the zoo's cases run: the CPU under Gloo, this rank's GPU under NCCL (``--scenario cuda``).
DEVICE = torch.device("cpu")


def rank() -> int:
    return dist.get_rank()


def data(step: int, rank: int, pass_index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(t.to(DEVICE) for t in batch(step, rank, pass_index))


def gathered(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's copy of ``tensor``, through a plain (uncompressed) allgather."""
    return torch_gather_from_ranks(tensor)


def wrap(model: nn.Module, **options) -> DistributedDataParallel:
    return DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB, **options)


def local_gradients(model: nn.Module, step: int, passes: int) -> dict[str, torch.Tensor]:
    """This rank's own gradient, summed over ``passes`` backward passes, on a private copy."""
    twin = copy.deepcopy(model)
    total = {name: torch.zeros_like(p) for name, p in twin.named_parameters()}
    for i in range(passes):
        grads = torch.autograd.grad(loss_of(twin, data(step, rank(), i)), list(twin.parameters()))
        for (name, _), g in zip(twin.named_parameters(), grads, strict=True):
            total[name] += g
    return total


def backward_passes(ddp: DistributedDataParallel, step: int, passes: int) -> None:
    for i in range(passes):
        with ddp.no_sync() if i < passes - 1 else contextlib.nullcontext():
            loss_of(ddp, data(step, rank(), i)).backward()


# -- the backend ------------------------------------------------------------------------------

def backend_checks(rec: Recorder) -> None:
    size, me = dist.get_world_size(), rank()
    for mode in VARIABLE_GATHERS:
        backend = TorchDistributedBackend(variable_gather=mode)
        x = torch.arange(5.0) * (me + 1)
        summed, averaged = backend.allreduce_async(x, "s", False), backend.allreduce_async(x, "a", True)
        # Rank r sends r rows (rank 0 none), then every rank none, then equal rows.
        rows = backend.allgather_async(torch.full((me, 3), float(me)), "rows")
        empty = backend.allgather_async(torch.empty(0, dtype=torch.uint8), "empty")
        equal = backend.allgather_async(torch.full((2,), me, dtype=torch.int64), "equal")
        roots = [backend.broadcast_async(torch.full((4,), float(me)), root, "bc") for root in range(size)]
        total = sum(range(1, size + 1))
        rec.equal(backend.wait(summed), torch.arange(5.0) * total, f"backend {mode}: allreduce sum")
        rec.equal(backend.wait(averaged), torch.arange(5.0) * total / size, f"backend {mode}: allreduce average")
        rec.equal(x, torch.arange(5.0) * (me + 1), f"backend {mode}: the input is unchanged")
        expected = torch.cat([torch.full((r, 3), float(r)) for r in range(size)])
        rec.equal(backend.wait(rows), expected, f"backend {mode}: allgather of different row counts")
        rec.check(f"backend {mode}: allgather of nothing", backend.wait(empty).shape == (0,))
        rec.equal(backend.wait(equal), torch.arange(size).repeat_interleave(2), f"backend {mode}: equal rows")
        for root, handle in enumerate(roots):
            rec.equal(backend.wait(handle), torch.full((4,), float(root)), f"backend {mode}: broadcast from {root}")
        width = backend.allgather_async(torch.zeros(1, 2 + (me == size - 1)), "widths")
        try:
            backend.wait(width)
        except ValueError as err:
            rec.check(f"backend {mode}: rows of different widths are refused", "only the first dimension" in str(err))
        else:
            rec.check(f"backend {mode}: rows of different widths are refused", False, "no error")


# -- the zoo ----------------------------------------------------------------------------------

def run_case(rec: Recorder, case, options: dict, routes_of_the_case: bool = True) -> None:
    """``routes_of_the_case``: the case's routes are those of this number of ranks (they are
    written for the zoo's); otherwise the bundle's routes must be the twin's, whatever they are."""
    options = dict(options)
    passes = options.pop("passes", 1)
    label = f"{case.label} [{', '.join(f'{k}={v}' for k, v in {**options, 'passes': passes}.items())}]"
    compression, twin, twin_memory = case.build()
    twin.set_rank(rank())
    torch.manual_seed(0)
    model = Net().to(DEVICE)
    ddp = wrap(model, **options)
    state = grace_legacy.ddp.register(ddp, compression)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    communicator = getattr(compression, "communicator", None)
    expected_bytes, routes, observations = 0, set(), []
    for step in range(STEPS + 1):
        opt.zero_grad()
        local = local_gradients(model, step, passes)
        backward_passes(ddp, step, passes)
        twins = twin_contributions(lambda grad, name: twin_step_sent(
            twin, twin_memory, grad, name, communicator, getattr(compression, "dense_fallback", True),
            world_size=dist.get_world_size()),
            {name: local[name] for name, _ in model.named_parameters()}, state.grace.compressor.traits.spans_step)
        # Every parameter's contribution and synchronized gradient in one gather per step, exact in
        # float64: far fewer collectives to wait for than two per parameter.
        mine = [contribution for contribution, *_ in twins.values()] + [p.grad for p in model.parameters()]
        sizes = [t.numel() for t in mine]
        per_rank = [torch.split(row, sizes) for row in gathered(torch.cat([t.reshape(-1).double() for t in mine]))]
        for i, (name, p) in enumerate(model.named_parameters()):
            contribution, sent, route, dtypes = twins[name]
            expected_bytes += sent
            routes.add(route)
            contributions = [parts[i].view(contribution.shape).to(contribution.dtype) for parts in per_rank]
            observations.append(Observation(step, name, contributions, route))
            combined = mean_rule(contributions) if route.startswith("dense") else case.rule(contributions)
            compare_with_rule(rec, f"{label}: step {step} {name}", p.grad, combined, twin_memory, name, route,
                              [p.grad.dtype, *dtypes], contributions, step, case)
            everyone = [parts[len(twins) + i] for parts in per_rank]
            rec.check(f"{label}: step {step} {name} bit-identical on every rank",
                      all(torch.equal(g, everyone[0]) for g in everyone))
        twin.end_step()
        opt.step()
    stats = state.stats
    rec.check(f"{label}: stats bytes_sent equals the twin's payload bytes", stats["bytes_sent"] == expected_bytes,
              f"{stats['bytes_sent']} != {expected_bytes}")
    if routes_of_the_case:
        rec.check(f"{label}: routes used", case.routes <= routes, f"used {routes}, expected {case.routes}")
    rec.check(f"{label}: the bundle's routes are the twin's", set(stats["tensors_by_route"]) == routes,
              f"bundle {stats['tensors_by_route']}, twin {routes}")
    rec.check(f"{label}: the hook counted one step per backward pass", state.steps == STEPS + 1, str(state.steps))
    if case.check is not None:
        rec.guard(f"{label}: final check", case.check, compression, observations)


# -- DDP's options beyond the zoo ------------------------------------------------------------

def loss_on(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank())
    x, y = torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)
    return nn.functional.cross_entropy(model(x, takes_branch(rank())), y)


def unused_parameters(rec: Recorder) -> None:
    """Ranks 1 and 3 skip a branch, no rank uses ``never``: each used gradient is the mean of the
    ranks' Top-k (zeros where a rank skipped it); ``never`` keeps no gradient, as without a hook;
    PowerSGD with one collective per tensor does not deadlock and agrees on every rank."""
    # The gather route for Top-k, whose result that mean is (the scatter-gather's: two_phase.py).
    for label, compression in [("topk", Grace(TopK(0.3), memory=NoMemory(), communicator=Allgather())),
                               ("powersgd", Grace(PowerSGD(1), bucket_bytes=0)), ("no hook", None)]:
        torch.manual_seed(0)
        model = Branchy()
        ddp = wrap(model, find_unused_parameters=True)
        if compression is not None:
            grace_legacy.ddp.register(ddp, compression)
        for step in range(2):
            for p in model.parameters():
                p.grad = None
            twin = copy.deepcopy(model)
            local = dict(zip(model.parameters(), torch.autograd.grad(
                loss_on(twin, step), list(twin.parameters()), allow_unused=True), strict=True))
            loss_on(ddp, step).backward()
            rec.check(f"unused {label}: step {step} never-used parameter has no gradient", model.never.grad is None)
            for name, p in model.named_parameters():
                if name == "never":
                    continue
                everyone = gathered(p.grad)
                rec.check(f"unused {label}: step {step} {name} identical on every rank",
                          all(torch.equal(g, everyone[0]) for g in everyone))
                own = local[p] if local[p] is not None else torch.zeros_like(p)
                if label == "topk":
                    expected = mean_rule(gathered(topk_contribution(own, 0.3, dist.get_world_size())))
                    rec.close(p.grad, expected, f"unused {label}: step {step} {name}")


def epochs_and_spelling(rec: Recorder) -> None:
    """``set_epoch`` on the schedule moves it (dense in epoch 0, Top-k in epoch 1); the PyTorch
    spelling (``register_comm_hook(GraceState(...), grace_hook)``) runs the same exchange."""
    schedule = Legacy(TopK(), by="epoch", values=[1.0, 0.1], epochs=2)
    torch.manual_seed(0)
    model = Net()
    ddp = wrap(model)
    state = grace_legacy.ddp.GraceState(ddp, schedule)
    ddp.register_comm_hook(state, grace_legacy.ddp.grace_hook)
    for epoch in range(2):
        schedule.set_epoch(epoch)
        state.reset_stats()
        loss_of(ddp, batch(epoch, rank())).backward()
        routes = set(state.stats["tensors_by_route"])
        moved = routes == {"dense"} if epoch == 0 else "allgather" in routes and "dense" not in routes
        rec.check(f"set_epoch({epoch}): the schedule's routes", moved, str(routes))


def refusals_and_autocast(rec: Recorder) -> None:
    """What the hook cannot honour is refused, naming the option; autocast with GradScaler trains
    and every rank ends with the same parameters."""
    def refused(label, error, needle, run):
        try:
            run()
        except error as err:
            rec.check(f"refused: {label}", needle in str(err), str(err))
        else:
            rec.check(f"refused: {label}", False, "no error")

    refused("mixed_precision", ValueError, "mixed_precision", lambda: grace_legacy.ddp.register(
        wrap(Net(), mixed_precision=_MixedPrecision(param_dtype=torch.float16)), TopK(0.1)))
    refused("skip_all_reduce_unused_params", ValueError, "skip_all_reduce_unused_params",
            lambda: grace_legacy.ddp.register(wrap(Net(), skip_all_reduce_unused_params=True), TopK(0.1)))
    refused("a model that is not DDP", TypeError, "DistributedDataParallel",
            lambda: grace_legacy.ddp.register(Net(), TopK(0.1)))
    refused("Horovod's compression", TypeError, "compression must be", lambda: grace_legacy.ddp.register(
        wrap(Net()), "fp16"))

    refused("sparse gradients", ValueError, "sparse=True", lambda: grace_legacy.ddp.register(
        wrap(nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))), TopK(0.5)))

    torch.manual_seed(0)
    model = Net()
    ddp = wrap(model)
    grace_legacy.ddp.register(ddp, Grace(TopK(0.2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(3):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of(ddp, batch(step, rank()))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, parameter_digest(model))
    rec.check("autocast + GradScaler: parameters bit-identical on every rank", len(set(digests)) == 1)


def disagreements(rec: Recorder) -> None:
    last = dist.get_world_size() - 1
    splits = [64] if rank() != last else [32]
    expect_disagreement(rec, "registration", lambda: grace_legacy.ddp.register(
        wrap(Net()), Legacy(TopK(), by="layer", values=[1.0, 0.1], splits=splits)),
        "compressor", "splits=[64]", f"rank {last}", "splits=[32]")

    def another_epoch():
        schedule = Legacy(TopK(), by="epoch", values=[1.0, 0.1], epochs=2)
        ddp = wrap(Net())
        grace_legacy.ddp.register(ddp, schedule)
        schedule.set_epoch(1 if rank() == last else 0)
        loss_of(ddp, batch(0, rank())).backward()

    expect_disagreement(rec, "first step", another_epoch, "schedule progress", f"rank {last}: 1")
    for label in ("registration", "first step"):
        messages = [None] * dist.get_world_size()
        dist.all_gather_object(messages, rec.extra.get("messages", {}).get(label))
        rec.check(f"{label}: every rank raised the same message", len(set(messages)) == 1 and messages[0] is not None)


# -- non-finite gradients under GradScaler ----------------------------------------------------

def nonfinite(rec: Recorder, label: str, compression, reference: list[float] | None) -> list[float]:
    planned = poisons(dist.get_world_size())
    torch.manual_seed(0)
    model = Net()
    initial = parameter_digest(model)
    params = dict(model.named_parameters())
    ddp = wrap(model)
    state = grace_legacy.ddp.register(ddp, compression) if compression is not None else None
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    now = {"step": -1}

    def poison(name):
        def hook(grad):
            plan = planned.get(now["step"])
            if plan is None or plan[0] != rank() or plan[1] != name:
                return grad
            grad = grad.clone()
            grad[plan[2]] = plan[3]
            return grad
        return hook

    for name in {plan[1] for plan in planned.values()}:
        params[name].register_hook(poison(name))
    scales = []
    for step in range(5):
        now["step"] = step
        opt.zero_grad()
        before = {n: p.detach().clone() for n, p in params.items()}
        memory_before = tensors_in(state.state_dict()["memory"]) if state else {}
        scaler.scale(loss_of(ddp, batch(step, rank()))).backward()
        if step in planned:
            rec.check(f"{label}: step {step}: the poisoned gradient is non-finite on this rank",
                      not bool(torch.isfinite(params[planned[step][1]].grad).all()))
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        if step in planned:
            changed = [n for n, p in params.items() if not torch.equal(p.detach(), before[n])]
            rec.check(f"{label}: step {step}: skipped, parameters untouched", not changed, f"changed: {changed}")
        if step in planned and state is not None:
            bad = [k for k, t in tensors_in(state.state_dict()).items()
                   if t.is_floating_point() and not bool(torch.isfinite(t).all())]
            rec.check(f"{label}: step {step}: no non-finite compression state", not bad, str(bad))
            after = tensors_in(state.state_dict()["memory"])
            rec.check(f"{label}: step {step}: the memory is as before the skipped step",
                      after.keys() == memory_before.keys() and all(torch.equal(after[k], memory_before[k])
                                                                   for k in after))
    if reference is not None:
        rec.check(f"{label}: GradScaler skips the same steps as without the hook", scales == reference,
                  f"{scales} != {reference}")
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, parameter_digest(model))
    rec.check(f"{label}: parameters bit-identical on every rank", len(set(digests)) == 1, str(digests))
    rec.check(f"{label}: parameters finite and trained", digests[0] != initial and all(
        bool(torch.isfinite(p).all()) for p in model.parameters()))
    return scales


# -- memory over many steps ------------------------------------------------------------------

def flat_memory(rec: Recorder, steps: int = 120) -> None:
    """Entries and tensor bytes reachable from the hook's state, and Python's live objects, at a
    third and at the end of the run: the first two must not change, the objects barely."""
    torch.manual_seed(0)
    model = Net()
    ddp = wrap(model)
    state = grace_legacy.ddp.register(ddp, Grace(Legacy(TopK(), by="layer", values=[1.0, 0.1], splits=[100])))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = {}
    for step in range(steps):
        opt.zero_grad()
        loss_of(ddp, batch(step % 7, rank())).backward()
        opt.step()
        if step + 1 in (steps // 3, steps):
            gc.collect()
            seen[step + 1] = (*structure_size(state), len(gc.get_objects()))
    (e1, b1, o1), (e2, b2, o2) = seen[steps // 3], seen[steps]
    rec.check("memory: the hook's entries and tensor bytes stay flat", (e1, b1) == (e2, b2), str(seen))
    rec.check("memory: live Python objects stay flat", o2 - o1 < 200, str(seen))


# -- resume -----------------------------------------------------------------------------------

def build_for_resume(label: str, factory):
    torch.manual_seed(0)
    model = Net()
    momentum = 0.0 if "DGC" in label else 0.9
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum)
    ddp = wrap(model)
    return model, ddp, optimizer, grace_legacy.ddp.register(ddp, factory())


def train(ddp, optimizer, steps: range) -> None:
    for step in steps:
        optimizer.zero_grad()
        loss_of(ddp, batch(step, rank())).backward()
        optimizer.step()


def checkpoint(rec: Recorder, index: int, label: str, factory) -> None:
    model, ddp, optimizer, state = build_for_resume(label, factory)
    train(ddp, optimizer, range(RESUME_STEPS))
    torch.save({"parameters": {n: p.detach().clone() for n, p in model.named_parameters()},
                "compression": state.state_dict()}, rec.out / f"uninterrupted{index}.rank{rank()}.pt")
    model, ddp, optimizer, state = build_for_resume(label, factory)
    train(ddp, optimizer, range(RESUME_AT))
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, state.state_dict())
    if rank() == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "compression": states},
                   rec.out / f"checkpoint{index}.pt")


def resume(rec: Recorder, index: int, label: str, factory) -> None:
    saved = torch.load(rec.out / f"checkpoint{index}.pt", weights_only=True)
    uninterrupted = torch.load(rec.out / f"uninterrupted{index}.rank{rank()}.pt", weights_only=True)
    model, ddp, optimizer, state = build_for_resume(label, factory)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    state.load_state_dict(saved["compression"][rank()])
    train(ddp, optimizer, range(RESUME_AT, RESUME_STEPS))
    differing = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), uninterrupted["parameters"][n])]
    rec.check(f"{label}: resumed parameters bit-identical to the uninterrupted run's", not differing, str(differing))
    diff = differences(state.state_dict(), uninterrupted["compression"])
    rec.check(f"{label}: resumed compression state equal to the uninterrupted run's", not diff, "; ".join(diff[:5]))


# -- scenarios --------------------------------------------------------------------------------

def checks(rec: Recorder, write_checkpoints: bool) -> None:
    timings = rec.extra.setdefault("seconds", {})

    def timed(label, fn, *args):
        started = time.perf_counter()
        rec.guard(label, fn, *args)
        timings[label] = round(time.perf_counter() - started, 2)

    timed("backend", backend_checks, rec)
    labels = []
    for i, case in enumerate(cases()):
        labels.append(case.label)
        timed(case.label, run_case, rec, case, OPTIONS[i % len(OPTIONS)])
    rec.extra["cases"] = labels
    timed("unused parameters", unused_parameters, rec)
    timed("epochs and spelling", epochs_and_spelling, rec)
    timed("refusals and autocast", refusals_and_autocast, rec)
    timed("disagreements", disagreements, rec)
    reference = rec.guard("nonfinite: no hook", nonfinite, rec, "no hook", None, None)
    setups = [("NoCompression+NoMemory", lambda: Grace(NoCompression(), memory=NoMemory()))] + every_pair()
    for label, factory in setups:
        timed(f"nonfinite {label}", nonfinite, rec, label, factory(), reference)
    rec.extra["nonfinite"] = [label for label, _ in setups]
    timed("memory", flat_memory, rec)
    if write_checkpoints:
        for index, (label, factory) in enumerate(RESUME_SETUPS):
            timed(f"checkpoint {label}", checkpoint, rec, index, label, factory)


def dead(rec: Recorder) -> None:
    torch.manual_seed(0)
    model = Net()
    ddp = wrap(model)
    grace_legacy.ddp.register(ddp, Grace(TopK(0.3)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rec.write()  # proof that this rank got going
    for step in range(10**6):
        if step == 3 and rank() == 2:
            (rec.out / "killed_at.json").write_text(json.dumps(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        loss_of(ddp, batch(step % 5, rank())).backward()
        opt.step()


def main() -> None:
    global DEVICE
    args = parse_args([(("--scenario",), {"choices": ["checks", "routes", "resume", "dead", "cuda"],
                                          "required": True}),
                       (("--checkpoint",), {"action": "store_true"}),
                       (("--cases",), {"nargs": "*", "default": None})])
    if args.scenario == "cuda":
        DEVICE = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(DEVICE)
    dist.init_process_group("nccl" if args.scenario == "cuda" else "gloo", timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    rec = Recorder(args.out, rank=rank())
    rec.out.mkdir(parents=True, exist_ok=True)
    try:
        if args.scenario == "checks":
            checks(rec, args.checkpoint)
        elif args.scenario == "routes":
            chosen = [case for family in args.cases for case in cases(family)]
            rec.extra["cases"] = [case.label for case in chosen]
            for i, case in enumerate(chosen):
                rec.guard(case.label, run_case, rec, case, OPTIONS[i % len(OPTIONS)], dist.get_world_size() == 4)
        elif args.scenario == "cuda":
            rec.guard("backend", backend_checks, rec)
            rec.extra["cases"] = [case.label for case in cases()]
            for i, case in enumerate(cases()):
                rec.guard(case.label, run_case, rec, case, OPTIONS[i % len(OPTIONS)])
        elif args.scenario == "resume":
            for index, (label, factory) in enumerate(RESUME_SETUPS):
                rec.guard(label, resume, rec, index, label, factory)
            rec.extra["setups"] = [label for label, _ in RESUME_SETUPS]
        else:
            dead(rec)
    finally:
        rec.write()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
