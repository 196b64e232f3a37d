"""Compressors: each turns a gradient into a payload (a list of tensors) and back."""

from grace_legacy.compressors.dense import FP16, NoCompression
from grace_legacy.compressors.sign import EFSignSGD, OneBit, SignSGD, Signum
from grace_legacy.compressors.sparsify import RandomK, TopK

__all__ = ["FP16", "EFSignSGD", "NoCompression", "OneBit", "RandomK", "SignSGD", "Signum", "TopK"]
