"""The model a plan is made for, named on the command line: its trainable parameters' shapes, built
on the meta device (no memory, no initialisation)."""

from __future__ import annotations

import importlib

import torch
from torch import nn

from grace_legacy.runtime.validation import ArgumentTypeError


def model_shapes(spec: str) -> list[tuple[str, torch.Size]]:
    """The trainable parameters' names and shapes of the model ``spec`` names:
    ``torchvision:resnet50`` (a constructor of ``torchvision.models``) or ``package.module:function``
    (any function of no arguments that returns an ``nn.Module``)."""
    if not isinstance(spec, str):
        raise ArgumentTypeError(f"model must be a string 'torchvision:NAME' or 'package.module:function', got "
                                f"{spec!r} of type {type(spec).__name__}")
    module_name, _, function_name = spec.partition(":")
    if not module_name or not function_name:
        raise ValueError(f"model must be 'torchvision:NAME' or 'package.module:function', got {spec!r}")
    if module_name == "torchvision":
        module_name = "torchvision.models"
    module = importlib.import_module(module_name)
    build = getattr(module, function_name, None)
    if not callable(build):
        raise ValueError(f"model {spec!r}: {module_name} has no function {function_name!r}")
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        model = build()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model {spec!r}: {function_name}() returned {type(model).__name__}, not an nn.Module")
    return [(name, p.shape) for name, p in model.named_parameters() if p.requires_grad]
