"""Whole-model Top-k: one selection over every gradient of the step."""

from __future__ import annotations

from typing import Any

import torch

from grace_legacy.compressors.entries import kept_count
from grace_legacy.compressors.kernels.selection import top_k_first
from grace_legacy.compressors.sparse import SparseContext, index_dtype
from grace_legacy.compressors.topk import TopK
from grace_legacy.core.compressor import Payload
from grace_legacy.core.traits import Traits
from grace_legacy.runtime.validation import check_gradient


class GlobalTopK(TopK):
    """Top-k over the whole model (the compressor of Sahu et al., NeurIPS 2021, "Rethinking
    gradient sparsification as total error minimization", and the LEGACY reference's
    ``GlobalTopKReducer``): every gradient of the step laid end to end, in the order of their
    names, is one vector ``x`` of ``n`` entries, and the ``k = max(1, floor(ratio * n))`` entries
    of largest magnitude are sent, ties at the k-th magnitude to the lower position (NaN, then
    infinity first). So each layer's density is whatever share of the model's largest entries it
    holds this step, with no per-layer setting. With ``Residual`` (recommended) the residual is
    the model's: ``e <- x - D(C(x))``. Payload and aggregate as :class:`TopK`'s: ``[values,
    increasing indices into x]``, gathered, each rank's entries summed (averaged) exactly.

    ``ratio`` is read as the decimal written (``kept_count``), where the reference computes
    ``int(ratio * n)`` in floating point: the two differ by one entry only when ``ratio * n`` is a
    whole number that the float product misses.

    What it costs: the bundle holds the step's gradients until the first result is asked for
    (:meth:`grace_legacy.communicators.fusion.Fusion.hold_for_step`), i.e. until the backward pass
    has ended, then copies them into one flat, selects and sends one payload. Nothing is compressed or sent while the
    backward pass runs, so the overlap of communication with the backward pass that per-layer
    compressors get (a bucket leaves as soon as it is full) is given up entirely, and the flat's
    copy and one selection over ``n`` entries are added after it. ``Legacy(GlobalTopK(),
    by="epoch", ...)`` schedules the ratio by phase; by layer is refused (one selection spans
    every layer)."""

    traits = Traits(sends_entries=True, delivers_nonfinite=True, spans_step=True)

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        check_gradient(tensor, "GlobalTopK")
        self.check_ready()
        flat = tensor.reshape(-1)
        indices = top_k_first(flat, kept_count(self.ratio, flat.numel()))
        values = flat.index_select(0, indices)
        ctx = SparseContext(tensor.shape, flat.numel(), tensor.dtype, tensor.device)
        return [values, indices.to(index_dtype(flat.numel()))], ctx
