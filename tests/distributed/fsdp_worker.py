"""grace_legacy.fsdp under real torchrun (Gloo, CPU); every rank runs this. One launch checks:

* every compressor of ``tests/registry.py`` that can travel in a reduce-scatter, bare (the FSDP
  default: no error feedback unless the compressor needs its own memory), with error feedback and
  under LEGACY schedules: at every step each unit's reduced shard equals the independent reference
  (``tests/fsdp_reference.py``) built from every rank's flat input, the sharded gradient FSDP keeps
  is that shard, and the parameters gathered after the SGD step agree on every rank with the update;
  the flat FSDP hands over holds, chunk by chunk, the gradients a plain replica computes;
* FP16 within the rounding of fp16 from the fp32 mean of the ranks' gradients;
* with ``--options``: ``MixedPrecisionPolicy`` (bf16 parameters, fp32 and bf16 reduce dtype),
  gradient accumulation under ``set_requires_gradient_sync(False)`` (one schedule step per
  synchronized backward pass), a gradient divide factor, sum-only collectives, a checkpoint of
  the compression state resumed bit for bit, a parameter unused in a step (refused naming the
  remedy, the step undone; the remedy works), an inf on one rank (NaN shards everywhere, the state
  rolled back), ranks set up differently (``RanksDisagree`` on every rank) and the refusals
  (PowerSGD, Accordion, a named communicator, HSDP on 4 ranks); ``--refusals``: those alone;
* with either, FP16 with error feedback and a non-finite step along the CPU path;
* ``--device cuda`` (the device check): the model and gradients on the GPU, every rank on GPU 0
  over Gloo; ``--quick``: the last four set-ups only (error feedback, LEGACY).
"""

from __future__ import annotations

import copy
import os
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

import grace_legacy.fsdp
from grace_legacy import (
    EF21,
    FP16,
    QSGD,
    Accordion,
    Allgather,
    Grace,
    Legacy,
    NoMemory,
    PowerSGD,
    RanksDisagree,
    Residual,
    SignSGD,
    TopK,
)
from grace_legacy.runtime import paths
from tests.distributed.checks import Recorder, parse_args
from tests.fsdp_reference import Param, Twin, full_gradient, op_of, owner_shard
from tests.reference import RuleTwin, equal_phase, first_group
from tests.registry import ENTRIES
from tests.torch_gather import torch_gather_from_ranks

LR = 0.05
STEPS = 2
#: Where the model and its gradients live (``--device cuda``: the device check, Gloo with CUDA tensors).
DEVICE = torch.device("cpu")
#: The LEGACY size groups of the tests: dense below 30 elements, density 0.3 from there.
LAYER_VALUES, LAYER_SPLITS = [1.0, 0.3], [30]


class Net(nn.Module):
    """Two units (``block``, and the root holding ``head`` and ``scale``): 21 rows cut unevenly
    among 2, 3 and 4 ranks, 9 rows leaving one of 4 ranks padding only, a one-element parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(12, 21), nn.Tanh(), nn.Linear(21, 9))
        self.head = nn.Linear(9, 3)
        self.scale = nn.Parameter(torch.ones(1))
        #: leave ``scale`` out of the forward pass (a parameter unused in a step)
        self.skip_scale = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.head(self.block(x))
        return out if self.skip_scale else out * self.scale


def batch(step: int, rank: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return (torch.randn(8, 12, generator=generator).to(DEVICE),
            torch.randint(0, 3, (8,), generator=generator).to(DEVICE))


def unit_params(net: nn.Module, plain: nn.Module) -> dict[str, list[Param]]:
    """Each unit's parameters in the order FSDP keeps them (its parameter group's), with their
    shapes from the plain model: the reference's layout."""
    names = {id(p): n for n, p in net.named_parameters()}
    shapes = dict(plain.named_parameters())
    return {label or "<root>": [Param(names[id(fp.sharded_param)], shapes[names[id(fp.sharded_param)]].shape)
                                for fp in unit._get_fsdp_state()._fsdp_param_groups[0].fsdp_params]
            for label, unit in net.named_modules() if label in ("", "block")}


class Capture(ReduceScatter):
    """Keeps each call's flat input (as handed over), this rank's output and the op."""

    def __init__(self, inner: ReduceScatter) -> None:
        self.inner, self.calls = inner, []

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        flat = input_tensor.detach().clone()
        result = self.inner(output_tensor, input_tensor, group, op, async_op)
        self.calls.append((flat, output_tensor.detach().clone()))
        return result


class Run:
    """One FSDP model with grace_legacy.fsdp (or FSDP's own reduce-scatter when ``compression`` is None)."""

    def __init__(self, mesh, compression, mp: MixedPrecisionPolicy | None = None, seed: int = 0,
                 state: dict | None = None) -> None:
        torch.manual_seed(seed)
        self.net = Net().to(DEVICE)
        if state is not None:
            self.net.load_state_dict(state)
        self.replica = copy.deepcopy(self.net)
        options = {"mesh": mesh, **({"mp_policy": mp} if mp is not None else {})}
        fully_shard(self.net.block, **options)
        fully_shard(self.net, **options)
        self.params = unit_params(self.net, self.replica)
        self.state = grace_legacy.fsdp.register(self.net, compression) if compression is not None else None
        self.captures = {}
        if self.state is not None:
            for unit in self.state.units:
                capture = Capture(unit.param_group()._reduce_scatter_comm)
                unit.module.set_custom_reduce_scatter(capture)
                self.captures[unit.label] = capture
        self.optimizer = torch.optim.SGD(self.net.parameters(), lr=LR)

    def backward(self, step: int, rank: int, micro: int = 0, poison: bool = False) -> None:
        x, y = batch(step, rank, micro)
        loss = nn.functional.cross_entropy(self.net(x), y)
        (loss * float("inf") if poison else loss).backward()

    def full(self) -> dict[str, torch.Tensor]:
        return {n: p.full_tensor().detach().clone() for n, p in self.net.named_parameters()}


def decoded_flat(encoded: list[list], params: list[Param], world: int, like: torch.Tensor) -> torch.Tensor:
    """This rank's decoded chunks laid out as the flat (padding zero), in float64."""
    flat = torch.zeros(like.numel(), dtype=torch.float64).view(world, -1)
    at = 0
    for p, per_owner in zip(params, encoded, strict=True):
        for owner, item in enumerate(per_owner):
            if item is not None:
                flat[owner, at: at + item[0].numel()] = item[0].reshape(-1).double()
        at += p.width(world)
    return flat.view(-1)


def from_flat(flat: torch.Tensor, encoded: list[list], params: list[Param], world: int, dtype: torch.dtype) -> list:
    """:meth:`Twin.encode`'s shape of another rank's decoded chunks, read back from its flat."""
    rows, out, at = flat.view(world, -1), [], 0
    for p, per_owner in zip(params, encoded, strict=True):
        out.append([None if item is None else
                    (rows[owner, at: at + item[0].numel()].to(dtype).view(item[0].shape), item[1])
                    for owner, item in enumerate(per_owner)])
        at += p.width(world)
    return out


def check_step(rec: Recorder, run: Run, twins: dict[str, Twin], label: str, step: int, op, world: int,
               rank: int, replica_grads: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """Each unit's shard of this step against the reference (every rank's decoded chunks through
    one plain allgather); returns each unit's expected shard."""
    units = list(run.captures)
    encoded, flats = {}, []
    for unit in units:
        flat, _ = run.captures[unit].calls[-1]
        params = run.params[unit]
        if replica_grads is not None:
            for index, p in enumerate(params):
                rec.close(full_gradient(flat, params, world, index), replica_grads[p.name],
                          f"{label}: step {step}: {p.name} in FSDP's flat is the replica's gradient", rtol=1e-5,
                          atol=1e-6)
        encoded[unit] = twins[unit].encode(flat, params, world)
        flats.append(decoded_flat(encoded[unit], params, world, flat))
    everyone = [row.split([f.numel() for f in flats]) for row in torch_gather_from_ranks(torch.cat(flats))]
    expected_shards = {}
    for index, unit in enumerate(units):
        flat, got = run.captures[unit].calls[-1]
        params = run.params[unit]
        by_rank = [from_flat(everyone[r][index], encoded[unit], params, world, flat.dtype) for r in range(world)]
        expected = expected_shards[unit] = owner_shard(by_rank, params, world, rank, op, got.dtype,
                                                       twins[unit].memory)
        rec.close(got.cpu(), expected, f"{label}: step {step}: unit {unit}'s shard is the reference's", rtol=1e-6,
                  atol=1e-7)
        twins[unit].end_step()
    return expected_shards


def train_and_check(rec: Recorder, mesh, label: str, compression, make_twin, world: int, rank: int, *,
                    mp=None, micro_batches: int = 1, divide: float | None = None, sum_only: bool = False,
                    fp16_bound: bool = False) -> Run:
    """Train ``STEPS`` steps and hold every step's shards to the reference (module docstring)."""
    run = Run(mesh, compression, mp)
    for unit in (run.net.block, run.net):  # FSDP sets these unit by unit
        if divide is not None:
            unit.set_gradient_divide_factor(divide)
        if sum_only:
            unit.set_force_sum_reduction_for_comms(True)
    twins = {unit: Twin(*make_twin(), rank, fallback=run.state.grace.dense_fallback) for unit in run.captures}
    op = op_of("premul", divide, world) if divide is not None else op_of("sum" if sum_only else "avg", None, world)
    for step in range(STEPS):
        replica_grads = None
        for micro in range(micro_batches):
            run.net.set_requires_gradient_sync(micro == micro_batches - 1)
            run.backward(step, rank, micro)
            if step == 0 and mp is None:  # the replica holds the initial parameters
                x, y = batch(step, rank, micro)
                nn.functional.cross_entropy(run.replica(x), y).backward()
                replica_grads = {n: p.grad for n, p in run.replica.named_parameters()}
        expected = check_step(rec, run, twins, label, step, op, world, rank, replica_grads)
        if fp16_bound:
            check_fp16_bound(rec, run, label, step, world, rank)
        # The shard FSDP keeps as each sharded gradient: the owner's (sum-only: FSDP divides by P after).
        parameters = dict(run.net.named_parameters())
        for unit, shard in expected.items():
            at = 0
            for p in run.params[unit]:
                local = parameters[p.name].grad.to_local().reshape(-1).cpu()
                want = shard[at: at + local.numel()]
                want = want / world if sum_only else want
                rec.close(local.to(want.dtype), want, f"{label}: step {step}: {p.name}'s sharded gradient")
                at += p.width(world)
        run.optimizer.step()
        run.optimizer.zero_grad()
    everything = torch.cat([t.reshape(-1).double().cpu() for t in run.full().values()])
    rec.check(f"{label}: ranks agree after gathering the parameters",
              all(torch.equal(everything, other) for other in torch_gather_from_ranks(everything)))
    rec.check(f"{label}: one schedule step per synchronized backward pass", run.state.steps == STEPS,
              f"{run.state.steps} steps for {STEPS}")
    return run


def check_fp16_bound(rec: Recorder, run: Run, label: str, step: int, world: int, rank: int) -> None:
    """FP16's shard within the rounding of fp16 (unit roundoff 2^-11, half the subnormal spacing
    2^-25 below its normal range) of each gradient, from the fp32 mean of the ranks' gradients."""
    for unit, capture in run.captures.items():
        flat, got = (t.cpu() for t in capture.calls[-1])
        flats = [f.view(world, -1)[rank] for f in torch_gather_from_ranks(flat)]
        exact = sum(f.double() for f in flats) / world
        bound = sum(2.0 ** -11 * f.double().abs() + 2.0 ** -25 for f in flats) / world + 1e-7 * exact.abs()
        real = torch.zeros_like(got, dtype=torch.bool)
        at = 0
        for p in run.params[unit]:
            real[at: at + p.rows_of(rank, world) * (p.shape[1:].numel())] = True
            at += p.width(world)
        excess = ((got.double() - exact).abs() - bound)[real]  # empty where this rank holds padding only
        rec.check(f"{label}: step {step}: unit {unit} within fp16's rounding of the fp32 mean",
                  bool((excess <= 0).all()), f"beyond by {excess.max().item() if excess.numel() else 0:.3e}")


def zoo_setups():
    """(label, compression, twin maker): every travelling compressor of the registry, then with
    memories and under LEGACY."""
    setups = []
    for entry in ENTRIES:
        # PowerSGD's rounds, and what compresses the whole step or whole tensors only, FSDP refuses
        # (the refusals are checked apart).
        if entry.compressor is PowerSGD or entry.compressor.traits.spans_step or not entry.compressor.traits.shardable:
            continue
        try:
            Grace(entry.typical(), memory=NoMemory())
            memory = NoMemory
        except ValueError:  # its own memory (EF-signSGD's), as the FSDP default takes it
            memory = entry.typical().recommended_memory
        setups.append((entry.label, lambda e=entry, m=memory: Grace(e.typical(), memory=m()),
                       lambda e=entry, m=memory: (e.typical(), m())))
    setups += [
        ("TopK(0.1)+Residual", lambda: Grace(TopK(0.1), memory=Residual()), lambda: (TopK(0.1), Residual())),
        ("TopK(0.1)+EF21", lambda: Grace(TopK(0.1), memory=EF21()), lambda: (TopK(0.1), EF21())),
        ("Legacy(TopK) by layer+Residual",
         lambda: Grace(Legacy(TopK(), by="layer", values=LAYER_VALUES, splits=LAYER_SPLITS), memory=Residual()),
         lambda: (RuleTwin(TopK(), lambda n, step: [None, 0.3][first_group(n, LAYER_SPLITS)]), Residual())),
        ("Legacy(QSGD) by epoch",
         lambda: Grace(Legacy(QSGD(seed=3), by="epoch", values=[16, 4], epochs=2, steps_per_epoch=1),
                       memory=NoMemory()),
         lambda: (RuleTwin(QSGD(seed=3), lambda n, step: [16, 4][equal_phase(step, 2, 2)]), NoMemory())),
    ]
    return setups


def bare_default(rec: Recorder, mesh, world: int, rank: int) -> None:
    """A bare compressor paired with error feedback runs without it, and a warning says so."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = train_and_check(rec, mesh, "bare TopK(0.1)", TopK(0.1), lambda: (TopK(0.1), NoMemory()), world, rank)
    rec.check("bare TopK: no error feedback by default", isinstance(run.state.grace.memory, NoMemory))
    rec.check("bare TopK: a warning names the error feedback left out",
              any("without error feedback" in str(w.message) and "Residual" in str(w.message) for w in caught))


def options(rec: Recorder, mesh, world: int, rank: int) -> None:
    topk_ef = (lambda: Grace(TopK(0.1), memory=Residual()), lambda: (TopK(0.1), Residual()))
    qsgd = (lambda: Grace(QSGD(4, seed=5), memory=NoMemory()), lambda: (QSGD(4, seed=5), NoMemory()))
    sign = (lambda: Grace(SignSGD(), memory=NoMemory()), lambda: (SignSGD(), NoMemory()))
    for reduce_dtype in (torch.float32, torch.bfloat16):
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        for name, (make, twin) in {"TopK+Residual": topk_ef, "QSGD": qsgd, "SignSGD": sign}.items():
            rec.guard(f"bf16 parameters, {reduce_dtype} reduce: {name}", train_and_check, rec, mesh,
                      f"bf16/{reduce_dtype} {name}", make(), twin, world, rank, mp=mp)
    rec.guard("accumulation", train_and_check, rec, mesh, "accumulation Legacy(TopK)+Residual",
              Grace(Legacy(TopK(), by="layer", values=LAYER_VALUES, splits=LAYER_SPLITS), memory=Residual()),
              lambda: (RuleTwin(TopK(), lambda n, step: [None, 0.3][first_group(n, LAYER_SPLITS)]), Residual()),
              world, rank, micro_batches=2)
    for name, (make, twin) in {"TopK+Residual": topk_ef, "SignSGD": sign}.items():
        rec.guard(f"divide factor: {name}", train_and_check, rec, mesh, f"divide factor 2.5 {name}", make(), twin,
                  world, rank, divide=2.5)
    rec.guard("sum only", train_and_check, rec, mesh, "sum-only QSGD", qsgd[0](), qsgd[1], world, rank, sum_only=True)
    rec.guard("resume", resume, rec, mesh, rank)
    rec.guard("unused", unused, rec, mesh, rank)
    rec.guard("non-finite", nonfinite, rec, mesh, rank, "TopK(0.1)+Residual", topk_ef[0])


def resume(rec: Recorder, mesh, rank: int) -> None:
    """Four steps straight, against two steps, a checkpoint, and two steps in a fresh model."""
    def make():
        return Grace(Legacy(TopK(), by="epoch", values=[0.5, 0.1], epochs=2, steps_per_epoch=2), memory=Residual())
    straight = Run(mesh, make())
    saved = None
    for step in range(4):
        if step == 2:
            saved = ({n: t.clone() for n, t in straight.full().items()}, copy.deepcopy(straight.state.state_dict()))
        straight.backward(step, rank)
        straight.optimizer.step()
        straight.optimizer.zero_grad()
    resumed = Run(mesh, make(), state=saved[0])
    resumed.state.load_state_dict(saved[1])
    for step in range(2, 4):
        resumed.backward(step, rank)
        resumed.optimizer.step()
        resumed.optimizer.zero_grad()
    a, b = straight.full(), resumed.full()
    rec.check("a resumed run ends bit for bit as the straight one", all(torch.equal(a[n], b[n]) for n in a),
              str({n: (a[n] - b[n]).abs().max().item() for n in a}))
    rec.check("a resumed run's stats continue the saved ones",
              straight.state.stats["bytes_sent"] == resumed.state.stats["bytes_sent"])


def nonfinite(rec: Recorder, mesh, rank: int, label: str, make) -> None:
    """An inf on rank 1 at step 1: every rank's shards NaN, the state as before the step."""
    run = Run(mesh, make())
    run.backward(0, rank)
    run.optimizer.step()
    run.optimizer.zero_grad()
    before = copy.deepcopy(run.state.state_dict())
    run.backward(1, rank, poison=rank == 1)
    grads = [p.grad.to_local() for p in run.net.parameters()]
    rec.check(f"{label}: an inf on one rank makes every shard NaN on every rank",
              all(bool(torch.isnan(g).all()) for g in grads if g.numel()))
    after = run.state.state_dict()
    residuals = before["memory"]["residuals"], after["memory"]["residuals"]
    rec.check(f"{label}: the skipped step left the residuals as they were",
              residuals[0].keys() == residuals[1].keys()
              and all(torch.equal(residuals[0][k], residuals[1][k]) for k in residuals[0]))
    rec.check(f"{label}: the skipped step still counts as a step", run.state.steps == 2)
    run.optimizer.zero_grad()  # skipped, as GradScaler would
    run.backward(2, rank)
    rec.check(f"{label}: the next step is finite", all(bool(torch.isfinite(p.grad.to_local()).all())
                                             for p in run.net.parameters()))


def unused(rec: Recorder, mesh, rank: int) -> None:
    """A parameter unused in a backward pass: the reduce-scatter raises naming the remedy on every
    rank, the step's state undone; with the remedy the step runs and the parameter's gradient is 0."""
    run = Run(mesh, Grace(TopK(0.1), memory=Residual()))
    run.net.skip_scale = True
    expect(rec, "an unused parameter is refused, naming set_reduce_scatter_unused_params", RuntimeError,
           "set_reduce_scatter_unused_params", run.backward, 0, rank)
    rec.check("the failed step left no state behind", run.state.state_dict()["memory"]["residuals"] == {}
              and run.state.steps == 0)
    remedied = Run(mesh, Grace(TopK(0.1), memory=Residual()))
    remedied.net.skip_scale = True
    remedied.net.set_reduce_scatter_unused_params(True)
    remedied.backward(0, rank)
    rec.check("with set_reduce_scatter_unused_params the step runs, the unused gradient 0",
              remedied.state.steps == 1 and not remedied.net.scale.grad.to_local().any())


def expect(rec: Recorder, name: str, error: type, fragment: str, fn, *args) -> None:
    try:
        fn(*args)
    except error as caught:
        rec.check(name, fragment in str(caught), str(caught)[:300])
    else:
        rec.check(name, False, "no error")


def refusals(rec: Recorder, mesh, world: int, rank: int) -> None:
    expect(rec, "PowerSGD is refused, naming DDP", ValueError, "grace_legacy.ddp", Run, mesh, PowerSGD(2))
    expect(rec, "Accordion is refused, naming Legacy", ValueError, "Legacy", Run, mesh,
           Accordion(TopK(), low=0.5, high=0.1, interval=2))
    expect(rec, "a named communicator is refused", ValueError, "communicator", Run, mesh,
           Grace(TopK(0.1), communicator=Allgather()))
    expect(rec, "ranks set up differently raise RanksDisagree on every rank", RanksDisagree, "compressor", Run, mesh,
           TopK(0.1 if rank else 0.2))
    if world == 4:
        hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        expect(rec, "HSDP is refused, naming a 1-D mesh", ValueError, "1-D mesh", Run, hsdp, QSGD(4))


def main() -> None:
    global DEVICE
    args = parse_args([(("--options",), {"action": "store_true"}), (("--refusals",), {"action": "store_true"}),
                       (("--device",), {"default": "cpu"}), (("--quick",), {"action": "store_true"})])
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda":
        torch.cuda.set_device(0)  # every rank on the one GPU, over Gloo (NCCL refuses two ranks on one GPU)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.set_num_threads(1)
    rec = Recorder(args.out, rank)
    rec.extra["device_path"] = paths.FORCE_DEVICE_PATH
    mesh = init_device_mesh(DEVICE.type, (world,))
    # The compressors along the device path: their CPU passes compile (numba) on first use, which
    # takes longer than every check here; FSDP's own CPU branch runs below.
    with paths.device_path(True):
        for label, make, twin in zoo_setups()[-4:] if args.quick else zoo_setups():
            started = time.perf_counter()
            rec.guard(label, train_and_check, rec, mesh, label, make(), twin, world, rank,
                      fp16_bound=label == "FP16")
            if rank == 0 and os.environ.get("FSDP_WORKER_TIMES"):
                print(f"{label}: {time.perf_counter() - started:.2f} s", flush=True)
        rec.guard("bare default", bare_default, rec, mesh, world, rank)
        if args.options:
            options(rec, mesh, world, rank)
    if args.options or args.refusals:
        rec.guard("CPU path: FP16", train_and_check, rec, mesh, "CPU path: FP16+Residual",
                  Grace(FP16(), memory=Residual()), lambda: (FP16(), Residual()), world, rank)
        rec.guard("CPU path: non-finite", nonfinite, rec, mesh, rank, "CPU path: FP16+Residual",
                  lambda: Grace(FP16(), memory=Residual()))
        refusals(rec, mesh, world, rank)
    rec.write()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
