"""Foundation checks, run on every rank under horovodrun.

For each compression configuration the worker trains a small model for a few steps through the
*stock* ``hvd.DistributedOptimizer`` and, at every step, compares the synchronized gradient of
every parameter with a reference computed here from each rank's own local gradient (obtained by
a separate autograd pass and exchanged with a plain, uncompressed allgather).
"""

from __future__ import annotations

import time

import horovod.torch as hvd
import torch
from horovod.common.exceptions import HorovodInternalError

import grace_legacy
from grace_legacy import FP16, Allgather, Broadcast, Grace, NoCompression, NoMemory, RandomK, Residual, TopK
from grace_legacy.backends.horovod import HorovodBackend
from grace_legacy.optimizer import bundle_of
from tests.distributed.checks import (
    Recorder,
    kept,
    parse_args,
    randomk_indices_reference,
    topk_contribution,
    topk_goes_dense,
)
from tests.distributed.harness import STEPS, Net, mean_over_ranks, train_and_compare

RATIO = 0.05


def main() -> None:
    args = parse_args()
    hvd.init(process_sets="dynamic")
    torch.set_num_threads(1)
    rec = Recorder(args.out)
    size = hvd.size()

    def topk_gathered(p):
        return not topk_goes_dense(p.numel(), RATIO, size)

    def topk_bytes(p):
        return 4 * p.numel() if topk_goes_dense(p.numel(), RATIO, size) else 8 * kept(RATIO, p.numel())

    rec.check("hvd.DistributedOptimizer is grace_legacy's after import",
              hvd.DistributedOptimizer is grace_legacy.optimizer.DistributedOptimizer)

    # Top-k without memory: mean over ranks of each rank's own top-k (the whole tensor where the
    # dense fallback applies: tensors too small for a gather to beat an allreduce). The gather
    # route is named: from 3 ranks the default is the scatter-gather, whose reference is
    # tests/two_phase.py (scatter_gather_worker.py).
    topk = Grace(TopK(RATIO), memory=NoMemory(), communicator=Allgather())
    rec.guard("topk/no-memory", train_and_compare, rec, "topk/no-memory", topk,
              mean_over_ranks(lambda n, g, s: topk_contribution(g, RATIO, size)),
              expected_bytes=topk_bytes, gathered=topk_gathered)

    # Top-k with op=Sum and with gradient accumulation over two backward passes.
    rec.guard("topk/sum", train_and_compare, rec, "topk/sum",
              Grace(TopK(RATIO), memory=NoMemory(), communicator=Allgather()),
              mean_over_ranks(lambda n, g, s: topk_contribution(g, RATIO, size), op=hvd.Sum), op=hvd.Sum)
    rec.guard("topk/bpps2", train_and_compare, rec, "topk/bpps2",
              Grace(TopK(RATIO), memory=NoMemory(), communicator=Allgather()),
              mean_over_ranks(lambda n, g, s: topk_contribution(g, RATIO, size)), passes=2)

    # Top-k with error feedback: the test carries its own residuals.
    residual_ref: dict[str, torch.Tensor] = {}

    def topk_residual(name, grad, step):
        compensated = grad + residual_ref.get(name, torch.zeros_like(grad))
        sent = topk_contribution(compensated, RATIO, size)
        if sent is compensated:  # sent dense: nothing left behind
            residual_ref.pop(name, None)
        else:
            residual_ref[name] = compensated - sent
        return sent

    topk_ef = Grace(TopK(RATIO), memory=Residual(), communicator=Allgather())
    rec.guard("topk/residual", train_and_compare, rec, "topk/residual", topk_ef, mean_over_ranks(topk_residual))
    for name, expected in residual_ref.items():
        rec.close(topk_ef.memory.residuals[name], expected, f"topk/residual: carried residual {name}")

    # A bare compressor gets its recommended memory (Residual for Top-k) and the default route, and
    # its bundle keeps the stats: it trains bit for bit as the bundle written out does.
    def bare_is_the_default_bundle() -> None:
        bare = TopK(RATIO)
        trained = train_and_compare(rec, "topk/bare", bare, None)
        written = train_and_compare(rec, "topk/bare bundle", Grace(TopK(RATIO), memory=Residual()), None)
        rec.check("topk/bare: trains as Grace(TopK, memory=Residual())",
                  all(torch.equal(a, b) for a, b in zip(trained.parameters(), written.parameters(), strict=True)))
        stats = bundle_of(bare).stats  # the bundle the optimizer built around it
        rec.check("topk/bare: its bundle keeps stats", stats["tensors"] == STEPS * len(list(trained.parameters())),
                  str(stats["tensors"]))
        # The gather route at any number of ranks, whose reference the mean of the ranks' top-k is.
        residual_ref.clear()
        train_and_compare(rec, f"topk/bare at {size} ranks", TopK(RATIO), mean_over_ranks(topk_residual),
                          expected_bytes=topk_bytes, gathered=topk_gathered)

    rec.guard("topk/bare", bare_is_the_default_bundle)

    # Random-k: indices from the documented (seed, name, step) rule, identical on every rank.
    def randomk_mask(name, grad, step):
        flat = grad.reshape(-1)
        idx = randomk_indices_reference(7, name, step, flat.numel(), RATIO)
        out = torch.zeros_like(flat)
        out[idx] = flat[idx]
        return out.view(grad.shape)

    rec.guard("randomk", train_and_compare, rec, "randomk", Grace(RandomK(RATIO, seed=7), memory=NoMemory()),
              mean_over_ranks(randomk_mask), expected_bytes=lambda p: 4 * kept(RATIO, p.numel()))

    # FP16 and NoCompression.
    # Horovod sums fp16 payloads in fp16, rounding at each addition: compare at fp16 precision.
    rec.guard("fp16", train_and_compare, rec, "fp16", FP16(), mean_over_ranks(lambda n, g, s: g.half().float()),
              expected_bytes=lambda p: 2 * p.numel(), rtol=2e-3, atol=1e-4)
    none = NoCompression()
    rec.guard("none", train_and_compare, rec, "none", none, mean_over_ranks(lambda n, g, s: g),
              expected_bytes=lambda p: 4 * p.numel())

    # Horovod's own compression classes take Horovod's own path, unchanged.
    rec.guard("hvd.Compression.none", train_and_compare, rec, "hvd.Compression.none", hvd.Compression.none,
              mean_over_ranks(lambda n, g, s: g))
    torch.manual_seed(0)
    plain = hvd.DistributedOptimizer(torch.optim.SGD(Net().parameters(), lr=0.1), compression=hvd.Compression.fp16)
    rec.check("hvd.Compression.fp16 keeps Horovod's allreduce path",
              "grace" not in plain._allreduce_grad_async.__qualname__ and not hasattr(plain, "_grace"))

    # Process sets: each half of the ranks averages only among itself.
    if size >= 4 and size % 2 == 0:
        half = size // 2
        lower = hvd.add_process_set(list(range(half)))
        upper = hvd.add_process_set(list(range(half, size)))
        mine = lower if hvd.rank() < half else upper
        rec.guard("topk/process-set", train_and_compare, rec, "topk/process-set",
                  Grace(TopK(RATIO), memory=NoMemory(), communicator=Allgather()),
                  mean_over_ranks(lambda n, g, s: topk_contribution(g, RATIO, half), process_set=mine),
                  process_set=mine)
        # Broadcast's roots are ranks *within* the set: the upper half has no global rank 0.
        rec.guard("topk/broadcast/process-set", train_and_compare, rec, "topk/broadcast/process-set",
                  Grace(TopK(RATIO), memory=NoMemory(), communicator=Broadcast()),
                  mean_over_ranks(lambda n, g, s: topk_contribution(g, RATIO, half), process_set=mine),
                  process_set=mine)
        hvd.remove_process_set(lower)
        hvd.remove_process_set(upper)

    # What compressed payloads cannot honour fails at construction.
    model = Net()
    for label, kwargs in [("op=Adasum", {"op": hvd.Adasum}), ("groups", {"groups": 2}),
                          ("backward_passes_per_step=0", {"backward_passes_per_step": 0})]:
        try:
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters(), compression=TopK(RATIO), **kwargs)
        except ValueError as err:
            rec.check(f"{label} is refused", True, str(err))
        else:
            rec.check(f"{label} is refused", False, "no ValueError")
    check_backend_waits(rec)
    rec.write()


#: How long rank 0 keeps the others waiting, and the most main-thread CPU time they may spend on it.
LATE_S = 1.0
WAITING_CPU_S = 0.25


def check_backend_waits(rec: Recorder) -> None:
    """The backend's wait gives its core away: ranks kept waiting a second by a late rank spend
    a fraction of that in CPU time (Horovod's own wait spins through all of it), and still get
    the right result; a collective that fails raises on every rank instead of hanging."""
    backend = HorovodBackend()
    if hvd.rank() == 0:
        time.sleep(LATE_S)
    started, cpu = time.perf_counter(), time.thread_time()
    total = backend.wait(backend.allreduce_async(torch.full((3,), float(hvd.rank())), "late", average=False))
    waited, spent = time.perf_counter() - started, time.thread_time() - cpu
    rec.equal(total, torch.full((3,), float(sum(range(hvd.size())))), "wait: the late allreduce's sum")
    if hvd.rank() != 0:
        rec.check("wait: a waiting rank sleeps", waited > 0.5 * LATE_S and spent < WAITING_CPU_S,
                  f"waited {waited:.3f} s using {spent:.3f} s of CPU")
    mismatched = torch.zeros(2 + hvd.rank())
    try:
        backend.wait(backend.allreduce_async(mismatched, "mismatched", average=False))
    except HorovodInternalError as err:
        rec.check("wait: a failed collective raises", "Mismatched" in str(err), str(err)[:300])
    else:
        rec.check("wait: a failed collective raises", False, "no HorovodInternalError")


if __name__ == "__main__":
    main()
