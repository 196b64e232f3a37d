"""The study's three tasks, on data that needs no download.

* ``digits``: a small CNN on scikit-learn's 8x8 digits (1,797 images), test accuracy.
* ``mnist1d``: an MLP on ``mnist1d.make_dataset()`` (4,000 + 1,000 generated 1-D signals; the
  generation takes seconds, so it is cached under ``.cache/``), test accuracy.
* ``charlm``: a character-level LSTM on Python's own standard-library sources, validation
  perplexity (lower is better) on the last 10% of the text.

Each task gives a model builder, its data split by rank, and the parameters the study's schedules use
(the size split between "small" and "large" tensors).
"""

from __future__ import annotations

import os
import pickle
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

CACHE = Path(__file__).resolve().parents[2] / ".cache" / "accuracy"


@dataclass
class Task:
    name: str
    metric: str                 # "accuracy" (higher is better) or "perplexity" (lower is better)
    epochs: int
    batch_size: int             # per worker
    lr: float                   # per worker; scaled by the number of workers for SGD
    optimizer: str              # "sgd" or "adam"
    split: int                  # tensors with fewer elements than this are "small" for LEGACY
    quick_epochs: int = 1
    milestones: tuple[float, ...] = ()  # fractions of the run at which the learning rate drops
    decay: float = 10.0         # ... by this factor each
    weight_decay: float = 0.0
    data: str = ""              # the data set ("digits", "mnist1d", "charlm"); the name if empty


TASKS = {
    "digits": Task("digits", "accuracy", epochs=12, batch_size=32, lr=0.02, optimizer="sgd", split=10_000),
    "mnist1d": Task("mnist1d", "accuracy", epochs=12, batch_size=32, lr=0.02, optimizer="sgd", split=5_000),
    "charlm": Task("charlm", "perplexity", epochs=4, batch_size=16, lr=0.003, optimizer="adam", split=30_000),
}


class DigitsCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
                                      nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class SignalMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(40, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CharLSTM(nn.Module):
    def __init__(self, vocabulary: int, width: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, 64)
        self.lstm = nn.LSTM(64, width, batch_first=True)
        self.out = nn.Linear(width, vocabulary)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.embed(x))
        return self.out(hidden)


STDLIB_FILES = ["textwrap.py", "functools.py", "dataclasses.py", "pathlib.py", "enum.py"]
SEQUENCE = 64


def _cached(name: str, make: Callable[[], dict]) -> dict:
    """``make()``'s arrays, made once per checkout and read from ``.cache/accuracy/<name>`` after:
    a worker then needs neither the generator nor its imports (scikit-learn's alone takes a second)."""
    path = CACHE / name
    if not path.exists():
        data = make()
        CACHE.mkdir(parents=True, exist_ok=True)
        # Every rank of a fresh checkout makes the same data at once: a file of its own, then
        # an atomic rename, so no rank renames a file another has already moved.
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(pickle.dumps(data))
        tmp.replace(path)
    return pickle.loads(path.read_bytes())


def _load_digits() -> dict:
    from sklearn.datasets import load_digits

    digits = load_digits()
    return {"images": digits.images, "target": digits.target}


def _digits():
    digits = _cached("digits.pkl", _load_digits)
    x = torch.tensor(digits["images"], dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits["target"], dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    cut = int(0.8 * len(y))
    return (x[order[:cut]], y[order[:cut]]), (x[order[cut:]], y[order[cut:]])


def _make_mnist1d() -> dict:
    from mnist1d.data import get_dataset_args, make_dataset

    data = make_dataset(get_dataset_args())   # generated locally; get_dataset() would download
    return {k: data[k] for k in ("x", "y", "x_test", "y_test")}


def _mnist1d():
    data = _cached("mnist1d.pkl", _make_mnist1d)

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype)

    return ((tensor(data["x"], torch.float32), tensor(data["y"], torch.long)),
            (tensor(data["x_test"], torch.float32), tensor(data["y_test"], torch.long)))


def _charlm():
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "\n".join((stdlib / name).read_text(encoding="utf-8") for name in STDLIB_FILES)
    vocabulary = sorted(set(text))
    codes = torch.tensor([vocabulary.index(c) for c in text], dtype=torch.long)
    cut = int(0.9 * len(codes))

    def windows(stream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        count = (len(stream) - 1) // SEQUENCE
        x = stream[: count * SEQUENCE].view(count, SEQUENCE)
        y = stream[1: count * SEQUENCE + 1].view(count, SEQUENCE)
        return x, y

    return windows(codes[:cut]), windows(codes[cut:]), len(vocabulary)


def load(task: Task, quick: bool):
    """(model builder, train set, test set), the train set not yet split by rank."""
    data = task.data or task.name
    if data == "digits":
        train, test = _digits()
        build = DigitsCNN
    elif data == "mnist1d":
        train, test = _mnist1d()
        build = SignalMLP
    else:
        train, test, vocabulary = _charlm()
        def build() -> CharLSTM:
            return CharLSTM(vocabulary)
    if quick:  # a fraction of the data: the smoke test checks the pipeline, not the numbers
        train = tuple(t[: max(256, len(t) // 8)] for t in train)
        test = tuple(t[: max(128, len(t) // 4)] for t in test)
    return build, train, test


def evaluate(task: Task, model: nn.Module, test) -> float:
    model.eval()
    x, y = test
    with torch.no_grad():
        if task.metric == "accuracy":
            value = (model(x).argmax(1) == y).float().mean().item()
        else:
            logits = model(x)
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            value = float(torch.exp(loss))
    model.train()
    return value


def loss_of(task: Task, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    if task.metric == "perplexity":
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    return nn.functional.cross_entropy(logits, y)
