"""The time-to-accuracy benchmark's task and arms (:mod:`benchmarks.accuracy.time_to_accuracy`).

The task is mnist1d (``make_dataset()``, generated locally: :mod:`benchmarks.common.tasks`) with a
wide MLP: little compute per sample (a few matrix products on a 40-element signal) but about a
million parameters, so that on slow links a dense step is mostly communication. The global batch
is fixed (:data:`GLOBAL_BATCH`, split over the workers), as is SGD's rate, so that a step does the
same arithmetic at 8 and at 16 workers and steps to target are comparable across worker counts;
the rate is constant (no decay), so a curve does not depend on how long the run is budgeted.

Each arm is what a user writes for one way of communicating, under Horovod
(``hvd.DistributedOptimizer(..., compression=...)``) or DDP (a communication hook). The arms that
are not ours are the baselines a user would otherwise take: dense fp32, Horovod's
``Compression.fp16``, PyTorch's ``fp16_compress_hook`` and ``powerSGD_hook`` (at its defaults, and
at our PowerSGD's rank from its second step). :func:`planned` gives each arm the compressor and
route the planner (:mod:`grace_legacy.planner`) estimates its link time from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

#: Samples per step over all workers, and SGD's rate and momentum for that batch.
GLOBAL_BATCH = 256
LR, MOMENTUM = 0.2, 0.9
#: The MLP's widths: 40 inputs, two hidden layers, 10 classes (``QUICK_WIDTHS`` for the smoke run).
WIDTHS = (40, 1024, 1024, 10)
QUICK_WIDTHS = (40, 32, 10)
#: Top-k's density, and PowerSGD's rank (ours, and PyTorch's hook where it is set to ours).
DENSITY = 0.01
POWERSGD_RANK = 4
#: QSGD's levels (any up to 127 travel as one byte).
QSGD_LEVELS = 127
#: LEGACY by layer: tensors under SPLIT elements get LAYER_FACTORS[0] times the large ones' density.
SPLIT = 50_000
LAYER_FACTORS = (10.0, 1.0)
#: Above the model's size: DDP puts every gradient in one bucket (PyTorch's PowerSGD hook hangs
#: or aborts under Gloo with more than one, docs: GUIDE).
ONE_BUCKET_MB = 1024

HOROVOD, DDP = "horovod", "ddp"
#: Roles: the reference, the baselines a user could take instead, and ours.
DENSE_ROLE, BASELINE, OURS = "dense", "baseline", "ours"


def wide_mlp(widths: Sequence[int] = WIDTHS) -> nn.Module:
    """The benchmark's model (a function of no arguments with the default widths, so that
    ``python -m grace_legacy plan --model benchmarks.common.time_to_accuracy_arms:wide_mlp`` plans it)."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:], strict=False)):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


@dataclass(frozen=True)
class Setting:
    """What an arm is built for: the model, the number of workers and SGD's rate."""

    model: nn.Module
    world_size: int
    lr: float = LR


@dataclass(frozen=True)
class Arm:
    """One way of communicating. ``compression`` returns, for Horovod, the ``compression`` argument
    of ``hvd.DistributedOptimizer``; for DDP, the compression ``grace_legacy.ddp.register`` takes.
    ``torch_hook`` (DDP only) returns a function that registers one of PyTorch's hooks on the wrapped
    model and returns its state. Neither: DDP's own allreduce. ``main``: among the arms run at 16
    workers too."""

    name: str
    framework: str
    role: str
    #: what a user writes for it
    spelled: str
    compression: Callable[[Setting], Any] | None = None
    torch_hook: Callable[[Setting], Callable[[Any], Any]] | None = None
    main: bool = False
    #: DDP only: every gradient in one bucket
    one_bucket: bool = False
    #: PyTorch's PowerSGD hook: the steps it runs as a plain allreduce before it compresses
    dense_steps: int = 0
    #: a baseline run at a setting matched to one of ours rather than at its defaults
    matched: bool = False


# -- the compressions ----------------------------------------------------------------------------------

def _hvd_compression(kind: str) -> Callable[[Setting], Any]:
    def build(setting: Setting) -> Any:
        import horovod.torch as hvd

        return getattr(hvd.Compression, kind)
    return build


def _grace(make: Callable[[Setting], Any], memory: str | None = None, communicator: str | None = None
           ) -> Callable[[Setting], Any]:
    """A bundle of ``make``'s compressor: ``memory`` ``"ef"`` error feedback (``None``: the
    compressor's recommended memory); ``communicator`` ``"auto"`` or ``"scattergather"``
    (``ScatterGather()``, two-phase forced) or ``None`` (the default route)."""
    def build(setting: Setting) -> Any:
        from grace_legacy import Grace, Residual, ScatterGather

        chosen = ScatterGather() if communicator == "scattergather" else communicator
        return Grace(make(setting), memory=Residual() if memory == "ef" else None, communicator=chosen)
    return build


def _topk(density: Callable[[Setting], float] | float) -> Callable[[Setting], Any]:
    def make(setting: Setting) -> Any:
        from grace_legacy import TopK

        return TopK(density(setting) if callable(density) else density)
    return make


def shapes_of(model: nn.Module) -> list[torch.Size]:
    return [p.shape for p in model.parameters()]


def equal_bytes_density(shapes: Sequence[torch.Size], world_size: int, density: float = DENSITY) -> float:
    """The Top-k density at which the byte-optimal bundle (``communicator="auto"``, two-phase where
    that moves fewer bytes) puts as many link bytes per step as the default bundle (each rank's
    top-k gathered) at ``density``: a bisection on the planner's link bytes, which grow with it."""
    from grace_legacy import TopK
    from grace_legacy.planner import plan

    def link(d: float, route: str | None) -> float:
        return plan(TopK(d), shapes, world_size=world_size, route=route).phase_totals(0)[0]

    budget = link(density, None)
    low, high = density, 1.0
    if link(high, "auto") <= budget:
        return high
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (middle, high) if link(middle, "auto") <= budget else (low, middle)
    return low


def _legacy(setting: Setting) -> Any:
    """LEGACY by layer, budget-matched to the two-phase Top-k arm's link bytes at this many workers."""
    from grace_legacy import Legacy, TopK

    return Legacy.budget_matched(TopK(), DENSITY, by="layer", sizes=setting.model.named_parameters(),
                                 splits=[SPLIT], layer_factors=list(LAYER_FACTORS), world_size=setting.world_size,
                                 communicator="auto")


def _named(name: str, *args: Any, **kwargs: Any) -> Callable[[Setting], Any]:
    """``grace_legacy.NAME(*args, **kwargs)``, built when the arm is."""
    def make(setting: Setting) -> Any:
        import grace_legacy

        return getattr(grace_legacy, name)(*args, **kwargs)
    return make


def _efsignsgd(setting: Setting) -> Any:
    from grace_legacy import EFSignSGD

    return EFSignSGD(lr=setting.lr)


def _torch_fp16(setting: Setting) -> Callable[[Any], Any]:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    def register(ddp: Any) -> None:
        ddp.register_comm_hook(None, fp16_compress_hook)
    return register


def _torch_powersgd(**options: Any) -> Callable[[Setting], Callable[[Any], Any]]:
    """PyTorch's hook with ``PowerSGDState(process_group=None, **options)``: its defaults but those given."""
    def build(setting: Setting) -> Callable[[Any], Any]:
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

        def register(ddp: Any) -> Any:
            state = PowerSGDState(process_group=None, **options)
            ddp.register_comm_hook(state, powerSGD_hook)
            return state
        return register
    return build


#: PyTorch's PowerSGD hook at its defaults: a plain allreduce for its first 1000 steps.
TORCH_POWERSGD_DEFAULT_START = 1000
#: The least start_powerSGD_iter PyTorch accepts with error feedback or warm start (its defaults).
TORCH_POWERSGD_EARLIEST = 2

ARM_LIST = [
    # Horovod, under its Gloo launcher
    Arm("dense fp32", HOROVOD, DENSE_ROLE, "compression=hvd.Compression.none", _hvd_compression("none"), main=True),
    Arm("hvd Compression.fp16", HOROVOD, BASELINE, "compression=hvd.Compression.fp16", _hvd_compression("fp16"),
        main=True),
    Arm("FP16", HOROVOD, OURS, "compression=Grace(FP16())", _grace(_named("FP16"))),
    Arm("Top-k + EF gathered", HOROVOD, OURS, f"Grace(TopK({DENSITY}), memory=Residual())",
        _grace(_topk(DENSITY), "ef"), main=True),
    Arm("Top-k + EF two-phase", HOROVOD, OURS, f'Grace(TopK({DENSITY}), memory=Residual(), communicator="auto")',
        _grace(_topk(DENSITY), "ef", "auto"), main=True),
    Arm("Top-k + EF two-phase, equal bytes", HOROVOD, OURS,
        'Grace(TopK(d), memory=Residual(), communicator="auto"), d: the gathered arm\'s link bytes',
        _grace(_topk(lambda s: equal_bytes_density(shapes_of(s.model), s.world_size)), "ef", "auto")),
    Arm("QSGD two-phase", HOROVOD, OURS, f"Grace(QSGD({QSGD_LEVELS}), communicator=ScatterGather())",
        _grace(_named("QSGD", QSGD_LEVELS, seed=1), None, "scattergather")),
    Arm("EF-signSGD two-phase", HOROVOD, OURS, "Grace(EFSignSGD(lr), communicator=ScatterGather())",
        _grace(_efsignsgd, None, "scattergather")),
    Arm("LEGACY layer + EF two-phase", HOROVOD, OURS,
        f'Grace(Legacy.budget_matched(TopK(), {DENSITY}, by="layer", splits=[{SPLIT}], '
        f'layer_factors={list(LAYER_FACTORS)}, world_size=P, communicator="auto"), memory=Residual(), '
        f'communicator="auto")', _grace(_legacy, "ef", "auto"), main=True),
    # DDP, under torch.distributed
    Arm("DDP allreduce fp32", DDP, DENSE_ROLE, "DistributedDataParallel(model), no hook"),
    Arm("torch fp16_compress_hook", DDP, BASELINE, "ddp.register_comm_hook(None, fp16_compress_hook)",
        torch_hook=_torch_fp16, main=True),
    Arm("torch powerSGD_hook defaults", DDP, BASELINE,
        "ddp.register_comm_hook(PowerSGDState(process_group=None), powerSGD_hook), one DDP bucket",
        torch_hook=_torch_powersgd(), main=True, one_bucket=True, dense_steps=TORCH_POWERSGD_DEFAULT_START),
    Arm(f"torch powerSGD_hook rank {POWERSGD_RANK}", DDP, BASELINE,
        f"PowerSGDState(process_group=None, matrix_approximation_rank={POWERSGD_RANK}, "
        f"start_powerSGD_iter={TORCH_POWERSGD_EARLIEST}), one DDP bucket",
        torch_hook=_torch_powersgd(matrix_approximation_rank=POWERSGD_RANK,
                                   start_powerSGD_iter=TORCH_POWERSGD_EARLIEST),
        main=True, one_bucket=True, dense_steps=TORCH_POWERSGD_EARLIEST, matched=True),
    Arm("BF16", DDP, OURS, "grace_legacy.ddp.register(ddp, Grace(BF16()))", _grace(_named("BF16"))),
    Arm(f"PowerSGD rank {POWERSGD_RANK}", DDP, OURS,
        f"grace_legacy.ddp.register(ddp, Grace(PowerSGD({POWERSGD_RANK})))",
        _grace(_named("PowerSGD", POWERSGD_RANK)), main=True),
    # As a user writes it: its recommended memory (error feedback), the default route.
    Arm("Top-k default bundle", DDP, OURS, f"grace_legacy.ddp.register(ddp, Grace(TopK({DENSITY})))",
        _grace(_topk(DENSITY)), main=True),
]

ARMS = {arm.name: arm for arm in ARM_LIST}
#: The reference every target and speed-up is taken from.
DENSE = "dense fp32"
#: The smoke run's arms (one Horovod launch).
QUICK_ARMS = ("dense fp32", "hvd Compression.fp16", "Top-k + EF two-phase")


def planned(arm: Arm, setting: Setting) -> tuple[Any, str | None]:
    """The compressor and route the planner estimates ``arm``'s steps from: ``(compressor, route)``
    as :func:`grace_legacy.planner.plan` takes them. The baselines by what they put on the wire:
    dense fp32 (and PyTorch's PowerSGD hook before it compresses) a dense allreduce, the 16-bit ones
    an fp16 allreduce, PyTorch's PowerSGD at rank r our PowerSGD at rank r."""
    from grace_legacy import FP16, Grace, NoCompression, PowerSGD

    if arm.role == DENSE_ROLE or arm.dense_steps >= TORCH_POWERSGD_DEFAULT_START:
        return NoCompression(), "dense"
    if arm.role == BASELINE:
        return (PowerSGD(POWERSGD_RANK), None) if arm.dense_steps else (FP16(), None)
    bundle = arm.compression(setting)
    if not isinstance(bundle, Grace):
        bundle = Grace(bundle)
    communicator = bundle.communicator
    route = "auto" if bundle.byte_optimal else (communicator.route if communicator is not None else None)
    return bundle.compressor, route
