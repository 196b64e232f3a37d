"""Per-sample second moments of a model's gradients, from hooks on its ``Linear`` and ``Conv2d``
layers, for the variance sparsifier (:mod:`grace_legacy.compressors.variance`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn import functional

from grace_legacy.compressors.kernels.sign_passes import accumulator_dtype

#: The layers whose per-sample gradients the hooks compute.
SUPPORTED = (nn.Linear, nn.Conv2d)


class MomentSource(Protocol):
    """Where a variance sparsifier takes each tensor's per-sample second moment from."""

    def take(self, name: str, gradient: torch.Tensor) -> torch.Tensor:
        """The moment of ``name`` gathered since it was last taken (a tensor of ``gradient``'s
        shape), and forget it."""
        ...

    def clear(self) -> None:
        """Forget every moment not taken (the step is over)."""
        ...


class SampleMoments:
    """For each parameter ``w`` of ``model``'s ``nn.Linear`` and ``nn.Conv2d`` layers, the sum over
    the samples ``z`` of a batch of ``c_z^2``, where ``c_z`` is sample ``z``'s share of ``w``'s
    gradient (so ``sum_z c_z`` is the gradient itself), summed over the backward passes until
    :meth:`take` takes it. For a loss that is the mean over the batch, ``c_z = grad f_z / B`` and
    the moment is Tsuzuku et al.'s ``sum_z (grad f_z)^2 / B^2``; for any loss scaled by ``s`` it
    scales by ``s^2``, as the squared gradient does, so their ratio does not depend on the scale.

    A forward hook on each layer keeps its input ``x`` and puts a hook on its output, which receives
    ``gy``, the gradient with respect to the output, during the backward pass, before the layer's
    parameters get theirs: a linear layer's ``c_z`` for its weight is ``gy_z^T x_z`` (summed over
    any middle dimensions, such as a sequence's positions), a convolution's ``gy_z`` against the
    unfolded patches of ``x_z``; a bias's is ``gy_z`` summed over everything but the channel. With
    a batch of matrices (no middle dimension) the weight's moment is ``(gy^2)^T x^2``, one product;
    otherwise the per-sample gradients are formed (``B`` times a weight's size). Moments are kept in
    float32 for 16-bit layers.

    Every parameter of ``model`` that needs a gradient must belong to such a layer, and each layer
    must run once per forward pass: another parameter (a normalization's, an embedding's, a bare
    ``nn.Parameter``), or a layer applied twice before the backward pass (its per-sample gradient
    is the sum of both uses', which these hooks do not see whole), raises a ``ValueError`` naming
    it. Names are ``model.named_parameters()``'s (the module inside a ``DistributedDataParallel``):
    the names the gradients are sent under. :meth:`remove` takes the hooks off."""

    def __init__(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"SampleMoments: model must be a torch.nn.Module, got {type(model).__name__}")
        model = getattr(model, "module", model) if isinstance(model, nn.parallel.DistributedDataParallel) else model
        self._moments: dict[str, torch.Tensor] = {}
        self._running: set[nn.Module] = set()
        owners: dict[int, list[nn.Module]] = {}
        for module in model.modules():
            for parameter in module.parameters(recurse=False):
                owners.setdefault(id(parameter), []).append(module)
        self._handles = []
        layers: dict[nn.Module, dict[str, str]] = {}
        for name, parameter in model.named_parameters():
            if not parameter.requires_grad:
                continue
            modules = owners[id(parameter)]
            if len(modules) > 1:
                raise ValueError(f"SampleMoments: parameter {name!r} is shared by {len(modules)} modules; its "
                                 f"per-sample gradient sums their shares, which per-layer hooks cannot see")
            module = modules[0]
            if not isinstance(module, SUPPORTED) or not any(parameter is p for p in (module.weight, module.bias)):
                raise ValueError(f"SampleMoments: parameter {name!r} belongs to a {type(module).__name__}; per-sample "
                                 f"moments are computed for the weights and biases of nn.Linear and nn.Conv2d "
                                 f"only (freeze it, requires_grad=False, or use another compressor)")
            role = "weight" if parameter is module.weight else "bias"
            layers.setdefault(module, {})[role] = name
        for module, names in layers.items():
            self._handles.append(module.register_forward_hook(self._forward_hook(names)))

    def _forward_hook(self, names: dict[str, str]) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
            if not (torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad):
                return
            if module in self._running:
                raise ValueError(f"SampleMoments: {type(module).__name__} {sorted(names.values())} ran twice before a "
                                 f"backward pass: its per-sample gradient sums both uses, which per-layer hooks "
                                 f"cannot see (evaluate under torch.no_grad())")
            self._running.add(module)
            x = inputs[0].detach()

            def backward(gy: torch.Tensor) -> None:
                self._running.discard(module)
                for role, moment in _moments(module, x, gy.detach()).items():
                    if role in names:
                        self._add(names[role], moment)

            output.register_hook(backward)
        return hook

    def _add(self, name: str, moment: torch.Tensor) -> None:
        before = self._moments.get(name)
        self._moments[name] = moment if before is None else before + moment

    def take(self, name: str, gradient: torch.Tensor) -> torch.Tensor:
        moment = self._moments.pop(name, None)
        if moment is None:
            raise ValueError(f"SampleMoments: no per-sample moment of {name!r} since it was last taken: no backward "
                             f"pass through its layer, or the gradients are named otherwise than this model's "
                             f"named_parameters() (attach the module the optimizer or DDP names them from)")
        if moment.numel() != gradient.numel():
            raise ValueError(f"SampleMoments: the moment of {name!r} has {moment.numel()} entries, its gradient "
                             f"{gradient.numel()}")
        return moment.to(accumulator_dtype(gradient.dtype)).reshape(gradient.shape)

    def clear(self) -> None:
        self._moments.clear()
        self._running.clear()

    def remove(self) -> None:
        """Take the hooks off the model."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.clear()


def _moments(module: nn.Module, x: torch.Tensor, gy: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{"weight": ..., "bias": ...}``: the sums over the batch of the squared per-sample shares."""
    work = accumulator_dtype(gy.dtype)
    x, gy = x.to(work), gy.to(work)
    if isinstance(module, nn.Conv2d):
        return _conv2d_moments(module, x, gy)
    if x.dim() == 1:  # one unbatched sample
        x, gy = x.unsqueeze(0), gy.unsqueeze(0)
    out: dict[str, torch.Tensor] = {}
    if x.dim() == 2:
        out["weight"] = gy.square().t() @ x.square()
        out["bias"] = gy.square().sum(0)
    else:
        x, gy = x.flatten(1, -2), gy.flatten(1, -2)
        out["weight"] = torch.einsum("bto,bti->boi", gy, x).square().sum(0)
        out["bias"] = gy.sum(1).square().sum(0)
    return out


def _conv2d_moments(conv: nn.Conv2d, x: torch.Tensor, gy: torch.Tensor) -> dict[str, torch.Tensor]:
    if x.dim() == 3:  # one unbatched sample
        x, gy = x.unsqueeze(0), gy.unsqueeze(0)
    padding = conv._reversed_padding_repeated_twice  # what Conv2d pads the input with, left/right, top/bottom
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    x = functional.pad(x, padding, mode=mode)
    patches = functional.unfold(x, conv.kernel_size, dilation=conv.dilation, stride=conv.stride)
    batch, groups = x.shape[0], conv.groups
    patches = patches.view(batch, groups, -1, patches.shape[-1])
    outputs = gy.reshape(batch, groups, -1, patches.shape[-1])
    shares = torch.einsum("bgol,bgil->bgoi", outputs, patches)
    return {"weight": shares.square().sum(0).reshape(conv.weight.shape),
            "bias": gy.sum((2, 3)).square().sum(0)}
