"""The statistics and the report of :mod:`benchmarks.performance.ddp_hooks`: the ways' names, the
targets (computed from the measurements, never typed in), the Markdown section and the plot."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks.common.limited_link import COMPUTE, label, plot_step_times, summarise

ALLREDUCE = "allreduce"
TORCH_FP16, GRACE_FP16 = "torch fp16", "grace FP16"
TORCH_POWERSGD, GRACE_POWERSGD = "torch PowerSGD", "grace PowerSGD"
TOPK = "grace Top-k + EF"
WAYS = (COMPUTE, ALLREDUCE, TORCH_FP16, GRACE_FP16, TORCH_POWERSGD, GRACE_POWERSGD, TOPK)
#: The issue's targets: on the CNN at 100 Mbit/s, Top-k + EF this many times faster than DDP's allreduce.
CNN, TARGET_RATE, TARGET_SPEEDUP = "resnet", 1e8, 5.0
#: Two payloads differing by less than this fraction count as equal bytes.
EQUAL_BYTES = 0.01
EXTRA = ("backward_s", "link_bytes", "payload_bytes", "collectives")


def _quartiles(values: list[float]) -> list[float]:
    if len(values) < 2:
        return values * 2
    low, _, high = statistics.quantiles(values, n=4)
    return [low, high]


def local_costs(local: dict[str, dict[str, list]]) -> dict[str, float]:
    """Per way, the median over iterations of its one-rank step minus the compute-only step of the
    same iteration: what DDP and the hook cost locally, without the network."""
    compute = dict(zip(local[COMPUTE]["iteration"], local[COMPUTE]["step_s"], strict=True))
    return {name: statistics.median([step - compute[i] for i, step in zip(m["iteration"], m["step_s"], strict=True)
                                     if i in compute] or [float("nan")])
            for name, m in local.items()}


def paired_ratio(ours: dict[str, list], theirs: dict[str, list]) -> list[float]:
    """Our step over theirs, iteration by iteration (the same load on both sides of a ratio)."""
    at = dict(zip(theirs["iteration"], theirs["step_s"], strict=True))
    return [step / at[i] for i, step in zip(ours["iteration"], ours["step_s"], strict=True) if i in at]


def summary(result: dict) -> dict[str, Any]:
    """The table of :func:`~benchmarks.common.limited_link.summarise`, the local costs, the
    PowerSGD pair and the verdicts on the targets."""
    table = summarise(result, baseline=ALLREDUCE, extra=EXTRA)
    local = {model: local_costs(record["local"]) for model, record in result["models"].items()}
    pairs: dict[str, Any] = {}
    verdicts: dict[str, Any] = {}
    for model, record in result["models"].items():
        pairs[model] = {}
        for rate_key, ways in record["rates"].items():
            ratios = paired_ratio(ways[GRACE_POWERSGD], ways[TORCH_POWERSGD])
            ours, theirs = (table[model][rate_key][name]["payload_bytes"] for name in (GRACE_POWERSGD, TORCH_POWERSGD))
            ratio = statistics.median(ratios)
            pairs[model][rate_key] = {
                "step_ratio": ratio, "step_ratio_quartiles": _quartiles(ratios), "pairs": len(ratios),
                "payload_ours": ours, "payload_theirs": theirs,
                "equal_bytes": abs(ours - theirs) <= EQUAL_BYTES * theirs, "no_slower": ratio <= 1.0}
        verdicts[f"{model}: grace PowerSGD no slower than torch's at equal rank and bytes"] = all(
            pair["equal_bytes"] and pair["no_slower"] for pair in pairs[model].values())
    at_target = table.get(CNN, {}).get(repr(TARGET_RATE))
    if at_target:
        speedup = at_target[TOPK][f"speedup_vs_{ALLREDUCE}"]
        verdicts[f"{CNN} at {label(TARGET_RATE)}: Top-k + EF >= {TARGET_SPEEDUP:g}x faster than allreduce"] = (
            speedup >= TARGET_SPEEDUP)
    return {"table": table, "local_cost_s": local, "powersgd": pairs, "verdicts": verdicts}


TABLE_HEAD = ("| model | rate | way | step s | range s | payload MB | wire MB | link MB | collectives | local cost s "
              "| lower bound s | vs bound | vs allreduce | steps |\n" + "|---" * 14 + "|")


def _rows(result: dict, digest: dict) -> list[str]:
    rows = []
    for model, rates in digest["table"].items():
        for rate_key, ways in rates.items():
            for name, row in ways.items():
                low, high = row["step_s_range"]
                # DDP's own allreduce is issued from C++, where the counter cannot see it.
                collectives = "-" if name in (COMPUTE, ALLREDUCE) else f"{row['collectives']:.0f}"
                volumes = " | ".join("-" if name == COMPUTE else f"{row[key] / 1e6:.3f}"
                                     for key in ("payload_bytes", "wire_bytes", "link_bytes"))
                rows.append(f"| {model} | {label(float(rate_key))} | {name} | **{row['step_s']:.3f}** | {low:.3f}-"
                            f"{high:.3f} | {volumes} | {collectives} | "
                            f"{digest['local_cost_s'][model][name]:.3f} | {row['bound_s']:.3f} | "
                            f"{row['vs_bound']:.2f} | {row[f'speedup_vs_{ALLREDUCE}']:.2f}x | {row['steps']} |")
    return rows


def _findings(result: dict, digest: dict) -> list[str]:
    lines = []
    for model, record in result["models"].items():
        rates = digest["table"][model]
        documented = record["powersgd_documented"]
        exact, default = documented["min_compression_rate=1"], documented["min_compression_rate=2"]
        exact_mb = 4 * (exact["dense_elements"] + exact["factor_elements"]) / 1e6
        default_mb = 4 * (default["dense_elements"] + default["factor_elements"]) / 1e6
        for rate_key, pair in digest["powersgd"][model].items():
            low, high = pair["step_ratio_quartiles"]
            ours, theirs = (rates[rate_key][name]["step_s"] for name in (GRACE_POWERSGD, TORCH_POWERSGD))
            lines.append(
                f"- **{model}** at {label(float(rate_key))}, PowerSGD rank {result['powersgd_rank']}: grace "
                f"{ours:.3f} s vs torch {theirs:.3f} s per step, paired ratio **{pair['step_ratio']:.2f}** "
                f"(quartiles {low:.2f}-{high:.2f}, "
                f"{pair['pairs']} pairs): {'no slower' if pair['no_slower'] else 'slower'}; payload "
                f"{pair['payload_ours'] / 1e6:.4f} MB vs {pair['payload_theirs'] / 1e6:.4f} MB "
                f"({'equal' if pair['equal_bytes'] else 'NOT equal'} within {EQUAL_BYTES:.0%}).")
        lines.append(
            f"- **{model}** PowerSGD bytes as PyTorch documents its hook: {exact['dense_elements']:,} elements sent "
            f"dense (1-D tensors, matrices too small to factor) + {exact['factor_elements']:,} of P and Q = "
            f"{exact_mb:.4f} MB per step at `min_compression_rate=1` (ours factors the same matrices); at its default "
            f"2 it would send {default_mb:.4f} MB. PyTorch's hook kept "
            f"{record['torch_powersgd_buckets']} DDP bucket(s).")
    at_target = digest["table"].get(CNN, {}).get(repr(TARGET_RATE))
    if at_target:
        topk, dense = at_target[TOPK], at_target[ALLREDUCE]
        lines.append(
            f"- **{CNN}** at {label(TARGET_RATE)}: Top-k {result['density']} + EF steps in {topk['step_s']:.3f} s vs "
            f"DDP's allreduce {dense['step_s']:.3f} s: **{topk[f'speedup_vs_{ALLREDUCE}']:.1f}x** faster "
            f"({'meets' if topk[f'speedup_vs_{ALLREDUCE}'] >= TARGET_SPEEDUP else 'misses'} the "
            f"{TARGET_SPEEDUP:g}x target), {topk['vs_bound']:.2f}x its lower bound.")
    lines += [f"- {claim}: **{'meets' if met else 'misses'}**" for claim, met in digest["verdicts"].items()]
    return lines


def write(result: dict, results_dir: Path, command: str) -> None:
    """``ddp_hooks.json``, ``ddp_hooks.png`` and the "ddp_hooks" section of ``performance.md``."""
    from benchmarks.common.report import update_section

    digest = summary(result)
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "ddp_hooks.json").write_text(json.dumps({**result, "summary": digest}, indent=1))
    load = result.get("load_average", [float("nan")] * 2)
    text = f"""## DDP communication hooks, bandwidth-limited: PyTorch's and grace_legacy's

`{command}`

Machine: {result['machine']}; load average {load[0]:.1f} before and {load[1]:.1f} after the run
({result.get('duration_s', 0) / 60:.0f} minutes). {result['workers']} `torch.distributed` workers (Gloo over
TCP, started as `torchrun` starts one process per host), each in its own network namespace, every
link rate limited in both directions with `tc tbf`. The workers share this machine's cores, so the
compute part is slower and noisier than on separate hosts; the ways are interleaved step by step.

Ways, each its own `DistributedDataParallel` instance from the same seed: *allreduce* = DDP's own
(no hook); *torch fp16* = `fp16_compress_hook`; *grace FP16* = `grace_legacy.ddp.register(ddp, FP16())`;
*torch PowerSGD* = `PowerSGDState(matrix_approximation_rank={result['powersgd_rank']}, min_compression_rate=1,
use_error_feedback=True, warm_start=True, start_powerSGD_iter=2)` + `powerSGD_hook` (its two
allreduce steps run before timing); *grace PowerSGD* = `register(ddp, PowerSGD({result['powersgd_rank']}))` (with
its error feedback); both PowerSGD ways on one DDP bucket (PyTorch's hook hangs or aborts under
Gloo with more than one); *grace Top-k + EF* = `register(ddp, Grace(TopK({result['density']}), memory=Residual()))`.

Per model, rate and way: the median (and range) over steps of the slowest rank's step time.
*Payload*: bytes a rank hands to `torch.distributed` per step (counted by wrapping its collectives;
DDP's allreduce: the gradients' size). *Wire*: what those collectives must put on each link at the
least. *Link*: bytes seen on the busiest link (interface counters, headers included).
*Collectives*: `torch.distributed` calls per step (DDP's own, from C++, are not seen). *Local
cost*: the step on a one-rank group minus the compute-only step, all ranks at once (DDP's bucket
copies and the hook's work, no network). *vs bound*: the median over iterations of each step over
its own iteration's `compute only + wire / rate`.

How the two PowerSGD hooks differ at the same rank: both view a gradient as `shape[0] x rest` and
send whole the 1-D tensors and the matrices whose factors would not be smaller (PyTorch's default
`min_compression_rate=2` would send more of them whole; here 1, as ours). PyTorch chains three
allreduces per DDP bucket from future callbacks (the whole tensors, then every P, then every Q);
ours sends the whole tensors with the Ps in fused buckets of up to 16 MiB of gradient, one
allreduce per bucket and round, then the Qs, plus one small allreduce of per-tensor non-finite
flags (the few bytes by which ours sends more). Error feedback: PyTorch keeps, for the whole
bucket, the local gradient minus the averaged result (so also the local minus the mean of the
tensors sent whole); ours keeps `M_w - P^ Q_w^T` on factored tensors only. Both start the next
step from the averaged Q; PyTorch re-orthogonalises it first, ours does not (the orthonormal P^
makes Q's scale irrelevant). Every grace_legacy way also checks each gradient and result for
inf/NaN and shares the flags, so that a non-finite gradient is seen on every rank: local work
PyTorch's hooks do not do.

{TABLE_HEAD}
{chr(10).join(_rows(result, digest))}

{chr(10).join(_findings(result, digest))}

![step time vs bandwidth](ddp_hooks.png)
"""
    update_section(results_dir / "performance.md", "ddp_hooks", text, title="Performance results")

    styles = {ALLREDUCE: ("#c44", "o-"), TORCH_FP16: ("#d80", "s--"), GRACE_FP16: ("#d80", "s-"),
              TORCH_POWERSGD: ("#2a2", "^--"), GRACE_POWERSGD: ("#2a2", "^-"), TOPK: ("#36b", "D-")}
    plot_step_times(result, digest["table"], styles, results_dir / "ddp_hooks.png", "DDP workers")
