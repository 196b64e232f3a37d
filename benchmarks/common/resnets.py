"""ResNet-9 and ResNet-18 scaled down for the 8x8 digits, layer for layer.

The rebuttal's tables train ResNet-9 (CIFAR-10) and ResNet-18 (CIFAR-100). These are the same
networks, every layer kept, with every width divided by ``WIDTH_DIVISOR`` (64 -> 8 channels, ...).
A weight tensor's size then shrinks by the divisor squared and a 1-D tensor's (batch norm, bias)
by the divisor, so :func:`scaled_splits` scales the rebuttal's size groups by the same rule and
every layer lands in the group its full-size counterpart is in.

Two changes for 8x8 inputs instead of 32x32: the grey image is repeated on 3 channels (so the
first convolution has CIFAR's 3 input channels and its full-size group), and one downsampling is
dropped (ResNet-9's first pooling, ResNet-18's second stage's stride), so that the last residual
block still sees 2x2 positions and not one, where a 3x3 kernel would use only its centre.
"""

from __future__ import annotations

import bisect

import torch
from torch import nn

WIDTH_DIVISOR = 8
#: The rebuttal's size groups (elements): under 600 uncompressed, under 100k, under 1M, the rest.
PAPER_SPLITS = (600, 100_000, 1_000_000)


def scaled_splits(divisor: int = WIDTH_DIVISOR) -> list[int]:
    """The rebuttal's splits for a network ``divisor`` times narrower: the first (which only 1-D
    tensors fall under) divided by ``divisor``, the others (weights) by ``divisor`` squared."""
    small, *weights = PAPER_SPLITS
    return [round(small / divisor), *(round(w / divisor**2) for w in weights)]


def _conv_bn(cin: int, cout: int, stride: int = 1, kernel: int = 3) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False), nn.BatchNorm2d(cout)]


class _Residual(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(*_conv_bn(channels, channels), nn.ReLU(), *_conv_bn(channels, channels), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class ResNet9(nn.Module):
    """The DAWNBench ResNet-9 (prep, three stages, residual blocks after the first and last)."""

    def __init__(self, classes: int = 10, divisor: int = WIDTH_DIVISOR) -> None:
        super().__init__()
        c = 64 // divisor
        self.net = nn.Sequential(
            *_conv_bn(3, c), nn.ReLU(),
            *_conv_bn(c, 2 * c), nn.ReLU(), _Residual(2 * c),                      # pooling dropped
            *_conv_bn(2 * c, 4 * c), nn.ReLU(), nn.MaxPool2d(2),
            *_conv_bn(4 * c, 8 * c), nn.ReLU(), nn.MaxPool2d(2), _Residual(8 * c),
            nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(8 * c, classes, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.expand(-1, 3, -1, -1)) * 0.125


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(*_conv_bn(cin, cout, stride), nn.ReLU(), *_conv_bn(cout, cout))
        self.shortcut = (nn.Sequential(*_conv_bn(cin, cout, stride, kernel=1)) if stride != 1 or cin != cout
                         else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class ResNet18(nn.Module):
    """The CIFAR ResNet-18 (a 3x3 stem, four stages of two basic blocks, a linear classifier)."""

    def __init__(self, classes: int = 10, divisor: int = WIDTH_DIVISOR) -> None:
        super().__init__()
        c = 64 // divisor
        stages, cin = [], c
        for index, stride in enumerate((1, 1, 2, 2)):                              # stage 2's stride dropped
            cout = c * 2**index
            stages += [_Block(cin, cout, stride), _Block(cout, cout, 1)]
            cin = cout
        self.net = nn.Sequential(*_conv_bn(3, c), nn.ReLU(), *stages, nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                 nn.Linear(cin, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.expand(-1, 3, -1, -1))


def group_sizes(model: nn.Module, splits: list[int]) -> list[tuple[int, int]]:
    """(tensors, elements) of ``model``'s parameters in each size group of ``splits``."""
    groups = [[0, 0] for _ in range(len(splits) + 1)]
    for p in model.parameters():
        group = groups[bisect.bisect_right(splits, p.numel())]
        group[0] += 1
        group[1] += p.numel()
    return [(t, n) for t, n in groups]
