"""How close the throughput benchmark's reference is to GRACE's own code, in time.

    git clone https://github.com/sands-lab/grace /tmp/grace      # not part of this repository
    python -m benchmarks.performance.grace_comparison --grace /tmp/grace [--threads 1,8]

The throughput benchmark (:mod:`benchmarks.performance.throughput`) compares grace-legacy with
:mod:`benchmarks.common.reference_compressors`, a re-implementation of GRACE's
``grace_dl/torch/compressor/`` (Xu et al., 2021). This runs GRACE's compressors themselves, from
a checkout given with ``--grace`` (its code is never copied here), beside that reference on the
same gradients (ResNet-50's 161 shapes by default), compress then decompress, one tensor after
another, the two taking turns at going first, at one thread and at the machine's count. The
ratio reference time / GRACE time near 1 says the reference stands for GRACE. The table goes to
``benchmarks/results/performance.md`` (section "grace_comparison") and ``grace_comparison.json``.

Left out: GRACE's natural compression (it needs CuPy and a GPU) and PowerSGD (it runs Horovod
allreduces inside ``compress``, and needs its memory to draw Q first).
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import reference_compressors as ref
from benchmarks.performance.throughput import (
    REPO,
    THRESHOLD_FRACTIONS,
    default_threads,
    oversubscribed,
    quartiles,
    resnet50_shapes,
    thread_counts,
    threshold_keeping,
    timed,
    transformer_shapes,
)

#: (label, GRACE module, GRACE class, its arguments, the reference's factory)
PAIRS: list[tuple[str, str, str, tuple, Callable[[], ref.Reference]]] = [
    ("NoCompression", "none", "NoneCompressor", (), ref.NoCompression),
    ("FP16", "fp16", "FP16Compressor", (), ref.FP16),
    ("TopK 0.001", "topk", "TopKCompressor", (0.001,), lambda: ref.TopK(0.001)),
    ("TopK 0.01", "topk", "TopKCompressor", (0.01,), lambda: ref.TopK(0.01)),
    ("DGC 0.01", "dgc", "DgcCompressor", (0.01,), lambda: ref.DGC(0.01)),
    ("RandomK 0.01", "randomk", "RandomKCompressor", (0.01,), lambda: ref.RandomK(0.01)),
    *[(f"Threshold keeps {fraction:.1%}", "threshold", "ThresholdCompressor", (threshold_keeping(fraction),),
       lambda f=fraction: ref.Threshold(threshold_keeping(f))) for fraction in THRESHOLD_FRACTIONS],
    ("QSGD 16 levels", "qsgd", "QSGDCompressor", (16,), lambda: ref.QSGD(16)),
    ("TernGrad", "terngrad", "TernGradCompressor", (), ref.TernGrad),
    ("SignSGD", "signsgd", "SignSGDCompressor", (), ref.SignSGD),
    ("Signum", "signum", "SignumCompressor", (0.9,), ref.Signum),
    ("EFSignSGD", "efsignsgd", "EFSignSGDCompressor", (0.1,), ref.EFSignSGD),
    ("OneBit", "onebit", "OneBitCompressor", (), ref.OneBit),
]


def grace_compressors(checkout: Path) -> dict[str, Callable[[], object]]:
    """Factories of GRACE's compressors, imported from ``checkout`` (the directory holding ``grace_dl``)."""
    if not (checkout / "grace_dl" / "torch" / "compressor").is_dir():
        raise SystemExit(f"--grace: {checkout} holds no grace_dl/torch/compressor (a checkout of sands-lab/grace)")
    sys.path.insert(0, str(checkout))
    factories = {}
    for label, module, name, arguments, _ in PAIRS:
        cls = getattr(importlib.import_module(f"grace_dl.torch.compressor.{module}"), name)
        factories[label] = lambda cls=cls, arguments=arguments: cls(*arguments)
    return factories


def round_trip(compressor, grads: list[tuple[str, torch.Tensor]]) -> None:
    for name, grad in grads:
        compressor.decompress(*compressor.compress(grad, name))


def measure(grads: list[tuple[str, torch.Tensor]], grace: dict[str, Callable[[], object]], repetitions: int,
            device: torch.device) -> dict:
    built = [(label, grace[label](), make_ref()) for label, _, _, _, make_ref in PAIRS]
    for _, theirs, ours in built:  # warm-up
        round_trip(theirs, grads)
        round_trip(ours, grads)
    samples = {label: {"grace": [], "reference": []} for label, _, _ in built}
    for repetition in range(repetitions):
        for label, theirs, ours in built:
            ways = [("grace", theirs), ("reference", ours)]
            if repetition % 2:
                ways.reverse()
            for way, compressor in ways:
                samples[label][way].append(timed(lambda c=compressor: round_trip(c, grads), device)[0])
    out = {}
    for label, by_way in samples.items():
        ratios = [r / g for r, g in zip(by_way["reference"], by_way["grace"], strict=True)]
        spread = quartiles(ratios)
        out[label] = {"grace_ms": 1000 * statistics.median(by_way["grace"]),
                      "reference_ms": 1000 * statistics.median(by_way["reference"]),
                      "reference_over_grace": spread["median"], "quartiles": [spread["q1"], spread["q3"]]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grace", type=Path, required=True, help="a checkout of sands-lab/grace")
    parser.add_argument("--threads", type=thread_counts, default=None, help="default: 1 and torch.get_num_threads()")
    parser.add_argument("--repetitions", type=int, default=7)
    parser.add_argument("--model", choices=["ResNet-50", "Transformer-base encoder"], default="ResNet-50")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results",
                        help="where performance.md and grace_comparison.json go")
    args = parser.parse_args()
    from benchmarks.common.report import load_average, machine

    grace = grace_compressors(args.grace)
    device = torch.device(args.device)
    shapes = resnet50_shapes() if args.model == "ResNet-50" else transformer_shapes()
    generator = torch.Generator().manual_seed(0)
    grads = [(name, torch.randn(shape, generator=generator).to(device)) for name, shape in shapes]
    threads = args.threads or default_threads()
    result = {"machine": machine(), "model": args.model, "device": args.device, "repetitions": args.repetitions,
              "grace_commit": grace_commit(args.grace), "load_average": [load_average()], "runs": {}}
    for count in threads:
        torch.set_num_threads(count)
        result["runs"][str(count)] = measure(grads, grace, args.repetitions, device)
    result["load_average"].append(load_average())
    command = f"python -m benchmarks.performance.grace_comparison --grace GRACE_CHECKOUT --threads " \
              f"{','.join(map(str, threads))} --repetitions {args.repetitions}" + \
              ("" if args.model == "ResNet-50" else f" --model '{args.model}'") + \
              ("" if args.device == "cpu" else f" --device {args.device}")
    print(write(result, args.results, command))


def grace_commit(checkout: Path) -> str | None:
    """The commit of a git checkout of GRACE, if it is one."""
    try:
        return subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def write(result: dict, results_dir: Path, command: str) -> str:
    """The table, in ``results_dir/performance.md`` (section "grace_comparison") and its JSON; returns the text."""
    from benchmarks.common.report import load_note, update_section

    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "grace_comparison.json").write_text(json.dumps(result, indent=1))
    rows = [f"| {count} | {label} | {case['grace_ms']:.1f} | {case['reference_ms']:.1f} | "
            f"**{case['reference_over_grace']:.3f}** ({case['quartiles'][0]:.3f}-{case['quartiles'][1]:.3f}) |"
            for count, cases in result["runs"].items() for label, case in cases.items()]
    # NoCompression does nothing on either side: its ratio is of two empty loops.
    ratios = [case["reference_over_grace"] for cases in result["runs"].values()
              for label, case in cases.items() if label != "NoCompression"]
    commit = result.get("grace_commit") or "unknown commit"
    text = f"""## The throughput benchmark's reference against GRACE's own code

`{command}`, GRACE_CHECKOUT a checkout of sands-lab/grace ({commit}; run from it, never copied here).

Machine: {result['machine']}; device: {result['device']}; {load_note(result['load_average'])}.\
{oversubscribed(result['load_average'], command)} Median of
{result['repetitions']} paired repetitions (the two taking turns at going first) of compress + decompress over
{result['model']}'s gradients, one tensor after another, at each thread count (`torch.set_num_threads`).
A ratio reference / GRACE near 1 says `benchmarks/common/reference_compressors.py`, what
`benchmarks.performance.throughput` compares grace-legacy against, times as GRACE's own
`grace_dl/torch/compressor/` does; here {min(ratios):.3f} to {max(ratios):.3f} (NoCompression aside).
Left out: Natural (GRACE's needs CuPy and a GPU) and PowerSGD (GRACE's runs Horovod allreduces
inside `compress`).

| threads | compressor | GRACE ms | reference ms | reference / GRACE (paired quartiles) |
|---|---|---|---|---|
{chr(10).join(rows)}
"""
    update_section(results_dir / "performance.md", "grace_comparison", text, title="Performance results")
    return text


if __name__ == "__main__":
    main()
