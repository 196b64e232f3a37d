"""Two CPU-sized models for timing training steps: a ResNet-like CNN and a transformer-like LM.

Both carry about 11M parameters (44 MB of fp32 gradients, so a dense ring allreduce moves about
66 MB per rank per step among 4 workers: 5 s at 100 Mbit/s) while their compute stays small on a
CPU: the CNN is ResNet-18's layout (stem, four stages of two basic blocks, 64 to 512 channels) on
32 x 32 images downsampled to 8 x 8 by the stem, so its big late layers run on 2 x 2 and 1 x 1
maps; the LM is a pre-norm transformer encoder on short sequences. ``quick`` builds tiny
versions for smoke runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


class BasicBlock(nn.Module):
    def __init__(self, inputs: int, outputs: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.shortcut = nn.Sequential()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNetLike(nn.Module):
    """ResNet-18's stages on small images: ``widths`` channels, two basic blocks per stage."""

    def __init__(self, widths: tuple[int, ...] = (64, 128, 256, 512), classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 2, 1, bias=False), nn.BatchNorm2d(widths[0]),
                                  nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        blocks, inputs = [], widths[0]
        for stage, width in enumerate(widths):
            blocks += [BasicBlock(inputs, width, 1 if stage == 0 else 2), BasicBlock(width, width, 1)]
            inputs = width
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(inputs, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


class DenseHeadCNN(nn.Module):
    """Two small convolutions and a large fully connected layer (``features`` x ``hidden``): a
    model whose gradient is mostly one big matrix, as VGG's or AlexNet's classifiers are."""

    def __init__(self, channels: tuple[int, int] = (32, 64), hidden: int = 512, classes: int = 10) -> None:
        super().__init__()
        first, second = channels
        self.features = nn.Sequential(nn.Conv2d(3, first, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(first, second, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(second * 8 * 8, hidden), nn.ReLU(),
                                  nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class TransformerLike(nn.Module):
    """A pre-norm transformer encoder with causal attention and an untied output head."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        x = self.embed(tokens) + self.position[:length]
        return self.head(self.norm(self.encoder(x, mask=self.causal[:length, :length], is_causal=True)))


@dataclass(frozen=True)
class StepModel:
    """A model, a batch for it and the loss of a training step."""

    name: str
    model: nn.Module
    inputs: torch.Tensor
    targets: torch.Tensor

    def loss(self) -> torch.Tensor:
        out = self.model(self.inputs)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), self.targets.reshape(-1))


def mlp(widths: tuple[int, ...]) -> nn.Sequential:
    """Linear layers of ``widths`` with ReLUs between them: many parameters, little compute."""
    layers: list[nn.Module] = []
    for index, (inputs, outputs) in enumerate(zip(widths, widths[1:], strict=False)):
        layers.append(nn.Linear(inputs, outputs))
        if index < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


MODELS = ("resnet", "transformer", "mlp")


def build(name: str, quick: bool = False, seed: int = 0, data_seed: int = 0) -> StepModel:
    """The model ``name`` with weights from ``seed`` and a fixed synthetic batch from ``data_seed``.

    resnet: 11.2M parameters, 62 tensors, batch 32 of 3 x 32 x 32 images.
    transformer: 10.0M parameters, 126 tensors, 10 layers of width 256, batch 4 x 64 tokens of a
    4096-word vocabulary.
    mlp: 6.3M parameters, 8 tensors, widths 512, 2048, 2048, 512, 10, batch 16: a link-bound step
    (a forward and backward pass of about 0.2 GFLOP).
    """
    torch.manual_seed(seed)
    data = torch.Generator().manual_seed(data_seed)
    if name == "resnet":
        model = ResNetLike((8, 16, 32, 64) if quick else (64, 128, 256, 512))
        batch = 4 if quick else 32
        return StepModel(name, model, torch.randn(batch, 3, 32, 32, generator=data),
                         torch.randint(0, 10, (batch,), generator=data))
    if name == "transformer":
        vocab, width, layers, context, batch = (512, 32, 2, 16, 2) if quick else (4096, 256, 10, 64, 4)
        model = TransformerLike(vocab, width, layers, heads=4, context=context)
        tokens = torch.randint(0, vocab, (batch, context + 1), generator=data)
        return StepModel(name, model, tokens[:, :-1], tokens[:, 1:])
    if name == "mlp":
        widths, batch = ((32, 128, 128, 32, 10), 4) if quick else ((512, 2048, 2048, 512, 10), 16)
        return StepModel(name, mlp(widths), torch.randn(batch, widths[0], generator=data),
                         torch.randint(0, widths[-1], (batch,), generator=data))
    raise ValueError(f"model must be one of {MODELS}, got {name!r}")


def slowest_horovod_step(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor,
                         targets: torch.Tensor) -> float:
    """Seconds of one classification step (``zero_grad``, forward, backward, ``optimizer.step()``)
    behind a ``hvd.DistributedOptimizer``, the slowest rank's: a collective, every rank calls it."""
    import horovod.torch as hvd

    from grace_legacy.backends.horovod import synchronize

    start = time.perf_counter()
    optimizer.zero_grad()
    F.cross_entropy(model(inputs), targets).backward()
    optimizer.step()
    elapsed = torch.tensor([time.perf_counter() - start])
    # Asleep, as grace_legacy waits: a spinning rank would slow the others' next step.
    return synchronize(hvd.allreduce_async(elapsed, name="slowest", op=hvd.Max)).item()
