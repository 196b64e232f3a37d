"""The device check: every zoo case on the GPU's tensors, DDP over NCCL and over Gloo with CUDA
tensors, and the throughput benchmark on the GPU, in one command within a time budget.

    python -m benchmarks.device_check --out DIR [--device cuda] [--budget 450] [--quick]

Made for a lent GPU machine (one GPU, a few minutes, nothing reachable, no Horovod): it installs
nothing and needs only the repository on ``PYTHONPATH`` (``scripts/device_check.sh`` sets it), with
torch, numba and pytest's ``hypothesis`` (the test registry's) beside it. Stages, in order, each
recorded with its status and time:

1. ``environment``: torch, CUDA, the GPU, numba, whether Horovod is there (it need not be).
2. ``zoo in process``: every zoo case (``tests/registry.py``) on two in-process ranks with the
   gradients on the device (``tests/zoo_in_process.py``): the synchronized gradient equals the
   case's independent rule, bit for bit for the quantizers; and every scatter-gather case
   (``tests/two_phase.py``) on three ranks, bit for bit the two-phase reference's.
3. ``same payloads on the CPU``: each compressor's payload and decompressed tensor on the device
   against the same on the CPU along the device path (:mod:`grace_legacy.runtime.paths`); a report,
   not a pass/fail check (QSGD's and TernGrad's scales may differ in their last bit between
   devices, 1-bit SGD's and EF-signSGD's sums too).
4. ``ddp nccl 1 rank``, ``ddp gloo 2 ranks``: real ``torchrun`` workers
   (:mod:`benchmarks.device_check.ddp_worker`) run every zoo case through the DDP hook, NCCL with
   one rank (NCCL refuses two ranks on one GPU), Gloo with CUDA tensors on two ranks sharing the
   GPU (the cases' twins model the routes a default bundle takes at two ranks).
5. ``fsdp gloo 2 ranks``: grace_legacy.fsdp's test worker (``tests/distributed/fsdp_worker.py``) on
   two ranks sharing the GPU over Gloo, the FSDP2 model and its gradients on the device: every
   unit's compressed reduce-scatter against the independent reference, in FSDP2's reduce-scatter
   stream.
6. ``throughput``: :mod:`benchmarks.performance.throughput` on the device (CUDA events), ResNet-50
   and the Transformer-base encoder, grace-legacy against the GRACE-style reference.

The report goes to ``DIR/gpu.md`` and ``DIR/gpu.json`` (with ``DIR/throughput.png``): commit it as
``benchmarks/results/gpu.md``. A stage that fails is recorded and the next one runs; a stage the
budget has no time left for is recorded as not run. The exit status is 0 when every stage that ran
passed.

``--device cpu`` runs every stage with CPU tensors along the device path (the tensor formulas a GPU
runs), Gloo in place of NCCL: the test suite runs it with ``--quick`` (no largest tensor, fewer
DDP steps, a smoke-sized throughput run) so that the command works the first time a GPU is lent.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Stage:
    name: str
    status: str = "not run"  # passed, failed, not run, report
    seconds: float = 0.0
    details: list[str] = field(default_factory=list)
    data: dict = field(default_factory=dict)


class Check:
    """Runs the stages within ``budget`` seconds of the start and keeps their records."""

    def __init__(self, budget: float) -> None:
        self.started = time.perf_counter()
        self.budget = budget
        self.stages: list[Stage] = []

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.started)

    def run(self, name: str, body, *, needs: float = 10.0) -> Stage:
        """Run ``body(stage)`` unless fewer than ``needs`` seconds are left; an exception fails the
        stage (with its traceback) and the check goes on."""
        stage = Stage(name)
        self.stages.append(stage)
        if self.left() < needs:
            stage.details.append(f"not run: {self.left():.0f} s of the budget left, the stage needs about {needs:.0f}")
            print(f"[device check] {name}: not run (budget)", flush=True)
            return stage
        print(f"[device check] {name} ...", flush=True)
        begin = time.perf_counter()
        try:
            body(stage)
            if stage.status == "not run":
                stage.status = "passed"
        except Exception:
            stage.status = "failed"
            stage.details.append(traceback.format_exc()[-4000:])
        stage.seconds = round(time.perf_counter() - begin, 1)
        print(f"[device check] {name}: {stage.status} in {stage.seconds} s", flush=True)
        return stage


def environment(stage: Stage, device: torch.device) -> None:
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cuda available": torch.cuda.is_available(), "cpus": os.cpu_count(),
            "torch threads": torch.get_num_threads(), "device": str(device)}
    if device.type == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu memory GiB"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
        try:  # a tuple in recent releases, an int in older ones
            version = torch.cuda.nccl.version()
            info["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except Exception as err:
            info["nccl"] = f"unknown ({type(err).__name__})"
    for module in ("numba", "numpy", "hypothesis", "mpi4py", "horovod"):
        spec = importlib.util.find_spec(module)
        info[module] = None if spec is None else _version(module)
    stage.data = info
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda, but torch sees no CUDA device")


def _version(module: str) -> str:
    try:
        return getattr(__import__(module), "__version__", "present")
    except Exception as err:  # present but broken (Horovod without its extension, say)
        return f"present, import fails: {type(err).__name__}: {err}"


def zoo_in_process(stage: Stage, device: torch.device, quick: bool, check: Check) -> None:
    from grace_legacy.runtime import paths
    from tests import two_phase
    from tests import zoo_in_process as zoo
    from tests.registry import zoo_cases

    names = [name for name in zoo.TENSORS if not (quick and name == "huge.weight")]
    # Every case runs all its steps even when quick: Threshold's empty-payload cases need them to
    # see a tensor empty on one rank and not the other.
    runs = [(case.label, lambda case=case: zoo.run_case(case, world=2, device=device, names=names))
            for case in zoo_cases()]
    runs += [(f"scatter-gather {label}", lambda label=label: zoo.run_two_phase_case(label, world=3, device=device))
             for label in sorted(two_phase.SETUPS)]
    timings = {}
    with paths.device_path(True):  # CPU tensors too take the device's path
        for label, run in runs:
            if check.left() < 5:
                stage.details.append(f"{label}: not run (budget)")
                stage.status = "failed"
                continue
            begin = time.perf_counter()
            failures = run()
            timings[label] = round(time.perf_counter() - begin, 2)
            stage.details += failures
            if failures:
                stage.status = "failed"
    stage.data = {"cases": len(timings), "seconds per case": timings}


def same_payloads(stage: Stage, device: torch.device) -> None:
    from grace_legacy.runtime import paths
    from tests.registry import ENTRIES

    stage.status = "report"
    rows = {}
    generator = torch.Generator().manual_seed(7)
    tensor = torch.randn(257, 301, generator=generator)
    for entry in ENTRIES:
        results = []
        # The device's tensors against the CPU's along the same formulas; on a CPU, the device
        # path against the CPU's own (compiled loops, numpy packing).
        for where, device_path in ((torch.device("cpu"), device.type != "cpu"), (device, True)):
            compressor = entry.typical()
            compressor.set_rank(1)
            x = tensor.to(where)
            with paths.device_path(device_path):
                concrete = compressor.compressor_for(x, "w")
                payload, ctx = concrete.compress(x, "w")
                for _ in range(concrete.traits.rounds - 1):
                    payload, ctx = concrete.next_round(payload, ctx)
                results.append([*payload, concrete.decompress(payload, ctx)])
        cpu, there = results
        same = [torch.equal(a, b.cpu()) for a, b in zip(cpu, there, strict=True)]
        if all(same):
            rows[entry.name] = "identical"
        else:
            worst = max(((a.double() - b.cpu().double()).abs().max().item()
                         for a, b in zip(cpu, there, strict=True) if not torch.equal(a, b.cpu())), default=0.0)
            differing = [i for i, s in enumerate(same) if not s]
            rows[entry.name] = f"parts {differing} differ, largest |difference| {worst:.3g}"
    stage.data = rows


def ddp(stage: Stage, device: torch.device, backend: str, ranks: int, quick: bool, timeout: float) -> None:
    from tests.helpers import free_port

    with tempfile.TemporaryDirectory() as tmp:  # the ranks' own reports; the stage keeps their failures
        _ddp(stage, device, backend, ranks, quick, timeout, free_port(), Path(tmp))


def _ddp(stage: Stage, device: torch.device, backend: str, ranks: int, quick: bool, timeout: float, port: int,
         where: Path) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
               "127.0.0.1", "--master-port", str(port), "--max-restarts", "0", "-m",
               "benchmarks.device_check.ddp_worker", "--out", str(where), "--device", device.type,
               "--backend", backend, "--steps", "2" if quick else "3", *(["--small"] if quick else [])]
    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // ranks))}
    if device.type == "cpu":
        env["GRACE_LEGACY_DEVICE_PATH"] = "1"
    try:
        result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        stage.status = "failed"
        stage.details.append(f"torchrun did not finish in {timeout:.0f} s: {(err.stdout or '')[-2000:]}")
        return
    reports = [json.loads(path.read_text()) for path in sorted(where.glob("rank*.json"))]
    stage.data = {"ranks": ranks, "backend": backend, "exit status": result.returncode,
                  "cases": len(reports[0]["cases"]) if reports else 0,
                  "seconds per case": reports[0]["seconds"] if reports else {}}
    failures = [failure for report in reports for failure in report["failures"]]
    if result.returncode != 0 or len(reports) != ranks or failures:
        stage.status = "failed"
        stage.details += failures[:40]
        if result.returncode != 0 or len(reports) != ranks:
            stage.details.append(f"torchrun exited {result.returncode} with {len(reports)} of {ranks} reports:\n"
                                 f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")


def fsdp(stage: Stage, device: torch.device, quick: bool, timeout: float) -> None:
    """grace_legacy.fsdp's test worker (``tests/distributed/fsdp_worker.py``) on two ranks with the
    model and gradients on ``device``, over Gloo: every unit's compressed reduce-scatter at every
    step against the independent reference."""
    from tests.helpers import free_port

    with tempfile.TemporaryDirectory() as where:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                   "127.0.0.1", "--master-port", str(free_port()), "--max-restarts", "0",
                   str(REPO / "tests" / "distributed" / "fsdp_worker.py"), "--out", where, "--device", device.type,
                   *(["--quick"] if quick else [])]
        path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
        env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        if device.type == "cpu":
            env["GRACE_LEGACY_DEVICE_PATH"] = "1"
        try:
            result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as err:
            stage.status = "failed"
            stage.details.append(f"torchrun did not finish in {timeout:.0f} s: {(err.stdout or '')[-2000:]}")
            return
        reports = [json.loads(report.read_text()) for report in sorted(Path(where).glob("rank*.json"))]
    checks = [check for report in reports for check in report["checks"]]
    stage.data = {"ranks": 2, "exit status": result.returncode, "checks": len(checks)}
    failures = [f"{check['name']}: {check['detail'][:400]}" for check in checks if not check["ok"]]
    if result.returncode != 0 or len(reports) != 2 or failures or not checks:
        stage.status = "failed"
        stage.details += failures[:40]
        if result.returncode != 0 or len(reports) != 2:
            stage.details.append(f"torchrun exited {result.returncode} with {len(reports)} of 2 reports:\n"
                                 f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")


def throughput(stage: Stage, device: torch.device, quick: bool, out: Path) -> None:
    from benchmarks.performance import throughput as benchmark
    from grace_legacy.runtime import paths

    with paths.device_path(True):
        result = benchmark.run(quick, 1 if quick else 5, [torch.get_num_threads()], device.type,
                               models=["ResNet-50"] if quick else None)
    command = "python -m benchmarks.device_check" + ("" if device.type == "cuda" else f" --device {device.type}")
    benchmark.write(result, out, command, markdown="gpu.md")
    models = next(iter(result["runs"].values()))["models"]
    stage.data = {model: {label: round(case["paired_speedup"], 3) for label, case in data["cases"].items()}
                  for model, data in models.items()}
    stage.status = "report"


def write(check: Check, out: Path, device: torch.device, command: str) -> bool:
    from benchmarks.common.report import update_section

    ok = all(stage.status in ("passed", "report") for stage in check.stages)
    (out / "gpu.json").write_text(json.dumps({"command": command, "device": str(device), "ok": ok,
                                              "stages": [asdict(stage) for stage in check.stages]}, indent=1))
    rows = "\n".join(f"| {stage.name} | {stage.status} | {stage.seconds:.0f} |" for stage in check.stages)
    problems = [f"- {stage.name}: " + detail.replace("\n", "\n  ") for stage in check.stages
                if stage.status == "failed" for detail in stage.details[:15]]
    environment_data = next((stage.data for stage in check.stages if stage.name == "environment"), {})
    payloads = next((stage.data for stage in check.stages if stage.name == "same payloads on the CPU"), {})
    payload_text = "; ".join(f"{name} {verdict}" for name, verdict in payloads.items()) or "not run"
    text = f"""## Device check: {environment_data.get('gpu', device.type)}

`{command}` (`scripts/device_check.sh`), {time.strftime('%Y-%m-%d %H:%M')}:
**{'every stage passed' if ok else 'FAILURES'}** in {time.perf_counter() - check.started:.0f} s.

Environment: {', '.join(f'{key} {value}' for key, value in environment_data.items())}.

| stage | status | seconds |
|---|---|---|
{rows}

{chr(10).join(problems) if problems else 'No failure.'}

Payloads and decompressed tensors on the device against the CPU's (one 257 x 301 tensor, rank 1;
on a GPU both along the device path, on a CPU the device path against the CPU's own): {payload_text}.
"""
    update_section(out / "gpu.md", "device_check", text, title="GPU results")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="where the report goes (created)")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run)")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for the whole check (default 450)")
    parser.add_argument("--quick", action="store_true", help="fewer steps, no largest tensor, a smoke throughput run")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks.device_check" + (f" --device {args.device}" if args.device != "cuda" else "") + (
        " --quick" if args.quick else "")
    check = Check(args.budget)
    from benchmarks.common.report import update_section

    update_section(args.out / "gpu.md", "device_check", "(running)", title="GPU results")  # first in the file
    check.run("environment", lambda stage: environment(stage, device), needs=0)
    if check.stages[-1].status == "failed":
        write(check, args.out, device, command)
        sys.exit(1)
    check.run("zoo in process", lambda stage: zoo_in_process(stage, device, args.quick, check), needs=30)
    check.run("same payloads on the CPU", lambda stage: same_payloads(stage, device), needs=10)
    gpu = device.type == "cuda"
    runs = [("nccl" if gpu else "gloo", 1), ("gloo", 2)]
    for backend, ranks in runs:
        # Each launch gets at most what is left, less what the throughput stage needs.
        check.run(f"ddp {backend} {ranks} rank{'s' if ranks > 1 else ''}",
                  lambda stage, b=backend, r=ranks: ddp(stage, device, b, r, args.quick,
                                                        timeout=max(30.0, check.left() - (20 if args.quick else 120))),
                  needs=40)
    check.run("fsdp gloo 2 ranks", lambda stage: fsdp(stage, device, args.quick,
                                                      timeout=max(30.0, check.left() - (20 if args.quick else 120))),
              needs=40)
    check.run("throughput", lambda stage: throughput(stage, device, args.quick, args.out),
              needs=20 if args.quick else 100)
    ok = write(check, args.out, device, command)
    print(f"[device check] report: {args.out / 'gpu.md'} ({'every stage passed' if ok else 'FAILURES'})", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
