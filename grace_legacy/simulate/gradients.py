"""Every simulated worker's gradient of its own micro-batch, at the model's current parameters (the
same on every worker of a synchronous data-parallel step).

Vectorised: ``torch.func.vmap`` over the workers of ``grad(loss of functional_call(model, ...))``,
one batched forward and backward whose weight gradients come out per worker (the batched matrix
products compute as many multiply-adds as one backward pass of all the micro-batches together, and
write ``W`` model-sized gradients). Its sums run in the batched kernels' order, so each worker's
gradient agrees with that worker's own backward pass within float rounding, not bit for bit.

Looped: each worker's forward and backward in turn, bit for bit what a real rank's
``loss.backward()`` computes (on as many threads). Taken when asked (``vectorize=False``), and by
``vectorize="auto"`` when the model cannot be vectorised (random operations such as dropout,
buffers updated in the forward pass such as batch norm's running statistics, data-dependent
control flow), with a warning that names the reason. Buffers a forward pass updates are kept per
worker in the looped mode, as each rank keeps its own, and the model holds worker 0's after each
step (what rank 0 evaluates with).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from grace_legacy.runtime.validation import ArgumentTypeError

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class WorkerGradients:
    """``W`` workers' gradients of ``loss(model(x_w), y_w)`` (see the module docstring).
    ``vectorize``: ``"auto"`` (vectorised, else looped with a warning), ``True`` (vectorised, or a
    ``RuntimeError`` naming why not) or ``False`` (looped)."""

    def __init__(self, model: nn.Module, loss: Loss, vectorize: bool | str = "auto") -> None:
        if not isinstance(model, nn.Module):
            raise ArgumentTypeError(f"WorkerGradients: model must be a torch.nn.Module, got {type(model).__name__}")
        if not callable(loss):
            raise ArgumentTypeError(f"WorkerGradients: loss must be callable (outputs, targets) -> loss, got {loss!r}")
        if vectorize not in ("auto", True, False) or isinstance(vectorize, int) and not isinstance(vectorize, bool):
            raise ValueError(f"WorkerGradients: vectorize must be 'auto', True or False, got {vectorize!r}")
        self.model, self.loss = model, loss
        #: whether the gradients are vectorised (``None`` until the first call decides)
        self.vectorized: bool | None = None if vectorize == "auto" else bool(vectorize)
        #: why they are not, when ``"auto"`` fell back to the loop
        self.fallback_reason: str | None = None
        self._buffers: list[dict[str, torch.Tensor]] = []

    def names(self) -> list[str]:
        """The trainable parameters' names, in registration order."""
        return [name for name, p in self.model.named_parameters() if p.requires_grad]

    def __call__(self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor],
                 workers: Sequence[int]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Worker ``workers[i]``'s gradient of batch ``(inputs[i], targets[i])`` as row ``i`` of each
        parameter's ``(W, *shape)`` tensor, and the ``W`` losses."""
        if self.vectorized is not False and _stackable(inputs) and _stackable(targets):
            try:
                return self._vectorised(torch.stack(list(inputs)), torch.stack(list(targets)))
            except Exception as error:  # noqa: BLE001 (torch.func raises many kinds; each means "cannot")
                if self.vectorized is True:
                    raise RuntimeError(f"cannot vectorise {type(self.model).__name__}'s gradients over workers "
                                       f"({type(error).__name__}: {error}); use vectorize='auto' or False") from error
                self.fallback_reason = f"{type(error).__name__}: {error}"
                warnings.warn(f"the simulated workers' gradients are computed one worker after another: "
                              f"{type(self.model).__name__} cannot be vectorised ({self.fallback_reason})",
                              RuntimeWarning, stacklevel=2)
        elif self.vectorized is True:
            raise RuntimeError("cannot vectorise over workers whose batches differ in shape; use vectorize='auto' "
                               "or False")
        self.vectorized = False
        return self._looped(inputs, targets, workers)

    def _function(self) -> Callable[..., torch.Tensor]:
        model, loss = self.model, self.loss

        def of(params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], x: torch.Tensor,
               y: torch.Tensor) -> torch.Tensor:
            return loss(functional_call(model, {**params, **buffers}, (x,)), y)
        return of

    def _parameters(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        params = {name: p.detach() for name, p in self.model.named_parameters() if p.requires_grad}
        frozen = {name: p.detach() for name, p in self.model.named_parameters() if not p.requires_grad}
        buffers = {name: b for name, b in self.model.named_buffers()}
        return params, {**frozen, **buffers}

    def _vectorised(self, x: torch.Tensor, y: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        params, others = self._parameters()
        before = {name: b.clone() for name, b in others.items()}
        grads, losses = vmap(grad_and_value(self._function()), in_dims=(None, None, 0, 0))(params, others, x, y)
        if any(not torch.equal(before[name], b) for name, b in others.items()):
            # A buffer updated by the forward pass would hold one worker's update, not each its own.
            for name, b in others.items():
                b.copy_(before[name])
            raise RuntimeError("the forward pass updates buffers (batch norm's running statistics?), which each "
                               "worker keeps its own of")
        self.vectorized = True
        return grads, losses.detach()

    def _looped(self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor],
                workers: Sequence[int]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        params = {name: p for name, p in self.model.named_parameters() if p.requires_grad}
        frozen = {name: p.detach() for name, p in self.model.named_parameters() if not p.requires_grad}
        model_buffers = dict(self.model.named_buffers())
        while len(self._buffers) <= max(workers, default=-1):
            self._buffers.append({name: b.clone() for name, b in model_buffers.items()})
        count = len(inputs)
        grads = {name: torch.empty((count, *p.shape), dtype=p.dtype, device=p.device) for name, p in params.items()}
        losses = torch.empty(count)
        function = self._function()
        for i, (x, y, worker) in enumerate(zip(inputs, targets, workers, strict=True)):
            loss = function(params, {**frozen, **self._buffers[worker]}, x, y)
            for (name, _), g in zip(params.items(), torch.autograd.grad(loss, list(params.values())), strict=True):
                grads[name][i].copy_(g)
            losses[i] = loss.detach()
        if model_buffers and self._buffers:
            for name, b in model_buffers.items():  # the model holds worker 0's, as rank 0's model does
                b.copy_(self._buffers[0][name])
        return grads, losses


def _stackable(tensors: Sequence[torch.Tensor]) -> bool:
    return len({(tuple(t.shape), t.dtype) for t in tensors}) == 1
