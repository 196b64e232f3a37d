"""Compressors: each turns a gradient into a payload (a list of tensors) and back."""

from grace_legacy.compressors.dense import FP16, NoCompression
from grace_legacy.compressors.dgc import DGC
from grace_legacy.compressors.sparsify import RandomK, TopK
from grace_legacy.compressors.threshold import Threshold

__all__ = ["DGC", "FP16", "NoCompression", "RandomK", "Threshold", "TopK"]
