"""How a torchrun benchmark worker that runs PyTorch's own collectives (DDP's allreduce and hooks, FSDP2's
all-gathers) ends.

Those keep a hazard at exit that grace_legacy's backends lend their way around
(docs/DESIGN.md#clean-exit): a Gloo worker thread that lets go of a finished collective while the
interpreter finalizes takes the GIL and aborts the process ("terminate called without an active
exception"), and torchrun then reports the run failed. A benchmark worker has written its results
by the time it ends, so it ends without finalizing the interpreter.
"""

from __future__ import annotations

import os
import sys


def end_worker() -> None:
    """Leave the process group and end the process at once, with exit status 0."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
