"""Schedules of a compressor's parameter: LEGACY's fixed tables and the adaptive schedules.

Each wraps a compressor built without its parameter and, per tensor and step, names the value to use
(:class:`~grace_legacy.schedules.base.Schedule`, the base to subclass for a schedule of your
own). LEGACY (``legacy``) reads it from a table of layer size and training phase; its reference
flags (``flags``) and budget matching (``budget``) are other ways to build that table. DGC's
warm-up, Accordion and L-GreCo choose it as training goes.
"""

from grace_legacy.schedules.accordion import Accordion
from grace_legacy.schedules.base import Schedule
from grace_legacy.schedules.dgc_warmup import DGCWarmup
from grace_legacy.schedules.legacy import Legacy
from grace_legacy.schedules.lgreco import LGreCo

__all__ = ["Accordion", "DGCWarmup", "Schedule", "LGreCo", "Legacy"]
