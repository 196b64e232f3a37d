"""ResNet-9 and ResNet-18 scaled down, layer for layer, for the 8x8 digits (2-D) and mnist1d (1-D).

The rebuttal's tables train ResNet-9 (CIFAR-10) and ResNet-18 (CIFAR-100). These are the same
networks, every layer kept, with every width divided by a ``divisor`` (64 -> 8 channels at 8, ...).

* ``dims=2`` (the digits): a weight tensor shrinks by the divisor squared and a 1-D tensor (batch
  norm, bias) by the divisor, so :func:`scaled_splits` scales the rebuttal's size groups by that
  rule. For 8x8 inputs instead of 32x32, one downsampling is dropped (ResNet-9's first pooling,
  ResNet-18's second stage's stride), so that the last residual block still sees 2x2 positions
  and not one, where a 3x3 kernel would use only its centre.
* ``dims=1`` (mnist1d's 40-sample signals): every convolution is 1-D with kernels of 3 (1 for the
  shortcuts), every downsampling kept (40 -> 20 -> 10 -> 5 positions in both). A 3-kernel weight
  shrinks by ``3 * divisor**2``, a shortcut's by ``divisor**2``, the classifier by less (CIFAR-100's
  100 classes against 10), so no single factor maps the rebuttal's splits; :func:`counterpart_splits`
  derives them from the full-size 2-D network instead, and refuses when no splits can put every
  layer in its counterpart's group.

Either way the input is repeated on 3 channels, so the first convolution has CIFAR's 3 input
channels (and its full-size group).
"""

from __future__ import annotations

import bisect

import torch
from torch import nn

WIDTH_DIVISOR = 8
#: The rebuttal's size groups (elements): under 600 uncompressed, under 100k, under 1M, the rest.
PAPER_SPLITS = (600, 100_000, 1_000_000)
#: The classes of the rebuttal's data sets, for the full-size counterparts.
PAPER_CLASSES = {"ResNet9": 10, "ResNet18": 100}


def scaled_splits(divisor: int = WIDTH_DIVISOR) -> list[int]:
    """The rebuttal's splits for a 2-D network ``divisor`` times narrower: the first (which only
    1-D tensors fall under) divided by ``divisor``, the others (weights) by ``divisor`` squared."""
    small, *weights = PAPER_SPLITS
    return [round(small / divisor), *(round(w / divisor**2) for w in weights)]


def _layers(dims: int) -> tuple[type[nn.Module], type[nn.Module], type[nn.Module], type[nn.Module]]:
    if dims == 2:
        return nn.Conv2d, nn.BatchNorm2d, nn.MaxPool2d, nn.AdaptiveMaxPool2d
    if dims == 1:
        return nn.Conv1d, nn.BatchNorm1d, nn.MaxPool1d, nn.AdaptiveMaxPool1d
    raise ValueError(f"dims must be 1 or 2, got {dims!r}")


def _conv_bn(cin: int, cout: int, stride: int = 1, kernel: int = 3, dims: int = 2) -> list[nn.Module]:
    conv, norm, _, _ = _layers(dims)
    return [conv(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False), norm(cout)]


def _three_channels(x: torch.Tensor, dims: int) -> torch.Tensor:
    """A batch of one-channel inputs (``dims=1`` also takes ``(N, L)``) repeated on 3 channels."""
    if dims == 1 and x.dim() == 2:
        x = x.unsqueeze(1)
    return x.expand(-1, 3, *x.shape[2:])


class _Residual(nn.Module):
    def __init__(self, channels: int, dims: int = 2) -> None:
        super().__init__()
        self.body = nn.Sequential(*_conv_bn(channels, channels, dims=dims), nn.ReLU(),
                                  *_conv_bn(channels, channels, dims=dims), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class ResNet9(nn.Module):
    """The DAWNBench ResNet-9 (prep, three stages, residual blocks after the first and last)."""

    def __init__(self, classes: int = 10, divisor: int = WIDTH_DIVISOR, dims: int = 2) -> None:
        super().__init__()
        c = 64 // divisor
        _, _, pool, global_pool = _layers(dims)
        first_pool = [pool(2)] if dims == 1 else []                                 # dropped for 8x8
        self.dims = dims
        self.net = nn.Sequential(
            *_conv_bn(3, c, dims=dims), nn.ReLU(),
            *_conv_bn(c, 2 * c, dims=dims), nn.ReLU(), *first_pool, _Residual(2 * c, dims),
            *_conv_bn(2 * c, 4 * c, dims=dims), nn.ReLU(), pool(2),
            *_conv_bn(4 * c, 8 * c, dims=dims), nn.ReLU(), pool(2), _Residual(8 * c, dims),
            global_pool(1), nn.Flatten(), nn.Linear(8 * c, classes, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(_three_channels(x, self.dims)) * 0.125


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, dims: int = 2) -> None:
        super().__init__()
        self.body = nn.Sequential(*_conv_bn(cin, cout, stride, dims=dims), nn.ReLU(),
                                  *_conv_bn(cout, cout, dims=dims))
        self.shortcut = (nn.Sequential(*_conv_bn(cin, cout, stride, kernel=1, dims=dims))
                         if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class ResNet18(nn.Module):
    """The CIFAR ResNet-18 (a 3x3 stem, four stages of two basic blocks, a linear classifier)."""

    def __init__(self, classes: int = 10, divisor: int = WIDTH_DIVISOR, dims: int = 2) -> None:
        super().__init__()
        c = 64 // divisor
        pool = nn.AdaptiveAvgPool2d if dims == 2 else nn.AdaptiveAvgPool1d
        strides = (1, 1, 2, 2) if dims == 2 else (1, 2, 2, 2)                      # 8x8: stage 2's dropped
        stages, cin = [], c
        for index, stride in enumerate(strides):
            cout = c * 2**index
            stages += [_Block(cin, cout, stride, dims), _Block(cout, cout, 1, dims)]
            cin = cout
        self.dims = dims
        self.net = nn.Sequential(*_conv_bn(3, c, dims=dims), nn.ReLU(), *stages, pool(1), nn.Flatten(),
                                 nn.Linear(cin, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(_three_channels(x, self.dims))


def full_size(model: ResNet9 | ResNet18) -> nn.Module:
    """The rebuttal's network that ``model`` narrows: 2-D, full width, its data set's classes."""
    kind = type(model)
    return kind(classes=PAPER_CLASSES[kind.__name__], divisor=1, dims=2)


def paper_groups(model: ResNet9 | ResNet18) -> list[int]:
    """The rebuttal's size group (by :data:`PAPER_SPLITS`) of each parameter's full-size counterpart."""
    full = [p.numel() for p in full_size(model).parameters()]
    narrow = list(model.parameters())
    if len(full) != len(narrow):
        raise ValueError(f"{type(model).__name__}: {len(narrow)} parameters, its full-size counterpart {len(full)}")
    return [bisect.bisect_right(PAPER_SPLITS, n) for n in full]


def counterpart_splits(model: ResNet9 | ResNet18) -> list[int]:
    """Size splits that put every parameter of ``model`` in its full-size counterpart's group: split
    ``k`` is the smallest tensor whose counterpart is in group ``k`` or above (so a tensor is in
    group ``k`` exactly when its counterpart is). A ValueError if a tensor of a lower group is as
    large as one of a higher group (no splits could separate them)."""
    sizes, groups = [p.numel() for p in model.parameters()], paper_groups(model)
    splits = []
    for k in range(1, len(PAPER_SPLITS) + 1):
        below = [n for n, g in zip(sizes, groups, strict=True) if g < k]
        above = [n for n, g in zip(sizes, groups, strict=True) if g >= k]
        if not above:
            raise ValueError(f"{type(model).__name__}: no parameter's counterpart reaches group {k}")
        if below and max(below) >= min(above):
            raise ValueError(f"{type(model).__name__}: a tensor of {max(below):,} elements is below group {k} "
                             f"and one of {min(above):,} in it; no split separates them")
        splits.append(min(above))
    return splits


def group_sizes(model: nn.Module, splits: list[int]) -> list[tuple[int, int]]:
    """(tensors, elements) of ``model``'s parameters in each size group of ``splits``."""
    groups = [[0, 0] for _ in range(len(splits) + 1)]
    for p in model.parameters():
        group = groups[bisect.bisect_right(splits, p.numel())]
        group[0] += 1
        group[1] += p.numel()
    return [(t, n) for t, n in groups]
