"""A rank that stops taking part without dying: after two steps, rank ``--victim`` sends itself
``SIGSTOP`` just before its third backward pass. Every other rank must raise ``RanksStalled``
from its third ``step()`` once its wait reaches the stall timeout; each writes what it caught to
``rank<r>.json``, waits for the others' reports, and ends its process with ``os._exit`` (Horovod's
own shutdown at exit would wait for the stopped rank). Every rank first writes its process id to ``pid<r>``, and the
victim the time it stopped to ``stopped.json``, so that the test can time the errors and clean up.
"""

from __future__ import annotations

import json
import os
import signal
import time

import horovod.torch as hvd
import torch

from grace_legacy import Grace, RanksStalled, Residual, TopK
from tests.distributed.checks import parse_args
from tests.distributed.harness import Net, batch, loss_of


def main() -> None:
    args = parse_args([(("--victim",), {"type": int, "required": True}),
                       (("--stall-timeout",), {"type": float, "default": None})])
    hvd.init()
    torch.set_num_threads(1)
    rank = hvd.rank()
    (args.out / f"pid{rank}").write_text(str(os.getpid()))
    torch.manual_seed(0)
    model = Net()
    # No --stall-timeout: the bundle reads GRACE_LEGACY_STALL_TIMEOUT, which the test sets.
    compression = Grace(TopK(0.1), memory=Residual(), stall_timeout=args.stall_timeout)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), compression=compression)
    for step in range(3):
        if step == 2 and rank == args.victim:
            (args.out / "stopped.json").write_text(json.dumps({"time": time.time()}))
            os.kill(os.getpid(), signal.SIGSTOP)
        opt.zero_grad()
        loss_of(model, batch(step, rank)).backward()
        try:
            opt.step()
        except RanksStalled as err:
            report = {"raised_at": time.time(), "step": step, "message": str(err), "stalled": err.stalled_ranks,
                      "tensors": err.tensors, "waited_s": err.waited_s, "timeout_s": compression.stall_timeout,
                      "parameters": [name for name, _ in model.named_parameters()]}
            (args.out / f"rank{rank}.json").write_text(json.dumps(report))
            # Stay until every other running rank has caught its own error: a rank that exits
            # first shuts Horovod down under the ones still waiting, which then see Horovod's
            # shutdown error instead of reaching their own stall timeout.
            others = [r for r in range(hvd.size()) if r not in (rank, args.victim)]
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not all((args.out / f"rank{r}.json").exists() for r in others):
                time.sleep(0.1)
            os._exit(3)
    (args.out / f"rank{rank}.json").write_text(json.dumps({"raised_at": None, "step": 3}))


if __name__ == "__main__":
    main()
