"""Compressors: one module per compressor or close family, what a family shares beside it
(``entries``, ``quantization``, ``signs``), their inner loops in ``kernels``."""

from grace_legacy.compressors.adacomp import AdaComp
from grace_legacy.compressors.adaq import AdaQ
from grace_legacy.compressors.cat import CAT
from grace_legacy.compressors.dense import BF16, FP16, NoCompression
from grace_legacy.compressors.dgc import DGC
from grace_legacy.compressors.efsignsgd import EFSignSGD
from grace_legacy.compressors.global_topk import GlobalTopK
from grace_legacy.compressors.inceptionn import INCEPTIONN
from grace_legacy.compressors.natural import Natural
from grace_legacy.compressors.onebit import OneBit
from grace_legacy.compressors.powersgd import PowerSGD
from grace_legacy.compressors.qsgd import QSGD
from grace_legacy.compressors.randomk import RandomK
from grace_legacy.compressors.signsgd import SignSGD, Signum
from grace_legacy.compressors.sketch import Sketch
from grace_legacy.compressors.terngrad import TernGrad
from grace_legacy.compressors.threshold import Threshold
from grace_legacy.compressors.topk import TopK
from grace_legacy.compressors.u8bit import U8bit
from grace_legacy.compressors.variance import VarianceSparsifier

__all__ = ["CAT", "AdaComp", "AdaQ", "BF16", "DGC", "EFSignSGD", "FP16", "GlobalTopK", "INCEPTIONN", "Natural",
           "NoCompression", "OneBit", "PowerSGD", "QSGD", "RandomK", "SignSGD", "Signum", "Sketch", "TernGrad",
           "Threshold", "TopK", "U8bit", "VarianceSparsifier"]
