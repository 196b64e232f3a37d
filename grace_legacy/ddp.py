"""grace_legacy compression as a ``DistributedDataParallel`` communication hook (docs/DDP.md)::

    state = grace_legacy.ddp.register(DistributedDataParallel(model), Legacy(TopK(), ...))

``compression`` is what ``hvd.DistributedOptimizer`` accepts from grace_legacy, and every gradient
is what the Horovod path computes from the same local gradients (compressed per parameter under its
name, averaged over the process group), the same bits on every rank, with the same guarantees. All
buckets complete at the last one, in one issue order every rank shares
(docs/DESIGN.md#one-issue-order); the schedules count one step per backward pass that reaches it.

DDP's options: ``no_sync()`` accumulates without the hook; with ``find_unused_parameters=True`` a
parameter unused on this rank takes part with zeros, and one unused on every rank keeps its
gradient as DDP leaves it (its share of a residual sent that step is not applied);
``static_graph`` and ``gradient_as_bucket_view`` work unchanged; ``mixed_precision``,
``skip_all_reduce_unused_params``, sparse gradients and a model whose parameters are all delayed
(``delay_all_reduce_named_params``) are refused with a ``ValueError`` naming them.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations against the classes.
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from grace_legacy.backends.torch_distributed import TorchDistributedBackend
from grace_legacy.consistency import verify_ranks_agree
from grace_legacy.core.backend import Pending
from grace_legacy.core.communicator import Communicator
from grace_legacy.core.compressor import Compressor
from grace_legacy.grace import Grace, as_bundle

__all__ = ["GraceState", "grace_hook", "register"]


class _Step:
    """One backward pass: the gradients on their way and each bucket's promise."""

    def __init__(self) -> None:
        #: the gradients started one by one
        self.pending: dict[str, Pending] = {}
        #: each bucket's buffer, its parameters' names, its promise to DDP, and the pending buffer
        #: itself when the bucket went as one tensor (GraceState.exchange)
        self.buckets: list[tuple[torch.Tensor, list[str], torch.futures.Future, Pending | None]] = []
        #: the buckets whose gradients are started but not launched (GraceState.fuse_rounds)
        self.held: list[int] = []


def _refuse_options(ddp_model: DistributedDataParallel) -> None:
    if getattr(ddp_model, "mixed_precision", None) is not None:
        raise ValueError("grace_legacy.ddp: DistributedDataParallel(mixed_precision=...) is not supported: it "
                         "reduces gradients in another dtype than the hook compresses; use torch.autocast with "
                         "torch.amp.GradScaler instead")
    if getattr(ddp_model, "skip_all_reduce_unused_params", False):
        raise ValueError("grace_legacy.ddp: DistributedDataParallel(skip_all_reduce_unused_params=True) is not "
                         "supported: every parameter's compression state must see every step; leave it False")
    sparse = [name for name, module in ddp_model.module.named_modules()
              if isinstance(module, torch.nn.Embedding | torch.nn.EmbeddingBag) and module.sparse]
    if sparse:
        raise ValueError(f"grace_legacy.ddp: {sparse[0]!r} has sparse gradients (sparse=True): grace_legacy "
                         f"compresses dense gradients; build it with sparse=False")
    if getattr(ddp_model, "_delay_all_reduce_all_params", False):
        raise ValueError("grace_legacy.ddp: every parameter is in delay_all_reduce_named_params, so DDP calls no "
                         "communication hook; leave some parameters to the hook")


class GraceState:
    """The state of :func:`grace_hook` for one DDP model: the ``Grace`` bundle, the backend on the
    model's process group, each parameter's name. Building it is a collective: the ranks compare
    their set-ups here and at the first backward pass. ``set_epoch``, ``stats``, ``scalars``,
    ``state_dict`` and ``load_state_dict`` are the bundle's (each rank saves and loads its own)."""

    def __init__(self, ddp_model: DistributedDataParallel, compression: Compressor | Grace,
                 fuse_rounds: bool = True, communicator: Communicator | str | None = None) -> None:
        # The compression first: checking it needs no process group, so a wrong one is reported
        # with or without a DistributedDataParallel model.
        self.grace: Grace = as_bundle(compression, "grace_legacy.ddp", communicator)
        if not isinstance(ddp_model, DistributedDataParallel):
            raise TypeError(f"grace_legacy.ddp: ddp_model must be a torch.nn.parallel.DistributedDataParallel, "
                            f"got {type(ddp_model).__name__}: register the wrapped model (with Accelerate the one "
                            f"accelerator.prepare returns, which is wrapped only when more than one process runs; "
                            f"with Lightning use grace_legacy.lightning's strategies)")
        _refuse_options(ddp_model)
        if not isinstance(fuse_rounds, bool):
            raise TypeError(f"grace_legacy.ddp: fuse_rounds must be True or False, got {fuse_rounds!r}")
        #: Whether a multi-round compressor's buckets wait for the last one and travel together.
        self.fuse_rounds = fuse_rounds
        self.backend = TorchDistributedBackend(ddp_model.process_group)
        ignored = getattr(ddp_model, "parameters_to_ignore", set())
        # The module's own names, as Horovod users name parameters: seeds and LEGACY's rules use them.
        named = [(name, p) for name, p in ddp_model.module.named_parameters()
                 if p.requires_grad and name not in ignored]
        self._names = {id(p): name for name, p in named}
        self._parameters = {name: p for name, p in named}
        # Reverse registration order: buckets fill while backward goes on; results are collected
        # in this order on every rank.
        self._order = [name for name, _ in reversed(named)]
        self._sorted_names = sorted(self._order)  # the order the ranks' flags are compared in

        self._options = {option: str(getattr(ddp_model, option, None)) for option in
                         ("find_unused_parameters", "static_graph", "gradient_as_bucket_view")}
        self._step: _Step | None = None
        self._abandoned = False
        self._verified = False
        self.steps = 0
        self._verify("registration")

    # -- what the ranks must agree on --------------------------------------------------------
    def _description(self) -> dict[str, str | list[str]]:
        return {"parameters": sorted(f"{name}{list(p.shape)} {str(p.dtype).removeprefix('torch.')}"
                                     for name, p in self._parameters.items()),
                "op": "Average", "fuse_rounds": str(self.fuse_rounds),
                **{f"DistributedDataParallel {k}": v for k, v in self._options.items()},
                **self.grace.describe()}

    def _verify(self, when: str) -> None:
        verify_ranks_agree(self.backend, self._description(), f"consistency.{when}")

    # -- the hook ----------------------------------------------------------------------------
    def exchange(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """Start ``bucket``'s parameters; at the last bucket finish the whole step."""
        index = bucket.index()
        if index == 0:
            if self._step is not None:
                raise RuntimeError("grace_legacy.ddp: a backward pass started before the previous one's buckets "
                                   "were all exchanged")
            if self._abandoned:
                # The last backward pass failed half-way: its state is undone before this one starts.
                self.grace.undo_step()
                self._abandoned = False
            if not self._verified:
                # Again here: set_epoch or a loaded state may have moved one rank's schedule.
                self._verify("first-step")
                self._verified = True
            self._step = _Step()
        elif self._step is None or len(self._step.buckets) != index:
            raise RuntimeError(f"grace_legacy.ddp: bucket {index} arrived out of order; DDP hands buckets over in "
                               f"index order")
        step = self._step
        buffer = bucket.buffer()
        names = []
        try:
            if buffer.is_sparse:
                raise ValueError("grace_legacy.ddp: DDP handed over a sparse gradient: grace_legacy compresses "
                                 "dense gradients")
            parameters = bucket.parameters()
            for parameter in parameters:
                name = self._names.get(id(parameter))
                if name is None:
                    raise RuntimeError("grace_legacy.ddp: DDP handed over a parameter that was not in the model "
                                       "when the hook was registered")
                names.append(name)
            # Fused as DDP fused them: each bucket launches as it arrives, overlapping the rest of
            # the backward pass as DDP's own allreduce does; as one tensor where that is the same.
            # The parameters give the gradients' shapes and dtypes (DDP casts none: mixed_precision
            # is refused), which is all a whole bucket needs: bucket.gradients() makes a view of
            # the bucket for every gradient, work only the tensor-by-tensor path uses.
            whole = self.grace.start_whole(f"ddp{index}", buffer, parameters, names, self.backend, average=True)
            if whole is None:
                for name, gradient in zip(names, bucket.gradients(), strict=True):
                    # DDP reads the bucket only through the future: a result may be decoded into it.
                    step.pending[name] = self.grace.start(gradient, name, self.backend, average=True, hold=True,
                                                          in_place=True)
                step.held.append(index)
            fusion = self.grace.fusion
            if step.held and (bucket.is_last() or not (self.fuse_rounds and fusion.holds_later_rounds())):
                # Alone, the bucket's gradients are compressed by now: its results may be decoded into it.
                alone = step.held == [index] and buffer.is_contiguous()
                label = f"ddp{index}" if len(step.held) == 1 else f"ddp{step.held[0]}-{index}"
                fusion.launch_held(label, self.backend, average=True, into=buffer if alone else None)
                step.held.clear()
        except BaseException:
            self._step = None  # the backward pass fails with the error; the next one starts afresh
            self._abandoned = True
            raise
        future: torch.futures.Future = torch.futures.Future(
            devices=[buffer.device] if buffer.device.type == "cuda" else None)
        step.buckets.append((buffer, names, future, whole))
        if bucket.is_last():
            self._finish_step(step)
        return future

    def _finish_step(self, step: _Step) -> None:
        try:
            arrived = set(step.pending).union(*(names for _, names, _, whole in step.buckets if whole is not None))
            missing = [name for name in self._order if name not in arrived]
            if missing:
                raise RuntimeError(f"grace_legacy.ddp: the buckets of this backward pass lacked {missing}")
            self.grace.fusion.advance_held()  # every bucket's later rounds in flight together
            results = {name: pending() for name, pending in step.pending.items()}
            for _, _, _, whole in step.buckets:
                if whole is not None:
                    whole()  # decoded into the bucket itself, where an inf or NaN of any rank shows
            flagged = self.grace.guard.nonfinite_names(self._sorted_names, self.backend)
            for name in flagged.intersection(results):
                # A compressor may have dropped the inf; GradScaler must see it on every rank.
                if bool(torch.isfinite(results[name]).all()):
                    results[name] = torch.full_like(results[name], float("nan"))
            if flagged:
                # GradScaler skips the whole step, so no tensor's memory or schedule may keep it.
                for name in self._order:
                    self.grace.guard.undo(name)
            self.grace.end_step(self.backend)
        except BaseException as error:
            for _, _, future, _ in step.buckets:
                future.set_exception(error)
            self._step = None
            self._abandoned = True
            raise
        for buffer, names, future, whole in step.buckets:
            if whole is None:
                # Into the bucket itself, as PyTorch's hooks do: no bucket-sized tensor per step.
                pieces = [results[name] for name in names]
                joined = _back_to_back(pieces, buffer.numel())
                if joined is not None:  # decoded as one flat in the bucket's order: one copy, or none
                    if joined.data_ptr() != buffer.data_ptr() or joined.dtype != buffer.dtype:
                        buffer.copy_(joined)
                else:
                    offset = 0
                    for piece in pieces:
                        result, place = piece.reshape(-1), buffer[offset:offset + piece.numel()]
                        if result.data_ptr() != place.data_ptr() or result.dtype != place.dtype:
                            place.copy_(result)  # else decoded there already
                        offset += result.numel()
            future.set_result(buffer)
        self._step = None
        self.steps += 1

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
        """This rank's compression state (:meth:`grace_legacy.Grace.state_dict`)."""
        return self.grace.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._abandoned:  # a failed backward pass's state goes before the checkpoint's comes
            self.grace.undo_step()
            self._abandoned = False
        self.grace.load_state_dict(state)
        self._verified = False

    def __repr__(self) -> str:
        return f"GraceState({self.grace!r}, {len(self._order)} parameters)"


def _back_to_back(pieces: list[torch.Tensor], numel: int) -> torch.Tensor | None:
    """The 1-D tensor of ``numel`` elements that ``pieces`` (contiguous, one dtype and storage)
    make up back to back, in order, or ``None``."""
    first = pieces[0]
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for piece in pieces:
        if (piece.dtype != first.dtype or not piece.is_contiguous() or piece.storage_offset() != offset
                or piece.untyped_storage().data_ptr() != storage):
            return None
        offset += piece.numel()
    if offset - first.storage_offset() != numel:
        return None
    return first.as_strided((numel,), (1,), first.storage_offset())


def grace_hook(state: GraceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook: ``ddp_model.register_comm_hook(GraceState(ddp_model, compression),
    grace_hook)``."""
    if not isinstance(state, GraceState):
        raise TypeError(f"grace_hook: the hook's state must be a grace_legacy.ddp.GraceState, got "
                        f"{type(state).__name__}")
    return state.exchange(bucket)


def register(ddp_model: DistributedDataParallel, compression: Compressor | Grace, *,
             fuse_rounds: bool = True, communicator: Communicator | str | None = None) -> GraceState:
    """Compress ``ddp_model``'s gradients with ``compression``; returns the hook's state. Every rank
    of the model's process group must call it, before the first backward pass.

    ``communicator``: for a bare compressor or schedule, the bundle's (``Grace``'s argument):
    ``None``, the route of the compressor's own aggregation per tensor; ``"auto"``, the fewest link
    bytes, two-phase included (a different algorithm where it is taken); or a communicator.

    ``fuse_rounds``: a compressor with several allreduce rounds (PowerSGD) holds each bucket's
    payloads until DDP hands over the last bucket, so that each round is one allreduce for the
    whole model rather than one per bucket. Its second round needs the first round of every
    bucket anyway, so what is given up is only the first round's overlap with the rest of the
    backward pass; what is won is one collective, and one wait for the slowest rank, per bucket
    and round. On a fast link that wait is most of a collective's cost
    (``benchmarks/results/performance.md``, section "fast_links", measures both). ``False``
    launches each bucket's first round as it arrives. Single-round compressors are unaffected."""
    state = GraceState(ddp_model, compression, fuse_rounds=fuse_rounds, communicator=communicator)
    ddp_model.register_comm_hook(state, grace_hook)
    return state
