"""Compressor throughput: compress + decompress over a whole model's gradients, every compressor.

    python -m benchmarks.performance.throughput            # the full run (several minutes here)
    python -m benchmarks.performance.throughput --quick    # a smoke run (seconds)
    python -m benchmarks.performance.throughput --device cuda --results DIR   # on a GPU (CUDA events)

For each compressor, three ways go over the same gradients, one tensor at a time, interleaved
repetition by repetition so that drift of a shared machine hits them alike (grace-legacy and the
reference take turns at going first):

* *grace-legacy*: ``compressor_for`` (tensors a compressor sends dense cost nothing), ``compress``,
  the further rounds of multi-round compressors (PowerSGD) with the payload as its own sum, and
  ``decompress``;
* *per-tensor reference*: the straightforward GRACE-style code of
  :mod:`benchmarks.common.reference_compressors` (one ``torch.topk`` per tensor, ...);
* the LEGACY reference's own compressors the same way; GlobalTopK and CAT, which select over the
  whole model, get the gradients laid end to end by one ``torch.cat`` on both sides (as the
  bundle hands them over); AdaComp's and the variance sparsifier's state carries from repetition
  to repetition on both sides alike, and the variance sparsifier's per-sample moments are each
  gradient squared once, read by both (:class:`~benchmarks.common.reference_compressors.SquaredOnce`);
* *copy*: ``dst.copy_(src)`` of every gradient into a preallocated buffer, the memory-bandwidth
  floor that any pass over the gradient pays; and, for reference, *clone*: ``src.clone()``, a copy
  that allocates its output as ``decompress`` must (fresh pages cost their faults).

Models: ResNet-50's 161 gradient tensors (25,557,032 fp32 parameters, from torchvision's layer
definitions written out below) and a Transformer-base encoder (6 layers, d=512, 8 heads,
feed-forward 2048, a 32,000-token embedding) whose shapes come from ``torch.nn``'s own
``TransformerEncoderLayer`` on the meta device. Gradients are ``randn``, so the threshold that
keeps a given fraction is known (:func:`threshold_keeping`): Threshold is swept over fractions kept.
Threads: every case runs at one thread and at the machine's count (``torch.get_num_threads()``
when the benchmark starts; ``--threads 1,8`` picks others), set with ``torch.set_num_threads`` for
both sides: torch's own operations, which the reference is made of, use them, and so do
grace-legacy's compiled passes (:mod:`grace_legacy.compressors.kernels.compiled`). Median and
quartiles of the repetitions go to ``benchmarks/results/performance.md`` (section "throughput"),
``throughput.json`` and ``throughput.png``.

``--device cuda`` puts the gradients on the GPU and times each way with CUDA events (every
compressor then takes its tensor formulas, :mod:`grace_legacy.runtime.paths`); the report goes to
``--results`` with the device in its title (the device check, ``benchmarks/device_check``,
runs it that way).

Each timing also counts the minor page faults it took (``getrusage``). Outputs are fresh buffers
unless the compressor keeps its own;
glibc's malloc serves a buffer above its mmap threshold (at most 32 MiB) with a new mapping, whose
pages fault on first touch, so a tensor that large (the Transformer's 65.5 MB embedding) pays its
faults at every clone and every decompress into a fresh buffer, while smaller ones reuse the heap
(Top-k's and Threshold's decompress reuse their own output once the caller has let go of it). The
counts show which regime each row ran in.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from statistics import NormalDist

import torch

from benchmarks.common import reference_compressors as ref

REPO = Path(__file__).resolve().parents[2]
TOPK_TARGET_SPEEDUP = 3.0
TOPK_TARGET_VS_COPY = 3.0
#: On the Transformer, whose 65.5 MB embedding would fault fresh pages at every decompress.
TOPK_TRANSFORMER_TARGET_VS_COPY = 2.0
#: Fractions of entries a Threshold keeps in the sweep: a user of Threshold does not control it, so
#: it must be fast at all of them. For ``randn`` gradients, ``|g| >= t`` keeps ``2 * (1 - Phi(t))``.
THRESHOLD_FRACTIONS = (0.001, 0.01, 0.1, 0.32, 0.5, 0.9, 0.99)


def threshold_keeping(fraction: float) -> float:
    """The threshold that keeps ``fraction`` of standard normal entries."""
    return NormalDist().inv_cdf(1 - fraction / 2)


def resnet50_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """torchvision's ResNet-50 parameters, in ``named_parameters`` order: 161 tensors."""
    shapes: list[tuple[str, tuple[int, ...]]] = []

    def conv_bn(prefix: str, bn: str, out: int, inp: int, kernel: int) -> None:
        shapes.append((f"{prefix}.weight" if not bn else f"{prefix}conv{bn}.weight", (out, inp, kernel, kernel)))
        norm = f"{prefix}.1" if not bn else f"{prefix}bn{bn}"
        shapes.extend([(f"{norm}.weight", (out,)), (f"{norm}.bias", (out,))])

    shapes.append(("conv1.weight", (64, 3, 7, 7)))
    shapes.extend([("bn1.weight", (64,)), ("bn1.bias", (64,))])
    inplanes = 64
    for layer, (width, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3), strict=True), start=1):
        for block in range(blocks):
            prefix = f"layer{layer}.{block}."
            conv_bn(prefix, "1", width, inplanes, 1)
            conv_bn(prefix, "2", width, width, 3)
            conv_bn(prefix, "3", width * 4, width, 1)
            if block == 0:
                conv_bn(f"{prefix}downsample.0", "", width * 4, inplanes, 1)
            inplanes = width * 4
    shapes.extend([("fc.weight", (1000, 2048)), ("fc.bias", (1000,))])
    return shapes


def transformer_shapes(layers: int = 6, d_model: int = 512, vocab: int = 32_000) -> list[tuple[str, tuple[int, ...]]]:
    """A Transformer-base encoder's parameters, as ``torch.nn`` defines them (on the meta device)."""
    shapes = [("embedding.weight", (vocab, d_model))]
    layer = torch.nn.TransformerEncoderLayer(d_model, nhead=8, dim_feedforward=4 * d_model, device="meta")
    for i in range(layers):
        shapes += [(f"encoder.layers.{i}.{n}", tuple(p.shape)) for n, p in layer.named_parameters()]
    return shapes


def cases(quick: bool) -> list[tuple[str, Callable, Callable]]:
    """(label, grace-legacy compressor factory, reference factory) for every compressor."""
    import grace_legacy as gl

    all_cases = [
        ("NoCompression", gl.NoCompression, ref.NoCompression),
        ("FP16", gl.FP16, ref.FP16),
        ("TopK 0.001", lambda: gl.TopK(0.001), lambda: ref.TopK(0.001)),
        ("TopK 0.01", lambda: gl.TopK(0.01), lambda: ref.TopK(0.01)),
        ("DGC 0.001", lambda: gl.DGC(0.001), lambda: ref.DGC(0.001)),
        ("DGC 0.01", lambda: gl.DGC(0.01), lambda: ref.DGC(0.01)),
        ("RandomK 0.01", lambda: gl.RandomK(0.01), lambda: ref.RandomK(0.01)),
        ("TopK 0.1", lambda: gl.TopK(0.1), lambda: ref.TopK(0.1)),
        ("DGC 0.1", lambda: gl.DGC(0.1), lambda: ref.DGC(0.1)),
        *[(f"Threshold keeps {fraction:.1%}", functools.partial(gl.Threshold, threshold_keeping(fraction)),
           functools.partial(ref.Threshold, threshold_keeping(fraction))) for fraction in THRESHOLD_FRACTIONS],
        ("QSGD 16 levels", lambda: gl.QSGD(16), lambda: ref.QSGD(16)),
        ("TernGrad", gl.TernGrad, ref.TernGrad),
        ("Natural", gl.Natural, ref.Natural),
        ("U8bit", gl.U8bit, ref.U8bit),
        ("SignSGD", gl.SignSGD, ref.SignSGD),
        ("Signum", gl.Signum, ref.Signum),
        ("EFSignSGD", lambda: gl.EFSignSGD(lr=0.1), ref.EFSignSGD),
        ("OneBit", gl.OneBit, ref.OneBit),
        ("PowerSGD rank 4", lambda: gl.PowerSGD(4), lambda: ref.PowerSGD(4)),
        # The LEGACY reference's own: the whole-model ones over the gradients end to end.
        ("GlobalTopK 0.01", lambda: gl.GlobalTopK(0.01), lambda: ref.GlobalTopK(0.01)),
        ("CAT", gl.CAT, ref.CAT),
        ("AdaComp 50", lambda: gl.AdaComp(50), lambda: ref.AdaComp(50)),
        ("AdaComp 500", lambda: gl.AdaComp(500), lambda: ref.AdaComp(500)),
        ("VarianceSparsifier 1.0", _variance, lambda: ref.Variance(1.0, 0.999, _MOMENTS)),
    ]
    return all_cases


#: The per-sample moments both sides of the variance case read (each gradient squared once).
_MOMENTS = ref.SquaredOnce()


def _variance():
    import grace_legacy as gl

    sparsifier = gl.VarianceSparsifier(1.0, 0.999)
    sparsifier.attach(_MOMENTS)
    return sparsifier


def end_to_end(grads: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The gradients laid end to end, as a bundle hands them to a compressor that spans the step."""
    return [("whole-step", torch.cat([grad.reshape(-1) for _, grad in grads]))]


def library_round_trip(compressor, grads: list[tuple[str, torch.Tensor]]) -> None:
    for name, grad in end_to_end(grads) if compressor.traits.spans_step else grads:
        chosen = compressor.compressor_for(grad, name)
        if chosen is None:
            continue
        payload, ctx = chosen.compress(grad, name)
        for _ in range(chosen.traits.rounds - 1):
            payload, ctx = chosen.next_round(payload, ctx)
        chosen.decompress(payload, ctx)


def reference_round_trip(reference: ref.Reference, grads: list[tuple[str, torch.Tensor]]) -> None:
    for name, grad in end_to_end(grads) if getattr(reference, "spans_step", False) else grads:
        reference.decompress(*reference.compress(grad, name))


def copy_round_trip(grads: list[tuple[str, torch.Tensor]], buffers: list[torch.Tensor]) -> None:
    for (_, grad), buffer in zip(grads, buffers, strict=True):
        buffer.copy_(grad)


def clone_round_trip(grads: list[tuple[str, torch.Tensor]]) -> None:
    for _, grad in grads:
        grad.clone()


def timed(run: Callable[[], None], device: torch.device) -> tuple[float, int]:
    """Seconds ``run`` took (on a GPU, between CUDA events around it), and the minor page faults
    it took."""
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1000
    else:
        begin = time.perf_counter()
        run()
        seconds = time.perf_counter() - begin
    return seconds, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


def quartiles(samples: list[float]) -> dict[str, float]:
    q1, median, q3 = statistics.quantiles(samples, n=4) if len(samples) > 1 else samples * 3
    return {"median": median, "q1": q1, "q3": q3}


def measure_model(shapes: list[tuple[str, tuple[int, ...]]], repetitions: int, quick: bool,
                  device: torch.device | None = None) -> dict:
    device = device or torch.device("cpu")
    generator = torch.Generator().manual_seed(0)
    grads = [(name, torch.randn(shape, generator=generator).to(device)) for name, shape in shapes]
    buffers = [torch.empty_like(g) for _, g in grads]
    total_bytes = sum(g.numel() * g.element_size() for _, g in grads)
    results = {}
    built = [(label, make(), make_ref()) for label, make, make_ref in cases(quick)]
    for _, compressor, reference in built:  # warm-up: caches, first-call allocations
        library_round_trip(compressor, grads)
        reference_round_trip(reference, grads)
    ways = ("library", "reference", "copy", "clone")
    times: dict[str, dict[str, list[float]]] = {label: {way: [] for way in ways} for label, _, _ in built}
    faults: dict[str, dict[str, list[int]]] = {label: {way: [] for way in ways} for label, _, _ in built}
    for repetition in range(repetitions):
        for label, compressor, reference in built:
            compared = [("library", lambda c=compressor: library_round_trip(c, grads)),
                        ("reference", lambda r=reference: reference_round_trip(r, grads))]
            # The second of two back-to-back passes over the same gradients finds them warmer in
            # cache: the compared ways take turns at going first, so neither gets that edge always.
            if repetition % 2:
                compared.reverse()
            for way, run_way in [("copy", lambda: copy_round_trip(grads, buffers)),
                                 ("clone", lambda: clone_round_trip(grads)), *compared]:
                seconds, faulted = timed(run_way, device)
                times[label][way].append(seconds)
                faults[label][way].append(faulted)
    for label, samples_by_way in times.items():
        stats = {way: quartiles([1000 * t for t in samples]) for way, samples in samples_by_way.items()}
        library, reference, copy = (stats[w]["median"] for w in ("library", "reference", "copy"))
        paired = [r / lib for r, lib in zip(samples_by_way["reference"], samples_by_way["library"], strict=True)]
        paired_spread = quartiles(paired)
        results[label] = {
            "ms": stats,
            "page_faults": {way: statistics.median(counts) for way, counts in faults[label].items()},
            "library_gb_per_s": total_bytes / library / 1e6,
            "reference_gb_per_s": total_bytes / reference / 1e6,
            "copy_gb_per_s": total_bytes / copy / 1e6,
            "speedup_vs_reference": reference / library,
            # Each repetition runs both ways back to back: their ratio cancels most of the drift.
            "paired_speedup": statistics.median(paired),
            "paired_speedup_quartiles": [paired_spread["q1"], paired_spread["q3"]],
            "library_vs_copy": library / copy,
            "paired_vs_copy": statistics.median(lib / cp for lib, cp in zip(samples_by_way["library"],
                                                                            samples_by_way["copy"], strict=True)),
            "reference_vs_copy": reference / copy,
            "library_vs_clone": library / stats["clone"]["median"],
        }
    return {"tensors": len(grads), "parameters": sum(g.numel() for _, g in grads), "bytes": total_bytes,
            "repetitions": repetitions, "cases": results}


def default_threads() -> list[int]:
    """One thread and the machine's count (``torch.get_num_threads()`` as the process started)."""
    return sorted({1, torch.get_num_threads()})


def run(quick: bool, repetitions: int, threads: list[int] | None = None, device: str = "cpu",
        models: list[str] | None = None) -> dict:
    """Every case on every model at every thread count in ``threads`` (default: :func:`default_threads`),
    on ``device``; ``models`` picks some of the models by name."""
    from benchmarks.common.report import load_average, machine

    threads = threads or default_threads()
    where = torch.device(device)
    before = load_average()
    shapes = {"ResNet-50": resnet50_shapes(), "Transformer-base encoder": transformer_shapes()}
    if quick:
        shapes = {"ResNet-50": resnet50_shapes()[:30], "Transformer-base encoder": transformer_shapes(1, 128, 1000)}
    if models:
        shapes = {name: shape for name, shape in shapes.items() if name in models}
    runs = {}
    initial = torch.get_num_threads()
    try:
        for count in threads:
            torch.set_num_threads(count)
            runs[str(count)] = {"models": {name: measure_model(shape, repetitions, quick, where)
                                           for name, shape in shapes.items()}}
    finally:
        torch.set_num_threads(initial)
    return {"machine": machine(), "device": device_name(where), "quick": quick, "threads": threads,
            "load_average": [before, load_average()], "runs": runs}


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def slowest(models: dict) -> tuple[str, str, float]:
    """(model, compressor, paired speed-up) of the case where grace-legacy gains least."""
    return min(((model, label, case["paired_speedup"]) for model, data in models.items()
                for label, case in data["cases"].items() if label != "NoCompression"), key=lambda row: row[2])


def speed_verdict(ratio: float, quartiles_of_ratio: list[float]) -> str:
    """Whether grace-legacy is at least as fast, told from the paired ratios' spread: quartiles on
    both sides of 1 are a tie within the run's noise, whichever side the median fell on (two ways
    running the same kernels can only tie)."""
    low, high = quartiles_of_ratio
    spread = f"paired ratios' quartiles {low:.3f}-{high:.3f}"
    if low >= 1:
        return f"at least as fast everywhere ({spread})"
    if high >= 1:
        side = "at least 1.0" if ratio >= 1 else "below 1.0"
        return f"{side}, a tie within the run's noise there ({spread})"
    return f"SLOWER there ({spread})"


def verdicts(models: dict, threads: str) -> list[str]:
    model, label, ratio = slowest(models)
    case = models[model]["cases"][label]
    lines = [f"- {threads} thread(s): slowest case against the GRACE-style reference: **{ratio:.3f}x** ({label}, "
             f"{model}; median of paired ratios): {speed_verdict(ratio, case['paired_speedup_quartiles'])}."]
    below = [(model, label, c["paired_speedup"]) for model, data in models.items()
             for label, c in data["cases"].items()
             if label != "NoCompression" and c["paired_speedup_quartiles"][1] < 1]
    if below:
        lines.append(f"- {threads} thread(s): slower than the reference beyond noise: " + ", ".join(
            f"{label} ({model}) {ratio:.2f}x" for model, label, ratio in below) + ".")
    resnet = models.get("ResNet-50", {}).get("cases", {})
    for label in ("TopK 0.001", "TopK 0.01"):
        if label not in resnet:
            continue
        case = resnet[label]
        speedup, vs_copy = case["speedup_vs_reference"], case["library_vs_copy"]
        met = speedup >= TOPK_TARGET_SPEEDUP and vs_copy <= TOPK_TARGET_VS_COPY
        lines.append(f"- {threads} thread(s): {label} on ResNet-50: **{speedup:.1f}x** faster than per-tensor "
                     f"`torch.topk` (target >= {TOPK_TARGET_SPEEDUP:g}x) and **{vs_copy:.1f}x** the copy's time "
                     f"(target <= {TOPK_TARGET_VS_COPY:g}x): {'met' if met else 'NOT met'}; "
                     f"{case['library_vs_clone']:.1f}x an allocating clone's time.")
    transformer = models.get("Transformer-base encoder", {}).get("cases", {}).get("TopK 0.001")
    if transformer is not None:
        vs_copy = transformer["paired_vs_copy"]
        lines.append(f"- {threads} thread(s): TopK 0.001 on the Transformer-base encoder: **{vs_copy:.2f}x** the "
                     f"copy's time (median of paired ratios; target <= {TOPK_TRANSFORMER_TARGET_VS_COPY:g}x, page "
                     f"faults included: {transformer['page_faults']['library']:,.0f} a repetition): "
                     f"{'met' if vs_copy <= TOPK_TRANSFORMER_TARGET_VS_COPY else 'NOT met'}.")
    return lines


def tables(models: dict, threads: str) -> list[str]:
    out = []
    for model, data in models.items():
        rows = []
        for label, case in data["cases"].items():
            ms = case["ms"]
            lib, rf, cp = ms["library"], ms["reference"], ms["copy"]
            faulted = case["page_faults"]
            rows.append(f"| {label} | {lib['median']:.1f} ({lib['q1']:.1f}-{lib['q3']:.1f}) | "
                        f"{case['library_gb_per_s']:.2f} | {rf['median']:.1f} ({rf['q1']:.1f}-{rf['q3']:.1f}) | "
                        f"{case['reference_gb_per_s']:.2f} | {cp['median']:.1f} | {ms['clone']['median']:.1f} | "
                        f"**{case['paired_speedup']:.2f}x** | {case['library_vs_copy']:.2f}x | "
                        f"{case['reference_vs_copy']:.2f}x | {faulted['library']:,.0f} / {faulted['clone']:,.0f} |")
        out.append(f"""### {model}, {threads} thread(s): {data['tensors']} tensors, {data['parameters']:,} fp32 \
parameters ({data['bytes'] / 1e6:.1f} MB)

| compressor | grace-legacy ms (quartiles) | GB/s | per-tensor reference ms (quartiles) | GB/s | copy ms | \
clone ms | speed-up vs reference (paired) | grace-legacy / copy | reference / copy | page faults: grace-legacy / clone |
|---|---|---|---|---|---|---|---|---|---|---|
""" + "\n".join(rows))
    return out


def write(result: dict, results_dir: Path, command: str, section: str = "throughput",
          markdown: str = "performance.md") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.common.report import load_note, update_section

    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / f"{section}.json").write_text(json.dumps(result, indent=1))
    runs = result["runs"]
    first = next(iter(next(iter(runs.values()))["models"].values()))
    on = "" if result["device"] == "CPU" else f" on {result['device']}"
    lines = [line for threads, run in runs.items() for line in verdicts(run["models"], threads)]
    text = f"""## Compressor throughput{on}: compress + decompress, every compressor

`{command}`

Machine: {result['machine']}; device: {result['device']}; {load_note(result['load_average'])} (other jobs add
noise: the quartiles show the spread).{oversubscribed(result['load_average'], command)}
Thread counts: {', '.join(runs)} (`torch.set_num_threads`, for both sides). Median of
{first['repetitions']} interleaved repetitions (copy, clone, then grace-legacy and the reference,
taking turns at going first, per compressor); times are for the whole model, one tensor after
another; GB/s is the gradient's fp32 bytes over that time. The copy is `dst.copy_(grad)` into preallocated buffers:
the memory floor; the clone (`grad.clone()`) allocates its output, as decompress must.
grace-legacy's NoCompression costs nothing: it sends the gradient itself, dense. The reference is
the straightforward GRACE-style code in `benchmarks/common/reference_compressors.py`.
DGC's reference keeps about k entries (within 30%) where grace-legacy's keeps exactly k; the sign
compressors' references send unpacked bytes where grace-legacy packs 8 signs a byte.
The last column is the median count of minor page faults per repetition: glibc maps every buffer
above its mmap threshold (at most 32 MiB) anew, so a tensor that large (the Transformer's 65.5 MB
embedding, 16,000 pages of 4 KiB) pays its faults at every clone and every decompress into a
fresh buffer, while smaller ones reuse the heap (Top-k's and Threshold's decompress reuse their
own output once the caller has let go of it).

{chr(10).join(lines)}

{(chr(10) * 2).join(t for threads, run in runs.items() for t in tables(run["models"], threads))}

![throughput]({section}.png)
"""
    update_section(results_dir / markdown, section, text, title="Performance results")

    panels = [(threads, model, data) for threads, run in runs.items() for model, data in run["models"].items()]
    columns = len(next(iter(runs.values()))["models"])
    figure, axes = plt.subplots(len(runs), columns, figsize=(7 * columns, 6 * len(runs)), sharey=True,
                                squeeze=False)
    for axis, (threads, model, data) in zip(axes.reshape(-1), panels, strict=True):
        labels = list(data["cases"])
        positions = range(len(labels))
        library = [data["cases"][label]["library_vs_copy"] for label in labels]
        reference = [data["cases"][label]["reference_vs_copy"] for label in labels]
        axis.barh([p + 0.2 for p in positions], library, height=0.4, label="grace-legacy", color="#4a4")
        axis.barh([p - 0.2 for p in positions], reference, height=0.4, label="per-tensor reference", color="#c44")
        axis.axvline(1.0, color="black", linewidth=1, label="copy (memory floor)")
        axis.set_xscale("log")
        axis.set_yticks(list(positions), labels)
        axis.invert_yaxis()
        axis.set_xlabel("compress + decompress time / copy time (log)")
        axis.set_title(f"{model} ({data['parameters'] / 1e6:.1f}M fp32), {threads} thread(s)")
    axes[0][0].legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(results_dir / f"{section}.png", dpi=110)
    plt.close(figure)


def oversubscribed(load: list[float], command: str) -> str:
    """A warning, for a report, when the machine had more runnable jobs than cores during the run."""
    cores = os.cpu_count() or 1
    if max(load) <= cores:
        return ""
    return (f" **The machine was oversubscribed** (load above its {cores} cores: other jobs ran beside this one), "
            f"so the times are inflated and the ratios noisy, the more so with more threads: rerun `{command}` "
            f"on a quiet machine before reading a ratio near 1.")


def thread_counts(text: str) -> list[int]:
    counts = sorted({int(part) for part in text.split(",") if part.strip()})
    if not counts or counts[0] < 1:
        raise argparse.ArgumentTypeError(f"--threads takes counts >= 1 separated by commas, got {text!r}")
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    parser.add_argument("--repetitions", type=int, default=None)
    parser.add_argument("--threads", type=thread_counts, default=None,
                        help="thread counts, e.g. 1,8 (default: 1 and torch.get_num_threads())")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    repetitions = args.repetitions or (1 if args.quick else 6)
    result = run(args.quick, repetitions, args.threads, args.device)
    command = "python -m benchmarks.performance.throughput" + (" --quick" if args.quick else "")
    command += f" --threads {','.join(map(str, result['threads']))}"
    if args.repetitions:
        command += f" --repetitions {args.repetitions}"
    if args.device != "cpu":
        command += f" --device {args.device}"
    write(result, args.results, command)
    for threads, run_ in result["runs"].items():
        for model, data in run_["models"].items():
            for label, case in data["cases"].items():
                print(f"{threads}T {model:26} {label:22} lib {case['ms']['library']['median']:9.1f} ms  "
                      f"ref {case['ms']['reference']['median']:9.1f} ms  copy {case['ms']['copy']['median']:7.1f} ms  "
                      f"speed-up {case['paired_speedup']:6.2f}x  lib/copy {case['library_vs_copy']:6.2f}x")


if __name__ == "__main__":
    main()
