"""Every rank's copy of a tensor under ``torch.distributed``, for the checks of workers that run
without Horovod as well as with it (the DDP test workers, the device check's DDP worker)."""

from __future__ import annotations

import torch

from grace_legacy.backends.torch_distributed import TorchDistributedBackend


def torch_gather_from_ranks(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's copy of ``tensor`` under ``torch.distributed``, through grace_legacy's backend,
    which keeps what it hands a collective until no work holds it: a plain ``dist.all_gather`` as a
    worker's last collective can abort the process at exit (docs/GUARANTEES.md#clean-exit)."""
    backend = TorchDistributedBackend()
    rows = backend.wait(backend.allgather_async(tensor.detach().reshape(1, -1).clone(), "reference"))
    return [row.view(tensor.shape) for row in rows]
