"""Schedules of a compressor's parameter: LEGACY's tables (``legacy``, built also from the reference
flags, ``flags``, or by budget matching, ``budget``) and the adaptive DGC warm-up, Accordion and
L-GreCo; subclass :class:`~grace_legacy.schedules.base.Schedule` for one of your own."""

from grace_legacy.schedules.accordion import Accordion
from grace_legacy.schedules.base import Schedule
from grace_legacy.schedules.dgc_warmup import DGCWarmup
from grace_legacy.schedules.legacy import Legacy
from grace_legacy.schedules.lgreco import LGreCo

__all__ = ["Accordion", "DGCWarmup", "Schedule", "LGreCo", "Legacy"]
