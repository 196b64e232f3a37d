"""``python -m grace_legacy plan``: what a compressor or LEGACY schedule will put on the links, before
training.

    python -m grace_legacy plan --model torchvision:resnet50 --compressor topk \\
        --by both --group-compressions "10,1;1,0.1" --group-splits 100000 --epochs 90 --workers 4
    python -m grace_legacy plan --sizes 600,20,100,5 --compressor topk --budget 1 \\
        --by layer --group-splits 50 --layer-factors 10,1
    python -m grace_legacy plan --model torchvision:resnet50 --compressor qsgd --workers 64 \\
        --bandwidth 10Gbit --latency 20us --plot plan.png

It prints the wire volume (link bytes against a dense ring allreduce's, ``stats["volume"]``) at
4 to 1024 workers, each route alone, the default bundle's choice (the route of the compressor's own
aggregation) and ``communicator="auto"``'s (the fewest link bytes) side by side; with ``--bandwidth`` (and
``--latency``) an alpha-beta estimate of the communication time per step of each route at
``--workers`` (see ``grace_legacy.planner``), and with ``--compute`` (a measured compute time) of
each route's step; then, at ``--workers`` (default 4), one row per phase
and size group with the routes the bundle takes and its link bytes per step, and the last line
``expected volume X%``: the wire volume over the run. ``--plot FILE.png`` draws the wire volume
against the number of workers.

The schedule is given either in the LEGACY reference flags (``--by``, ``--group-compressions``,
``--group-splits``, ``--epochs``) or as a budget: ``--budget V`` (a uniform parameter value, in the
units of ``--group-compressions``) with a shape (``--layer-factors``, ``--phase-factors``), scaled
by ``Legacy.budget_matched`` to send as many bytes as the uniform value would. Neither: the
compressor at GRACE's default for its parameter (``grace_from_params``'s).

A malformed value (an empty item, a negative or zero size, a NaN) and a flag the mode does not use
are refused as argparse refuses a bad value: a usage error, exit status 2, naming the flag.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path

import torch

from grace_legacy.core.compressor import Compressor
from grace_legacy.helper import COMPRESSORS, DEFAULTS
from grace_legacy.planner import (
    DEFAULT_WORKERS,
    WORKER_COUNTS,
    format_link_times,
    format_plan,
    format_scaling,
    model_shapes,
    plan,
    plot_scaling,
    scaling,
)
from grace_legacy.runtime.validation import MAX_NUMEL
from grace_legacy.schedules.legacy import Legacy

# -- what each flag accepts, checked as argparse reads it (a bad value: usage error, status 2) --------


def _items(text: str, what: str, sep: str = ",") -> list[str]:
    """The ``sep``-separated items of ``text``, each stripped; an empty one ("1,,2", a trailing
    comma, a blank value) is refused rather than skipped."""
    items = [t.strip() for t in text.split(sep)]
    if not all(items):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r} (an empty item)")
    return items


_LARGEST = "2**63 - 1"  # MAX_NUMEL, as a reader takes it in


def _integer(token: str, what: str, text: str, low: int, high: int) -> int:
    try:
        value = int(token)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r} ({token!r} is not an integer)") from None
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r} ({token} is out of range)")
    return value


def _positive_int(text: str) -> int:
    return _integer(text.strip(), f"an integer in [1, {_LARGEST}]", text, 1, MAX_NUMEL)


def _sizes(text: str) -> list[int]:
    what = f"comma-separated tensor sizes in elements, integers in [1, {_LARGEST}]"
    return [_integer(t, what, text, 1, MAX_NUMEL) for t in _items(text, what)]


def _splits(text: str) -> list[int]:
    if not text.strip():
        return []
    what = f"comma-separated, strictly increasing integers in [1, {_LARGEST}] (elements)"
    splits = [_integer(t, what, text, 1, MAX_NUMEL) for t in _items(text, what)]
    if any(b <= a for a, b in zip(splits, splits[1:], strict=False)):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r} (not increasing)")
    return splits


def _finite_positive(token: str, what: str, text: str) -> float:
    try:
        value = float(token)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r} ({token!r} is not a number)") from None
    if not math.isfinite(value) or not value > 0:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def _budget(text: str) -> float:
    return _finite_positive(text.strip(), "a finite number > 0", text)


def _factors(text: str) -> list[float]:
    what = "comma-separated finite numbers > 0"
    return [_finite_positive(t, what, text) for t in _items(text, what)]


def _group_compressions(text: str) -> str:
    """The flag as given, once each value reads as a finite number or ``none``; the compressor's
    range is checked when the schedule is built."""
    what = "parameter values ('none' or a finite number) separated by ',', phases separated by ';'"
    for row in _items(text, what, ";"):
        for token in _items(row, what):
            if token.lower() in ("none", "dense"):
                continue
            try:
                finite = math.isfinite(float(Fraction(token)))
            except (ValueError, ZeroDivisionError, OverflowError):
                finite = False
            if not finite:
                raise argparse.ArgumentTypeError(f"must be {what}, got {text!r} ({token!r} is not a finite number)")
    return text


_PREFIXES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BANDWIDTH = re.compile(r"(?P<number>[0-9.]+(?:[eE][-+]?[0-9]+)?)\s*(?P<prefix>[kKmMgGtT]?)"
                        r"(?P<unit>bit|b|B|bps|Bps|)(?:/s)?")
_DURATION = re.compile(r"(?P<number>[0-9.]+(?:[eE][-+]?[0-9]+)?)\s*(?P<unit>s|ms|us|ns|)")
_SECONDS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def _bandwidth(text: str) -> float:
    """Bytes per second of each rank's link: a number with an optional decimal prefix (k, M, G, T)
    and unit: ``bit``, ``b`` or ``bps`` for bits, ``B`` or ``Bps`` (or none) for bytes, an optional
    ``/s``: ``100Mbit``, ``10Gbit/s``, ``1.25GB``, ``1e9``."""
    what = ("a bandwidth > 0: a number with an optional prefix k, M, G, T and unit bit (or b, bps) or B "
            "(bytes, the default), e.g. 100Mbit, 10Gbit/s, 1.25GB")
    match = _BANDWIDTH.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    value = _finite_positive(match["number"], what, text)
    per_second = value * _PREFIXES[match["prefix"].lower()] / (8 if match["unit"] in ("bit", "b", "bps") else 1)
    if not math.isfinite(per_second):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r} (out of range)")
    return per_second


def _latency(text: str) -> float:
    """Seconds per step of a collective: a number >= 0 with an optional unit s, ms, us, ns."""
    return _seconds(text, "a latency >= 0 in seconds per collective step, with an optional unit s, ms, us or ns "
                          "(e.g. 20us)")


def _compute(text: str) -> float:
    """A step's measured compute time: a number >= 0 with an optional unit s, ms, us, ns."""
    return _seconds(text, "a time >= 0 in seconds, with an optional unit s, ms, us or ns (e.g. 20ms)")


def _seconds(text: str, what: str) -> float:
    match = _DURATION.fullmatch(text.strip())
    try:
        value = float(match["number"]) if match else math.nan
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value * _SECONDS[match["unit"]]


def _bucket_bytes(text: str) -> int:
    return _integer(text.strip(), f"an integer in [0, {_LARGEST}] (bytes; 0: no fusion)", text, 0, MAX_NUMEL)


def _plot(text: str) -> str:
    path = Path(text)
    if path.suffix.lower() != ".png":
        raise argparse.ArgumentTypeError(f"must be a file name ending in .png, got {text!r}")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"must be in an existing directory, got {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m grace_legacy", description="grace-legacy tools")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("plan", help="bytes per step and expected volume of a compression set-up",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--sizes", type=_sizes,
                        help="tensor sizes in elements, comma-separated positive integers (e.g. 600,20,100,5)")
    source.add_argument("--model", help="torchvision:NAME (e.g. torchvision:resnet50) or package.module:function "
                                        "returning an nn.Module")
    p.add_argument("--compressor", default="topk", choices=list(COMPRESSORS),
                   help="a compressor name as grace_from_params takes it (default: topk)")
    p.add_argument("--by", choices=["uniform", *Legacy.MODES],
                   help="LEGACY mode (reference flag legacy_by; default layer); needs --group-compressions or --budget")
    p.add_argument("--group-compressions", type=_group_compressions,
                   help="parameter values per size group, ';' between phases; a density in percent (reference flag)")
    p.add_argument("--group-splits", type=_splits, default=[],
                   help="size-group thresholds in elements, comma-separated, increasing")
    p.add_argument("--epochs", type=_positive_int, help="training epochs (phases are equal shares of them)")
    p.add_argument("--budget", type=_budget,
                   help="match the bytes of this uniform parameter value (a density in percent)")
    p.add_argument("--layer-factors", type=_factors,
                   help="with --budget: relative parameter per size group, comma-separated, > 0")
    p.add_argument("--phase-factors", type=_factors,
                   help="with --budget: relative parameter per phase, comma-separated, > 0")
    p.add_argument("--workers", type=_positive_int,
                   help=f"number of ranks the table and the expected volume are for (default {DEFAULT_WORKERS})")
    p.add_argument("--bucket-bytes", type=_bucket_bytes,
                   help="fused buckets of up to this many dense bytes (default: the bundle's, HOROVOD_FUSION_THRESHOLD "
                        "as Horovod reads it, at most 16 MiB; 0: every tensor alone)")
    p.add_argument("--bandwidth", type=_bandwidth,
                   help="each rank's link bandwidth, e.g. 100Mbit, 10Gbit/s, 1.25GB (B: bytes, bit: bits, per "
                        "second; no unit: bytes): print an alpha-beta estimate of each route's link time per step")
    p.add_argument("--latency", type=_latency,
                   help="with --bandwidth: seconds per step of a collective (a ring allreduce takes 2(P-1) steps, "
                        "an allgather or all-to-all P-1), e.g. 20us (default 0)")
    p.add_argument("--compute", type=_compute,
                   help="with --bandwidth: a step's measured compute time (forward, backward, optimizer and "
                        "compression: a step timed where the link is no limit), e.g. 20ms: print each route's "
                        "estimated step, this time then the link time")
    p.add_argument("--communicator", choices=["default", "auto"], default="default",
                   help="the bundle the detailed table is for: 'default' (Grace's default: the route of the "
                        "compressor's own aggregation per tensor) or 'auto' (Grace(communicator='auto'): the fewest "
                        "link bytes, two-phase included); the tables above show both")
    p.add_argument("--plot", metavar="FILE.png", type=_plot,
                   help="also draw the wire volume against the number of workers, per route")
    return parser


def _check_shape(args: argparse.Namespace, parser: argparse.ArgumentParser, by: str) -> None:
    """Refuse flags the mode does not use, and counts that do not fit the size groups, naming the
    flags: the library would report them in its own argument names."""
    groups = len(args.group_splits) + 1
    by_layer, by_phase = by in ("layer", "both"), by in ("epoch", "both")
    if by == "uniform" or not by_layer:
        for flag, value in (("--group-splits", args.group_splits), ("--layer-factors", args.layer_factors)):
            if value:
                parser.error(f"{flag} is not used with --by {by} (size groups are for --by layer or both)")
    if not by_phase:
        for flag, value in (("--epochs", args.epochs), ("--phase-factors", args.phase_factors)):
            if value is not None:
                parser.error(f"{flag} is not used with --by {by} (phases are for --by epoch or both)")
    elif args.epochs is None:
        parser.error(f"--by {by} needs --epochs (phases are equal shares of them)")
    if args.group_compressions is not None:
        rows = [row.split(",") for row in args.group_compressions.split(";")]
        if len(rows) > 1 and by != "both":
            parser.error(f"--group-compressions: ';' separates phases, only with --by both; got "
                         f"{args.group_compressions!r} with --by {by}")
        splits = ",".join(map(str, args.group_splits))
        for row in rows:
            if by == "uniform" and len(row) != 1:
                parser.error(f"--group-compressions {args.group_compressions!r}: --by uniform takes one value")
            if by_layer and len(row) != groups:
                parser.error(f"--group-compressions {args.group_compressions!r}: each phase needs {groups} "
                             f"value(s), one per size group of --group-splits {splits!r}")
    if args.layer_factors is not None and len(args.layer_factors) != groups:
        parser.error(f"--layer-factors needs {groups} value(s), one per size group of --group-splits "
                     f"{','.join(map(str, args.group_splits))!r}; got {len(args.layer_factors)}")


def build_compression(args: argparse.Namespace, parser: argparse.ArgumentParser,
                      shapes: Sequence) -> Compressor:
    """The compressor or schedule the flags describe."""
    scheduled = args.group_compressions is not None or args.budget is not None
    base = COMPRESSORS[args.compressor](DEFAULTS, not scheduled)
    if args.group_compressions is not None and args.budget is not None:
        parser.error("give either --group-compressions (a schedule) or --budget (a budget to match), not both")
    if not scheduled:
        for flag, value in (("--by", args.by), ("--epochs", args.epochs), ("--layer-factors", args.layer_factors),
                            ("--phase-factors", args.phase_factors), ("--group-splits", args.group_splits or None)):
            if value is not None:
                parser.error(f"{flag} describes a LEGACY schedule: give --group-compressions or --budget too")
        return base
    if base.parameter is None:
        parser.error(f"--compressor {args.compressor} has no parameter to schedule; use one of "
                     f"{', '.join(n for n, b in COMPRESSORS.items() if b(DEFAULTS, False).parameter)}")
    by = args.by or "layer"
    if args.group_compressions is not None and (args.layer_factors or args.phase_factors):
        parser.error("--layer-factors/--phase-factors shape a --budget; with --group-compressions give values")
    if args.budget is not None and by == "uniform":
        parser.error("--budget needs --by layer, epoch or both (a uniform schedule is the budget itself)")
    _check_shape(args, parser, by)
    # What is left for the library to refuse is a value out of the compressor's range.
    if args.group_compressions is not None:
        try:
            return Legacy.from_flags(base, by, group_compressions=args.group_compressions,
                                       group_splits=",".join(map(str, args.group_splits)), epochs=args.epochs)
        except ValueError as err:
            parser.error(f"--group-compressions {args.group_compressions!r} (--compressor {args.compressor}): {err}")
    target = args.budget / 100 if base.parameter.name == "ratio" else args.budget
    try:
        return Legacy.budget_matched(
            base, target, by=by, sizes=[s.numel() for s in shapes], splits=args.group_splits or None,
            layer_factors=args.layer_factors, phase_factors=args.phase_factors, epochs=args.epochs,
            world_size=args.workers or DEFAULT_WORKERS, communicator="auto" if args.communicator == "auto" else None)
    except ValueError as err:
        parser.error(f"--budget {args.budget:g} (--compressor {args.compressor}): {err}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.sizes is not None:
        shapes = [torch.Size([n]) for n in args.sizes]
    else:
        try:
            shapes = [shape for _, shape in model_shapes(args.model)]
        except (ValueError, TypeError, ImportError) as err:
            parser.error(f"--model {args.model!r}: {err}")
        if not any(shape.numel() for shape in shapes):
            parser.error(f"--model {args.model!r}: the model has no trainable parameter with elements")
    if args.latency is not None and args.bandwidth is None:
        parser.error("--latency needs --bandwidth (the link time is latency x steps + link bytes / bandwidth)")
    if args.compute is not None and args.bandwidth is None:
        parser.error("--compute needs --bandwidth (the step is the compute time then the link time)")
    compression = build_compression(args, parser, shapes)
    workers = args.workers or DEFAULT_WORKERS
    options = {} if args.bucket_bytes is None else {"bucket_bytes": args.bucket_bytes}
    try:
        result = plan(compression, shapes, world_size=workers,
                      route="auto" if args.communicator == "auto" else None, **options)
        table = scaling(compression, shapes, sorted({*WORKER_COUNTS, workers}), **options)
    except NotImplementedError as err:  # a payload whose size only the data decides (Threshold)
        parser.error(f"--compressor {args.compressor}: its bytes cannot be planned ({err})")
    print(f"{compression!r} on {workers} workers" + ("" if args.workers else " (the default; --workers N)")
          + (f", fused buckets of up to {result.bucket_bytes:,} bytes" if result.bucket_bytes
             else ", no fused buckets"))
    if isinstance(compression, Legacy):
        flags = compression.to_flags()
        print("reference flags: " + " ".join(f"--{k.replace('_', '-')} {v!r}" if isinstance(v, str) else
                                             f"--{k.replace('_', '-')} {v}" for k, v in flags.items()))
    if args.plot:
        counts = sorted({*(2 ** k for k in range(1, 11)), workers})
        plot_scaling(scaling(compression, shapes, counts, **options), args.plot,
                     title=f"{compression!r}"[:90] + f", {args.model or f'{len(shapes)} tensors'}", mark=workers)
        print(f"plot: {args.plot}")
    print("wire volume by workers (each route alone; the default bundle's choice, the route of the compressor's "
          "own aggregation; and communicator='auto', the fewest link bytes):")
    print(format_scaling(table))
    if args.bandwidth is not None:
        row = next(r for r in table if r.world_size == workers)
        routes = {"dense": plan(compression, shapes, world_size=workers, route="dense", **options),
                  **row.forced, "default": row.chosen, "auto": row.auto}
        print(format_link_times(routes, args.bandwidth, args.latency or 0.0, args.compute))
    print(f"the {'default' if args.communicator == 'default' else 'auto'} bundle at {workers} workers "
          f"(--communicator {'auto' if args.communicator == 'default' else 'default'} for the other):")
    print(format_plan(result))
    return 0

if __name__ == "__main__":
    sys.exit(main())
