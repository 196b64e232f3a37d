"""Many workers in one process: a model trained as ``W`` data-parallel workers, each running the
library's own compression code, the aggregate the bits real ranks would compute
(docs/SIMULATION.md)."""

from grace_legacy.simulate.data import Shards, participants
from grace_legacy.simulate.gradients import WorkerGradients
from grace_legacy.simulate.lockstep import Deadlock, LockStep
from grace_legacy.simulate.simulation import Simulation
from grace_legacy.simulate.step import plan_buckets, synchronize
from grace_legacy.simulate.sums import REDUCTIONS
from grace_legacy.simulate.world import SimulatedBackend, SimulatedWorld

__all__ = ["REDUCTIONS", "Deadlock", "LockStep", "Shards", "SimulatedBackend", "SimulatedWorld", "Simulation",
           "WorkerGradients", "participants", "plan_buckets", "synchronize"]
