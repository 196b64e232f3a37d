"""grace_legacy compression in FSDP2's gradient reduce-scatter (docs/FSDP.md)::

    fully_shard(block) for each block; fully_shard(model)
    state = grace_legacy.fsdp.register(model, QSGD(16))        # every rank, before the first backward

Every unit of the tree (each ``fully_shard``-ed module) gets a
:class:`CompressedReduceScatter` through ``FSDPModule.set_custom_reduce_scatter``: its gradients
are compressed segment by segment, sent to their owners in one all-to-all and combined there
(:mod:`grace_legacy.fsdp.reduce_scatter`). The parameter all-gather stays FSDP2's own.

``compression`` is what the DDP hook takes (a compressor, a schedule, a ``Grace`` bundle), with one
difference: a bare compressor or schedule runs *without* error feedback here, unless it cannot run
without its own memory (EF-signSGD, DGC's momentum). A residual is as large as the unsharded
gradient on every rank, ``P`` times the gradient shard FSDP keeps: sharding exists to avoid
exactly that. A user who wants it names it, ``Grace(TopK(0.01), memory=Residual())``, knowing
its size (:meth:`GraceState.memory_report`); a warning says so when a compressor paired with error
feedback runs without it. Memory-free choices: the unbiased quantizers (QSGD, TernGrad, Natural),
FP16/BF16, U8bit.

Refused, with the alternative named: a torch without ``set_custom_reduce_scatter``; multi-round
compressors (PowerSGD); schedules that decide from the full synchronized gradient, which no rank
assembles here (Accordion, L-GreCo); a unit with several parameter groups; HSDP and replicated
meshes; a bundle with a communicator of its own.
"""

# FSDP2's unit state is private to torch (FSDPModule._get_fsdp_state, its parameter groups and
# their FSDPParams): read only here, and a torch whose internals differ is refused by name.
from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from grace_legacy.backends.torch_distributed import TorchDistributedBackend
from grace_legacy.consistency import verify_ranks_agree
from grace_legacy.core.compressor import Compressor
from grace_legacy.core.memory import Memory, NoMemory
from grace_legacy.fsdp.layout import Piece, dim0_shape, unit_pieces
from grace_legacy.fsdp.reduce_scatter import Outcome, reduce_scatter
from grace_legacy.grace import Grace, as_bundle
from grace_legacy.schedules import Accordion, LGreCo

try:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # a torch without FSDP2's custom collectives: register() says so
    FSDPModule, ReduceScatter = None, object

__all__ = ["CompressedReduceScatter", "GraceState", "register"]

_OWNER = "grace_legacy.fsdp"


def check_torch(module_class: Any = FSDPModule) -> None:
    """``RuntimeError`` naming the way out where this torch's FSDP2 has no custom reduce-scatter."""
    if module_class is None or not hasattr(module_class, "set_custom_reduce_scatter"):
        raise RuntimeError(f"{_OWNER}: this torch ({torch.__version__}) has no FSDPModule.set_custom_reduce_scatter, "
                           f"the seam a compressed reduce-scatter needs: upgrade PyTorch, or train with "
                           f"DistributedDataParallel and grace_legacy.ddp.register")


def fsdp_bundle(compression: Compressor | Grace) -> Grace:
    """``compression`` as the bundle the reduce-scatter runs: a ``Grace`` bundle as it is, a bare
    compressor or schedule without error feedback (module docstring), every refusal checked first."""
    _refuse(compression.compressor if isinstance(compression, Grace) else compression)
    if isinstance(compression, Grace):
        if compression.communicator is not None and compression.communicator != "auto":
            raise ValueError(f"{_OWNER}: {compression!r} names a communicator, but under FSDP the reduce-scatter "
                             f"is the route; leave communicator unset")
        return compression
    if not isinstance(compression, Compressor):
        return as_bundle(compression, _OWNER)  # its TypeError names what is accepted
    recommended = compression.recommended_memory()
    try:
        grace = Grace(compression, memory=NoMemory())
    except ValueError:  # its algorithm needs its memory (EF-signSGD, DGC's momentum)
        return as_bundle(compression, _OWNER)
    if not isinstance(recommended, NoMemory):
        warnings.warn(f"{_OWNER}: {compression!r} runs without error feedback: its {recommended!r} would keep a "
                      f"tensor as large as the unsharded gradient on every rank. Pass Grace({compression!r}, "
                      f"memory={recommended!r}) to choose it, or a memory-free compressor (QSGD, TernGrad, "
                      f"Natural, FP16, BF16, U8bit); docs/FSDP.md", UserWarning, stacklevel=3)
    return grace


def _refuse(compressor: object) -> None:
    """``ValueError`` naming the alternative for what cannot run in a reduce-scatter."""
    if not isinstance(compressor, Compressor):
        return
    if compressor.traits.rounds != 1:
        raise ValueError(f"{_OWNER}: {compressor!r} needs {compressor.traits.rounds} allreduce rounds, each of which "
                         f"needs the previous round's sum of the whole tensor; a reduce-scatter delivers each rank its "
                         f"shard only. Use a single-round compressor (TopK, QSGD, ...), or PowerSGD with "
                         f"DistributedDataParallel (grace_legacy.ddp)")
    if compressor.traits.spans_step or not compressor.traits.shardable:
        whole = "every gradient of the step as one tensor" if compressor.traits.spans_step else "whole tensors only"
        raise ValueError(f"{_OWNER}: {compressor!r} compresses {whole}, but a reduce-scatter compresses each "
                         f"parameter's segments apart, unit by unit as the backward pass reaches it. Use a per-tensor "
                         f"compressor (TopK, QSGD, ...), or DistributedDataParallel (grace_legacy.ddp)")
    if isinstance(compressor, Accordion | LGreCo):
        raise ValueError(f"{_OWNER}: {type(compressor).__name__} decides from the synchronized gradient of every "
                         f"tensor, which FSDP never assembles on one rank; use Legacy or DGCWarmup, which decide "
                         f"from the layer's size and the training's progress")


class _Unit:
    """One ``fully_shard``-ed module: its name and its parameters' (name, FSDPParam), in FSDP's order."""

    def __init__(self, label: str, module: nn.Module, parameters: list[tuple[str, Any]], group: Any) -> None:
        self.label, self.module, self.parameters, self.group = label, module, parameters, group
        self._pieces: dict[tuple[int, int], list[Piece]] = {}

    def param_group(self) -> Any:
        return self.module._get_fsdp_state()._fsdp_param_groups[0]

    def pieces(self, world_size: int, numel: int) -> list[Piece]:
        """The layout of a flat of ``numel`` elements; ``RuntimeError`` when FSDP left a parameter out."""
        key = (world_size, numel)
        if key not in self._pieces:
            pieces, width = unit_pieces([(name, dim0_shape(fsdp_param._orig_size, fsdp_param.fsdp_placement.dim,
                                                           world_size)) for name, fsdp_param in self.parameters],
                                        world_size)
            if width * world_size != numel:
                raise RuntimeError(
                    f"{_OWNER}: unit {self.label!r} reduce-scattered {numel} elements, but its parameters fill "
                    f"{width * world_size}: some parameter got no gradient in this backward pass. Every parameter "
                    f"is compressed every step: call set_reduce_scatter_unused_params(True) on the model so that "
                    f"FSDP sends zeros for unused ones")
            self._pieces[key] = pieces
        return self._pieces[key]


def _units(module: nn.Module) -> list[_Unit]:
    """Every unit of ``module``'s tree with parameters to reduce, after the refusals."""
    names = {id(p): name for name, p in module.named_parameters(remove_duplicate=False)}
    units = []
    for label, unit in module.named_modules():
        if not isinstance(unit, FSDPModule):
            continue
        try:
            groups = unit._get_fsdp_state()._fsdp_param_groups
        except AttributeError as error:
            raise RuntimeError(f"{_OWNER}: this torch's FSDP2 keeps its units' state otherwise ({error}); "
                               f"grace_legacy.fsdp supports torch 2.13's") from None
        if len(groups) > 1:
            raise ValueError(f"{_OWNER}: unit {label or '<root>'!r} has {len(groups)} parameter groups (a "
                             f"shard_placement_fn giving parameters other meshes), so FSDP refuses one custom "
                             f"reduce-scatter for it; shard it on one mesh, or make each mesh's parameters a unit "
                             f"of their own")
        if not groups:
            continue
        group = groups[0]
        mesh_info = group.mesh_info
        if getattr(mesh_info, "replicate_mesh_dim", None) is not None or mesh_info.mesh.ndim != 1:
            raise ValueError(f"{_OWNER}: unit {label or '<root>'!r} is on a {mesh_info.mesh.ndim}-D mesh with "
                             f"replication (HSDP): its all-reduce across replicas would stay dense. Use a 1-D mesh "
                             f"(init_device_mesh(device, (world_size,))), or DDP with grace_legacy.ddp")
        parameters = [(names[id(fp.sharded_param)], fp) for fp in group.fsdp_params if fp.sharded_param.requires_grad]
        if parameters:
            units.append(_Unit(label or "<root>", unit, parameters, mesh_info.shard_process_group))
    if not units:
        raise TypeError(f"{_OWNER}: {type(module).__name__} holds no fully_shard-ed module with trainable "
                        f"parameters: call torch.distributed.fsdp.fully_shard on it (and its blocks) first")
    return units


class GraceState:
    """The compression state of one FSDP2 model: the ``Grace`` bundle and its units. Building it is
    a collective (the ranks compare their set-ups here, and again at the first reduce-scatter).
    ``set_epoch``, ``stats``, ``scalars``, ``state_dict`` and ``load_state_dict`` are the
    bundle's (each rank saves and loads its own). The schedules count one step per backward
    pass that reduce-scatters (none under ``set_requires_gradient_sync(False)``)."""

    def __init__(self, module: nn.Module, compression: Compressor | Grace) -> None:
        check_torch()
        self.grace: Grace = fsdp_bundle(compression)
        if not isinstance(module, FSDPModule):
            raise TypeError(f"{_OWNER}: module must be the model fully_shard returned (an FSDPModule), got "
                            f"{type(module).__name__}")
        self.units = _units(module)
        self._backends: dict[int, TorchDistributedBackend] = {}
        self._routes: dict[tuple, Any] = {}
        self._step: list[Outcome] | None = None
        self._verified = False
        self._step_ends_now = False
        self.steps = 0
        #: the most bytes of send and receive buffers one unit's exchange held at once
        self.exchange_peak_bytes = 0
        self._verify(self.units[0].group, "registration")

    # -- what the ranks must agree on --------------------------------------------------------
    def _description(self) -> dict[str, str | list[str]]:
        described: dict[str, str | list[str]] = {}
        for unit in self.units:
            group = unit.param_group()
            described[f"unit {unit.label}"] = [f"{name}{list(fp._orig_size)} {str(fp.sharded_param.dtype)[6:]} "
                                               f"{fp.fsdp_placement}" for name, fp in unit.parameters]
            described[f"unit {unit.label} reduction"] = (
                f"{group.mp_policy}, divide factor {group.gradient_divide_factor}, "
                f"sum only {getattr(group, 'force_sum_reduction_for_comms', False)}")
        return {**described, **self.grace.describe()}

    def _verify(self, group: Any, when: str) -> None:
        verify_ranks_agree(self._backend(group), self._description(), f"fsdp.consistency.{when}")

    def _backend(self, group: Any) -> TorchDistributedBackend:
        backend = self._backends.get(id(group))
        if backend is None:
            backend = self._backends[id(group)] = TorchDistributedBackend(group)
        return backend

    # -- one unit's reduce-scatter -----------------------------------------------------------
    def reduce_scatter(self, unit: _Unit, output: torch.Tensor, flat: torch.Tensor, group: Any, op: Any) -> None:
        """Compress ``unit``'s flat gradient input into this rank's shard ``output``."""
        backend = self._backend(group)
        if self.grace.join_world(backend):
            self._verified = False
        if self._step is None:
            self._open_step(group)
        started: list[str] = []
        try:
            pieces = unit.pieces(backend.size(), flat.numel())
            outcome = reduce_scatter(self.grace, backend, pieces, output, flat.view(-1), op, f"fsdp.{unit.label}",
                                     self._routes, started)
        except BaseException:
            # The backward pass fails with the error: no state of its steps may stay behind.
            self._undo([*(name for done in self._step for name in done.names), *started])
            self._step = None
            raise
        self.exchange_peak_bytes = max(self.exchange_peak_bytes, outcome.buffer_bytes)
        self._step.append(outcome)

    def _undo(self, names: list[str]) -> None:
        for name in names:
            self.grace.guard.undo(name)

    def _open_step(self, group: Any) -> None:
        if not self._verified:
            # Again here: set_epoch, a loaded state or FSDP's options may have moved one rank.
            self._verify(group, "first-step")
            self._verified = True
        self._step = []
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_step)
        except RuntimeError:  # not inside a backward pass (a call by hand): the step ends with the call
            self._step_ends_now = True
        else:
            self._step_ends_now = False

    def _end_step(self) -> None:
        """At the end of the backward pass: undo the step's state changes everywhere if any rank's
        gradient of any unit was non-finite (a ``GradScaler`` skips the step), then count it."""
        step, self._step = self._step, None
        if step is None:
            return
        flags = [outcome.nonfinite for outcome in step]
        if any(flag.is_cuda for flag in flags):
            torch.cuda.synchronize()  # the flags were set on FSDP's reduce-scatter stream
        if flags and bool(torch.stack([flag.to("cpu") for flag in flags]).any()):
            self._undo([name for outcome in step for name in outcome.names])
        self.grace.end_step(next(iter(self._backends.values())))
        self.steps += 1

    def finish_call(self) -> None:
        """End the step now where no backward pass runs the end-of-step callback."""
        if self._step is not None and self._step_ends_now:
            self._end_step()

    # -- the bundle's ------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Enter epoch ``epoch``, like ``DistributedSampler.set_epoch`` (schedules change phase)."""
        self.grace.set_epoch(epoch)

    @property
    def stats(self) -> dict[str, Any]:
        return self.grace.stats

    def scalars(self, prefix: str = "grace") -> dict[str, float]:
        """:attr:`stats` as flat numbers for TensorBoard or W&B (:meth:`grace_legacy.Grace.scalars`)."""
        return self.grace.scalars(prefix)

    def reset_stats(self) -> None:
        self.grace.reset_stats()

    def state_dict(self) -> dict[str, Any]:
        """This rank's compression state (:meth:`grace_legacy.Grace.state_dict`), between steps."""
        return self.grace.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._step is not None:  # an unfinished step's state goes before the checkpoint's comes
            self._undo([name for outcome in self._step for name in outcome.names])
            self._step = None
        self.grace.load_state_dict(state)
        self._verified = False

    def memory_report(self) -> dict[str, int]:
        """Bytes on this rank: ``state`` the tensors the memory and compressor keep between steps
        (error feedback's residuals, momenta), ``exchange`` the most one unit's send and receive
        buffers held at once so far, against FSDP2's own ``gradient_shard`` (the reduce-scattered
        gradients this rank keeps) and the ``unsharded_gradient`` (every parameter's full gradient)."""
        shard = unsharded = 0
        for unit in self.units:
            for _, fp in unit.parameters:
                size = fp.sharded_param.element_size()
                shard += fp.padded_sharded_param_size.numel() * size
                unsharded += fp._orig_size.numel() * size
        return {"state": _tensor_bytes(self.grace.memory, self.grace.compressor),
                "exchange": self.exchange_peak_bytes, "gradient_shard": shard, "unsharded_gradient": unsharded}

    def __repr__(self) -> str:
        return f"GraceState({self.grace!r}, {len(self.units)} units)"


def _tensor_bytes(*roots: Any) -> int:
    """Bytes of the tensors held in the dictionaries of ``roots``' attributes (and their bases')."""
    seen: set[int] = set()
    total = 0
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            total += obj.numel() * obj.element_size()
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, Compressor | Memory):
            stack.extend(value for key, value in vars(obj).items() if key != "undo_log")
    return total


class CompressedReduceScatter(ReduceScatter):
    """The reduce-scatter of one unit: FSDP2's ``ReduceScatter`` protocol
    (``torch.distributed.fsdp._fully_shard._fsdp_api``), called once per unit and backward pass
    with the flat input and this rank's shard. The collectives run before the call returns."""

    def __init__(self, state: GraceState, unit: _Unit) -> None:
        self.state, self.unit = state, unit

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> Any:
        self.state.reduce_scatter(self.unit, output_tensor, input_tensor, group, op)
        self.state.finish_call()
        if async_op:  # already done: a work that is complete
            future: torch.futures.Future = torch.futures.Future()
            future.set_result([output_tensor])
            return torch._C._distributed_c10d._create_work_from_future(future)
        return None


def register(module: nn.Module, compression: Compressor | Grace) -> GraceState:
    """Compress the gradient reduce-scatter of every FSDP2 unit of ``module`` (the root that
    ``fully_shard`` returned) with ``compression``; returns the state. Every rank calls it after
    ``fully_shard`` and before the first backward pass."""
    state = GraceState(module, compression)
    for unit in state.units:
        unit.module.set_custom_reduce_scatter(CompressedReduceScatter(state, unit))
    return state
