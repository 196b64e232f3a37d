"""What a compression set-up will send, before training: per phase and size group, the tensors, their
elements, the parameter value and the bytes per step against dense, and the volume over the run. The
bytes are :func:`grace_legacy.runtime.cost.bytes_sent`'s, exact, so the planned volume is what
``compression.stats["volume"]`` reports after the run (every tensor sent once per step)."""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
from torch import nn

from grace_legacy.core.compressor import Compressor
from grace_legacy.runtime.cost import bytes_sent
from grace_legacy.runtime.validation import ArgumentTypeError, check_gradient_dtype, check_positive_int, checked_shapes
from grace_legacy.schedules.legacy import Legacy


@dataclass(frozen=True)
class Cell:
    """One phase x size group: what its tensors send per step."""

    phase: int
    group: int
    tensors: int
    elements: int
    parameter: Any
    bytes_sent: int
    bytes_dense: int
    #: Tensors the dense fallback sends dense although the parameter compresses them.
    fallback: int = 0

    @property
    def volume(self) -> float:
        return self.bytes_sent / self.bytes_dense if self.bytes_dense else 0.0


@dataclass(frozen=True)
class Plan:
    """Every cell of a set-up, the phases' shares of the run, and the run's expected volume."""

    cells: list[Cell]
    phase_weights: list[float]
    group_labels: list[str]
    phase_labels: list[str]
    knob_name: str

    def phase_totals(self, phase: int) -> tuple[int, int]:
        """(bytes sent, dense bytes) per step in ``phase``."""
        cells = [c for c in self.cells if c.phase == phase]
        return sum(c.bytes_sent for c in cells), sum(c.bytes_dense for c in cells)

    @property
    def volume(self) -> float:
        """Bytes over the run against dense: each phase's bytes per step weighted by its share."""
        sent = sum(w * self.phase_totals(p)[0] for p, w in enumerate(self.phase_weights))
        dense = self.phase_totals(0)[1]
        return sent / dense if dense else 0.0


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


def _group_labels(splits: Sequence[int]) -> list[str]:
    if not splits:
        return ["all"]
    edges = [None, *splits, None]
    return [f"< {hi:,}" if lo is None else (f">= {lo:,}" if hi is None else f"{lo:,} - {hi - 1:,}")
            for lo, hi in zip(edges, edges[1:], strict=False)]


def _phase_labels(schedule: Legacy | None) -> list[str]:
    if schedule is None or schedule.phases == 1:
        return ["all"]
    if schedule.boundaries is not None:
        edges: list[Any] = [0, *schedule.boundaries, schedule.epochs]
    else:
        edges = [Fraction(schedule.epochs * p, schedule.phases) for p in range(schedule.phases + 1)]

    def show(e: Any) -> str:
        if e is None:
            return "end"
        try:
            return f"{float(e):g}"
        except OverflowError:  # an epoch count beyond a float's range: its leading digits
            digits = str(round(e))
            return f"{digits[0]}.{digits[1:4]}e+{len(digits) - 1}"
    return [f"epochs {show(a)} - {show(b)}" for a, b in zip(edges, edges[1:], strict=False)]


def plan(compression: Compressor, shapes: Iterable[Any], *, world_size: int | None = None,
         dtype: torch.dtype = torch.float32) -> Plan:
    """The plan of ``compression`` (a compressor with its parameter, or a :class:`Legacy` schedule)
    over tensors ``shapes`` (element counts, shapes, or (name, shape or tensor) pairs such as
    ``model.named_parameters()``). ``world_size``
    counts what the dense fallback would send dense as dense (leave ``None`` to ignore it)."""
    if not isinstance(compression, Compressor):
        raise ArgumentTypeError(f"plan: compression must be a grace_legacy compressor or Legacy schedule, got "
                                f"{type(compression).__name__}")
    if world_size is not None:
        world_size = check_positive_int(world_size, "world_size", "plan")
    dtype = check_gradient_dtype(dtype, "dtype", "plan")
    sizes = [s for s in checked_shapes(shapes, "shapes", "plan") if s.numel()]  # empty tensors send nothing
    if not sizes:
        raise ValueError("plan: no tensor with elements to plan for")
    schedule = compression if isinstance(compression, Legacy) else None
    if schedule is None:
        compression.check_ready()
    parameter = compression.parameter if schedule is None else schedule.base.parameter
    element = torch.empty((), dtype=dtype).element_size()
    groups = len(schedule.splits) + 1 if schedule else 1
    phases = schedule.phases if schedule else 1
    cells = []
    for phase in range(phases):
        for group in range(groups):
            members = [s for s in sizes if (schedule.group_of(s.numel()) if schedule else 0) == group]
            if schedule is not None:
                value = schedule.table[phase][group]
                concrete = schedule.configured(value)
            else:
                value = compression.value if parameter else None
                concrete = None if parameter is not None and parameter.is_dense(value) else compression
            sent = [bytes_sent(concrete, s, dtype, world_size) for s in members]
            fallback = 0 if concrete is None or world_size is None else sum(
                b != bytes_sent(concrete, s, dtype) for b, s in zip(sent, members, strict=True))
            cells.append(Cell(phase, group, len(members), sum(s.numel() for s in members), value, sum(sent),
                              sum(s.numel() * element for s in members), fallback))
    return Plan(cells, schedule.phase_weights() if schedule else [1.0],
                _group_labels(schedule.splits if schedule else []), _phase_labels(schedule),
                parameter.name if parameter else "-")


def _show_knob(cell: Cell, knob_name: str) -> str:
    value = cell.parameter
    if value is None:
        return "dense"
    text = f"{value:.4g} ({value * 100:.4g}%)" if knob_name == "ratio" else f"{value:g}"
    return text + ("*" if cell.fallback else "")


def _bytes(n: float) -> str:
    return f"{round(n):,}"


def format_plan(result: Plan) -> str:
    """The table, one row per phase and size group, a total per phase, and the last line
    ``expected volume X%``."""
    header = (f"{'phase':<18} {'size group':<22} {'tensors':>7} {'elements':>12} {result.knob_name:>20} "
              f"{'bytes/step':>14} {'dense bytes':>14} {'volume':>8}")
    lines = [header, "-" * len(header)]
    for phase, label in enumerate(result.phase_labels):
        for cell in (c for c in result.cells if c.phase == phase):
            lines.append(f"{label:<18} {result.group_labels[cell.group]:<22} {cell.tensors:>7} "
                         f"{cell.elements:>12,} {_show_knob(cell, result.knob_name):>20} "
                         f"{_bytes(cell.bytes_sent):>14} {_bytes(cell.bytes_dense):>14} {cell.volume:>8.2%}")
        sent, dense = result.phase_totals(phase)
        share = result.phase_weights[phase]
        lines.append(f"{label:<18} {'all (' + format(share, '.0%') + ' of run)':<22} "
                     f"{sum(c.tensors for c in result.cells if c.phase == phase):>7} "
                     f"{sum(c.elements for c in result.cells if c.phase == phase):>12,} {'':>20} "
                     f"{_bytes(sent):>14} {_bytes(dense):>14} {sent / dense if dense else 0:>8.2%}")
    if any(c.fallback for c in result.cells):
        lines.append("* sent dense by the dense fallback: gathering such a payload from every rank would move more "
                     "bytes than a ring allreduce of the dense tensor")
    lines.append(f"expected volume {result.volume:.2%}")
    return "\n".join(lines)


def plot_plan(result: Plan, path: str) -> None:
    """Bytes per step of each size group, one bar per phase, beside the dense bytes; saved as PNG."""
    import matplotlib  # an optional dependency (the `examples` extra), needed only for --plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = len(result.group_labels)
    phases = len(result.phase_labels)
    width = 0.8 / (phases + 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * groups + 2), 4))
    dense = [next(c.bytes_dense for c in result.cells if c.group == g) / 1e6 for g in range(groups)]
    ax.bar([g - 0.4 + width / 2 for g in range(groups)], dense, width, label="dense", color="lightgray")
    for phase, label in enumerate(result.phase_labels):
        sent = [c.bytes_sent / 1e6 for c in result.cells if c.phase == phase]
        ax.bar([g - 0.4 + width * (phase + 1.5) for g in range(groups)], sent, width,
               label=label if phases > 1 else "compressed")
    ax.set_xticks(range(groups), [f"{label}\n({sum(c.tensors for c in result.cells if c.group == g and c.phase == 0)}"
                                  f" tensors)" for g, label in enumerate(result.group_labels)])
    ax.set_xlabel("size group (elements)")
    ax.set_ylabel("MB per step per rank")
    ax.set_yscale("log")
    ax.set_title(f"expected volume {result.volume:.2%}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
