"""The planner: what a compression set-up will put on the links, before training.

* :mod:`~grace_legacy.planner.plan`: per phase and size group, the tensors, the parameter value,
  the routes a :class:`~grace_legacy.Grace` bundle takes at a number of workers and the link bytes
  per step (:func:`plan`), exactly what the bundle's ``stats`` record;
* :mod:`~grace_legacy.planner.timing`: the same over 4 to 1024 workers (:func:`scaling`) and an
  alpha-beta estimate of a step's link time (:func:`link_time`);
* :mod:`~grace_legacy.planner.report`: the text and the picture ``python -m grace_legacy plan``
  prints and draws;
* :mod:`~grace_legacy.planner.models`: the shapes of a model named on the command line
  (:func:`model_shapes`).
"""

from grace_legacy.planner.models import model_shapes
from grace_legacy.planner.plan import (
    AUTO,
    DEFAULT_WORKERS,
    FORCED_ROUTES,
    WORKER_COUNTS,
    Cell,
    Plan,
    TensorPlan,
    plan,
    segment_runs,
)
from grace_legacy.planner.report import format_link_times, format_plan, format_scaling, plot_scaling
from grace_legacy.planner.timing import (
    LinkTime,
    Scaling,
    collective_steps,
    link_time,
    routes_for,
    scaling,
    step_time,
)

__all__ = ["AUTO", "DEFAULT_WORKERS", "FORCED_ROUTES", "WORKER_COUNTS", "Cell", "LinkTime", "Plan", "Scaling",
           "TensorPlan", "collective_steps", "format_link_times", "format_plan", "format_scaling", "link_time",
           "model_shapes", "plan", "plot_scaling", "routes_for", "scaling", "segment_runs", "step_time"]
