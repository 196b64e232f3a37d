"""``python -m grace_legacy plan``: what a compressor or LEGACY schedule will send, before training.

    python -m grace_legacy plan --model torchvision:resnet50 --compressor topk \\
        --by both --group-compressions "10,1;1,0.1" --group-splits 100000 --epochs 90 --workers 4
    python -m grace_legacy plan --sizes 600,20,100,5 --compressor topk --budget 1 \\
        --by layer --group-splits 50 --layer-factors 10,1

The schedule is given either in the LEGACY reference flags (``--by``, ``--group-compressions``,
``--group-splits``, ``--epochs``) or as a budget: ``--budget V`` (a uniform parameter value, in the
units of ``--group-compressions``) with a shape (``--layer-factors``, ``--phase-factors``), scaled
by ``Legacy.budget_matched`` to send as many bytes as the uniform value would. Neither: the
compressor at GRACE's default for its parameter (``grace_from_params``'s).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from grace_legacy.core.compressor import Compressor
from grace_legacy.helper import COMPRESSORS, DEFAULTS
from grace_legacy.planner import format_plan, model_shapes, plan, plot_plan
from grace_legacy.schedules.legacy import Legacy


def _numbers(text: str, kind: type, flag: str) -> list:
    try:
        return [kind(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{flag} must be comma-separated numbers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m grace_legacy", description="grace-legacy tools")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("plan", help="bytes per step and expected volume of a compression set-up",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--sizes", help="tensor sizes in elements, comma-separated (e.g. 600,20,100,5)")
    source.add_argument("--model", help="torchvision:NAME (e.g. torchvision:resnet50) or package.module:function "
                                        "returning an nn.Module")
    p.add_argument("--compressor", default="topk", choices=list(COMPRESSORS),
                   help="a compressor name as grace_from_params takes it (default: topk)")
    p.add_argument("--by", choices=["uniform", *Legacy.MODES],
                   help="LEGACY mode (reference flag legacy_by; default layer); needs --group-compressions or --budget")
    p.add_argument("--group-compressions", help="parameter values per size group, ';' between phases; a density "
                                                 "in percent (reference flag)")
    p.add_argument("--group-splits", default="", help="size-group thresholds in elements, comma-separated")
    p.add_argument("--epochs", type=int, help="training epochs (phases are equal shares of them)")
    p.add_argument("--budget", type=float, help="match the bytes of this uniform value (a density in percent)")
    p.add_argument("--layer-factors", help="with --budget: relative parameter per size group, comma-separated")
    p.add_argument("--phase-factors", help="with --budget: relative parameter per phase, comma-separated")
    p.add_argument("--workers", type=int, help="number of ranks: counts tensors the dense fallback sends dense "
                                               "as dense (omit to ignore the fallback)")
    p.add_argument("--plot", metavar="FILE.png", help="also draw bytes per size group and phase")
    return parser


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
    if args.group_compressions is not None:
        if args.layer_factors or args.phase_factors:
            parser.error("--layer-factors/--phase-factors shape a --budget; with --group-compressions give values")
        return Legacy.from_flags(base, by, group_compressions=args.group_compressions,
                                   group_splits=args.group_splits, epochs=args.epochs)
    if by == "uniform":
        parser.error("--budget needs --by layer, epoch or both (a uniform schedule is the budget itself)")
    target = args.budget / 100 if base.parameter.name == "ratio" else args.budget
    return Legacy.budget_matched(
        base, target, by=by, sizes=[s.numel() for s in shapes],
        splits=_numbers(args.group_splits, int, "--group-splits") or None,
        layer_factors=_numbers(args.layer_factors, float, "--layer-factors") if args.layer_factors else None,
        phase_factors=_numbers(args.phase_factors, float, "--phase-factors") if args.phase_factors else None,
        epochs=args.epochs, world_size=args.workers)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.workers is not None and args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    try:
        if args.sizes is not None:
            shapes = [torch.Size([n]) for n in _numbers(args.sizes, int, "--sizes")]
        else:
            shapes = [shape for _, shape in model_shapes(args.model)]
        compression = build_compression(args, parser, shapes)
        result = plan(compression, shapes, world_size=args.workers)
    except NotImplementedError as err:  # a payload whose size only the data decides (Threshold)
        parser.error(f"--compressor {args.compressor}: its bytes cannot be planned ({err})")
    except (ValueError, TypeError, ImportError, argparse.ArgumentTypeError) as err:
        parser.error(str(err))
    print(f"{compression!r}" + (f" on {args.workers} workers" if args.workers else ""))
    if isinstance(compression, Legacy):
        flags = compression.to_flags()
        print("reference flags: " + " ".join(f"--{k.replace('_', '-')} {v!r}" if isinstance(v, str) else
                                             f"--{k.replace('_', '-')} {v}" for k, v in flags.items()))
    if args.plot:
        plot_plan(result, args.plot)
        print(f"plot: {args.plot}")
    print(format_plan(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
