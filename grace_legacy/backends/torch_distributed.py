"""Collectives through ``torch.distributed`` (Gloo, NCCL or MPI: whatever the process group runs).

Every rank must call the ``*_async`` methods and :meth:`TorchDistributedBackend.wait` in the same
order (collectives match by issue order; names only label errors). An allgather takes rows of
different counts from different ranks, as Horovod's does (``variable_gather``:
docs/DESIGN.md#variable-gather).

No collective leaves a Python object for one of Gloo's C++ worker threads to release: its tensors
are held from C++ until no work holds them (:mod:`grace_legacy.runtime.lending`), and it is issued
without the backward pass's ``contextvars.Context`` in thread-local state, so a job that finished
exits 0 (docs/DESIGN.md#clean-exit).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from grace_legacy.runtime.lending import Lender

#: How the rows of an allgather of rows of different counts travel: padded to the longest count,
#: exactly (each rank broadcasting its own), or ``auto``, padded unless that moves PADDING_LIMIT
#: times the bytes or more.
VARIABLE_GATHERS = ("auto", "padded", "exact")

#: ``"auto"`` broadcasts exactly when a padded gather would move this many times the bytes or more.
PADDING_LIMIT = 1.5

#: Gathers equal sizes into one tensor (renamed in recent releases; the old name warns there).
_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

#: The key under which ``torch.autograd.backward`` keeps a ``contextvars.Context`` in thread-local
#: state during a backward pass (recent releases; older ones keep nothing there).
_BACKWARD_CONTEXT = "context"
_TLS = torch._C if hasattr(torch._C, "_is_key_in_tls") else None

#: The tensors lent to collectives, held from C++ until no work holds them.
_LENDER = Lender()


def _issue(collective: Callable[..., Any], tensors: Sequence[torch.Tensor], **kwargs: Any) -> Any:
    """``collective(*tensors, **kwargs)``, the tensors lent (:class:`~grace_legacy.runtime.lending.Lender`),
    with no backward-pass context in thread-local state (docs/DESIGN.md#clean-exit)."""
    _LENDER.lend(tensors)
    context = _TLS is not None and _TLS._is_key_in_tls(_BACKWARD_CONTEXT)
    if context:
        stashed = _TLS._get_obj_in_tls(_BACKWARD_CONTEXT)
        _TLS._remove_obj_from_tls(_BACKWARD_CONTEXT)
    try:
        return collective(*tensors, **kwargs)
    finally:
        if context:
            _TLS._stash_obj_in_tls(_BACKWARD_CONTEXT, stashed)


class _Launched:
    """An in-place collective on a staged copy; ``divisor`` averages a sum on arrival."""

    __slots__ = ("work", "staged", "divisor", "device")

    def __init__(self, work: Any, staged: torch.Tensor, divisor: int | None, device: torch.device) -> None:
        self.work, self.staged, self.divisor, self.device = work, staged, divisor, device

    def result(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None  # the work holds its tensors: let go of it, so that they can be let go
        if self.divisor is not None:
            self.staged.div_(self.divisor)
        return self.staged.to(self.device)


class _Gather:
    """An allgather of rows of different counts: the counts first, then the rows."""

    def __init__(self, backend: TorchDistributedBackend, local: torch.Tensor, name: str, device: torch.device) -> None:
        self.backend, self.local, self.name, self.device = backend, local, name, device
        # (rows, elements per row): the second catches ranks whose rows differ in shape, which a
        # padded gather would otherwise turn into a size mismatch deep inside the library.
        shape = torch.tensor([local.shape[0], local[0].numel() if local.shape[0] else -1], dtype=torch.int64,
                             device=local.device)
        self.shapes = torch.empty(backend.size() * 2, dtype=torch.int64, device=local.device)
        self.shapes_work: Any = _issue(_gather_into_tensor, (self.shapes, shape), group=backend.group,
                                       async_op=True)
        self.counts: list[int] | None = None
        self.mode = backend.variable_gather
        self.launched: list[tuple[Any, torch.Tensor]] = []

    def launch(self) -> None:
        """Wait for the counts and launch the rows' collectives (once)."""
        if self.counts is not None:
            return
        self.shapes_work.wait()
        self.shapes_work = None
        pairs = self.shapes.view(-1, 2).tolist()
        self.counts = [rows for rows, _ in pairs]
        widths = {width for rows, width in pairs if rows}
        if len(widths) > 1:
            raise ValueError(f"allgather {self.name!r}: the ranks' rows have different sizes "
                             f"({[width for _, width in pairs]} elements); only the first dimension may differ")
        group, local, longest = self.backend.group, self.local, max(self.counts)
        if longest == 0:
            return
        if self.mode == "auto":  # every rank knows every count, so every rank chooses alike
            padded_rows = longest * len(self.counts)
            self.mode = "exact" if padded_rows >= PADDING_LIMIT * sum(self.counts) else "padded"
        if self.mode == "padded":
            padded = local
            if local.shape[0] != longest:
                padded = local.new_zeros((longest, *local.shape[1:]))
                padded[:local.shape[0]] = local
            out = local.new_empty((self.backend.size() * longest, *local.shape[1:]))
            self.launched.append((_issue(_gather_into_tensor, (out, padded), group=group, async_op=True), out))
            return
        for root, rows in enumerate(self.counts):
            if rows == 0:
                continue
            buffer = local if root == self.backend.rank() else local.new_empty((rows, *local.shape[1:]))
            work = _issue(dist.broadcast, (buffer,), src=dist.get_global_rank(group, root), group=group,
                          async_op=True)
            self.launched.append((work, buffer))

    def result(self) -> torch.Tensor:
        self.launch()
        assert self.counts is not None
        for work, _ in self.launched:
            if work is not None:
                work.wait()
        self.launched = [(None, buffer) for _, buffer in self.launched]
        if not self.launched:
            return self.local.new_empty((0, *self.local.shape[1:])).to(self.device)
        if self.mode == "exact":
            gathered = torch.cat([buffer for _, buffer in self.launched])
        else:
            out = self.launched[0][1]
            longest = max(self.counts)
            gathered = out if min(self.counts) == longest else torch.cat(
                [out[r * longest: r * longest + rows] for r, rows in enumerate(self.counts)])
        return gathered.to(self.device)


class _AllToAll:
    """An all-to-all whose receive counts are exchanged first (a few bytes, unless the caller knows
    them), then the rows."""

    def __init__(self, backend: TorchDistributedBackend, local: torch.Tensor, splits: list[int],
                 device: torch.device, received: list[int] | None = None) -> None:
        self.backend, self.local, self.splits, self.device = backend, local, list(splits), device
        self.counts: list[int] | None = None if received is None else list(received)
        self.counts_work: Any = None
        if self.counts is None:
            self.sent = torch.tensor(self.splits, dtype=torch.int64, device=local.device)
            self.received = torch.empty(backend.size(), dtype=torch.int64, device=local.device)
            self.counts_work = _issue(dist.all_to_all_single, (self.received, self.sent), group=backend.group,
                                      async_op=True)
        self.launched: tuple[Any, torch.Tensor] | None = None

    def launch(self) -> None:
        """Wait for the counts (unless the caller knew them) and launch the rows (once)."""
        if self.launched is not None:
            return
        if self.counts is None:
            self.counts_work.wait()
            self.counts_work = None
            self.counts = self.received.tolist()
        counts = self.counts
        out = self.local.new_empty((sum(counts), *self.local.shape[1:]))
        work = _issue(dist.all_to_all_single, (out, self.local), output_split_sizes=counts,
                      input_split_sizes=self.splits, group=self.backend.group, async_op=True)
        self.launched = (work, out)

    def result(self) -> torch.Tensor:
        self.launch()
        assert self.launched is not None
        work, out = self.launched
        if work is not None:
            work.wait()
            self.launched = (None, out)
        return out.to(self.device)


class TorchDistributedBackend:
    """Asynchronous ``torch.distributed`` collectives on one process group (default: the world).
    Inputs are never changed (the collectives run on a copy); a CPU tensor given to an NCCL-only
    group travels through the current CUDA device and comes back; an average is the sum divided by
    the group's size on arrival, as Horovod does it."""

    def __init__(self, process_group: Any = None, *, variable_gather: str = "auto") -> None:
        # The argument first: a typo is reported as such, with or without a process group.
        if not isinstance(variable_gather, str) or variable_gather not in VARIABLE_GATHERS:
            raise ValueError(f"TorchDistributedBackend: variable_gather must be one of {VARIABLE_GATHERS}, "
                             f"got {variable_gather!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("TorchDistributedBackend: torch.distributed is not initialized; call "
                               "torch.distributed.init_process_group first (torchrun sets up its environment)")
        self.group = process_group if process_group is not None else dist.group.WORLD
        self._rank = dist.get_rank(self.group)
        if self._rank < 0:
            raise ValueError("TorchDistributedBackend: this process is not a member of process_group")
        self._size = dist.get_world_size(self.group)
        self.variable_gather = variable_gather
        # A group served by NCCL alone cannot move CPU tensors.
        self._cpu_stage = (torch.device("cuda", torch.cuda.current_device())
                           if dist.get_backend(self.group) == "nccl" else None)
        self._unlaunched: deque[_Gather | _AllToAll] = deque()

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def _staged(self, tensor: torch.Tensor, copy: bool) -> torch.Tensor:
        if self._cpu_stage is not None and tensor.device.type == "cpu":
            return tensor.to(self._cpu_stage).contiguous()
        return tensor.clone(memory_format=torch.contiguous_format) if copy else tensor.contiguous()

    def _launch_waiting_gathers(self) -> None:
        """Launch the rows of every earlier gather, in the order they were asked for."""
        while self._unlaunched:
            self._unlaunched.popleft().launch()

    def allreduce_async(self, tensor: torch.Tensor, name: str, average: bool) -> _Launched:
        if average and not tensor.is_floating_point():
            raise TypeError(f"allreduce {name!r}: an average needs a floating-point tensor, got {tensor.dtype}")
        staged = self._staged(tensor, copy=True)
        work = _issue(dist.all_reduce, (staged,), op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return _Launched(work, staged, self._size if average else None, tensor.device)

    def allreduce_owned_async(self, tensor: torch.Tensor, name: str, average: bool) -> _Launched:
        """As :meth:`allreduce_async` for a contiguous ``tensor`` the caller gives up (a concatenation
        made for the collective): reduced in place, without a copy; the result is ``tensor``."""
        if average and not tensor.is_floating_point():
            raise TypeError(f"allreduce {name!r}: an average needs a floating-point tensor, got {tensor.dtype}")
        if not tensor.is_contiguous() or (self._cpu_stage is not None and tensor.device.type == "cpu"):
            return self.allreduce_async(tensor, name, average)
        work = _issue(dist.all_reduce, (tensor,), op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return _Launched(work, tensor, self._size if average else None, tensor.device)

    def allgather_async(self, tensor: torch.Tensor, name: str) -> _Gather:
        """Every rank's ``tensor`` concatenated along the first dimension, in rank order; the
        first dimension may differ between ranks, the others may not."""
        if tensor.dim() == 0:
            raise ValueError(f"allgather {name!r}: a 0-dim tensor has no rows to gather; reshape it to (1,)")
        self._launch_waiting_gathers()
        gather = _Gather(self, self._staged(tensor, copy=False), name, tensor.device)
        self._unlaunched.append(gather)
        return gather

    def alltoall_async(self, tensor: torch.Tensor, splits: list[int], name: str,
                       received: list[int] | None = None) -> _AllToAll:
        """Rows of ``tensor`` to each rank by ``splits``; what every rank sent this one, in rank order.
        ``received``: how many rows each rank sends this one, where the caller knows (no counts
        are exchanged then); every rank must know it, or none."""
        if len(splits) != self._size or sum(splits) != tensor.shape[0]:
            raise ValueError(f"alltoall {name!r}: splits {splits} must give each of {self._size} ranks its rows "
                             f"of the {tensor.shape[0]}")
        if received is not None and (len(received) != self._size or min(received) < 0):
            raise ValueError(f"alltoall {name!r}: received {received} must give a count for each of {self._size} ranks")
        self._launch_waiting_gathers()
        exchange = _AllToAll(self, self._staged(tensor, copy=False), splits, tensor.device, received)
        self._unlaunched.append(exchange)
        return exchange

    def broadcast_async(self, tensor: torch.Tensor, root_rank: int, name: str) -> _Launched:
        """``root_rank`` is a rank within the group; every rank's ``tensor`` has the root's shape."""
        staged = self._staged(tensor, copy=False)
        if self._rank != root_rank:  # overwritten: its contents do not matter, the input's must not change
            staged = torch.empty_like(staged, memory_format=torch.contiguous_format)
        work = _issue(dist.broadcast, (staged,), src=dist.get_global_rank(self.group, root_rank), group=self.group,
                      async_op=True)
        return _Launched(work, staged, None, tensor.device)

    def wait(self, handle: _Launched | _Gather | _AllToAll) -> torch.Tensor:
        self._launch_waiting_gathers()
        return handle.result()
