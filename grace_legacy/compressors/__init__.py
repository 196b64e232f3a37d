"""Compressors: each turns a gradient into a payload (a list of tensors) and back."""

from grace_legacy.compressors.dense import FP16, NoCompression
from grace_legacy.compressors.dgc import DGC
from grace_legacy.compressors.powersgd import PowerSGD
from grace_legacy.compressors.quantize import QSGD, Natural, TernGrad
from grace_legacy.compressors.sign import EFSignSGD, OneBit, SignSGD, Signum
from grace_legacy.compressors.sparsify import RandomK, TopK
from grace_legacy.compressors.threshold import Threshold

__all__ = [
    "DGC",
    "EFSignSGD",
    "FP16",
    "Natural",
    "NoCompression",
    "OneBit",
    "PowerSGD",
    "QSGD",
    "RandomK",
    "SignSGD",
    "Signum",
    "TernGrad",
    "Threshold",
    "TopK",
]
