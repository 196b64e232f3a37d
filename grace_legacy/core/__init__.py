"""The interfaces every layer implements or talks to, and the primitives they share.

Data flows one way through a training step, for every gradient tensor ``g`` named ``name``:

    compensated = memory.compensate(g, name)            # e.g. g + e  (error feedback)
    c           = compressor.compressor_for(compensated, name)  # None: send it uncompressed
    payload, ctx = c.compress(compensated, name)         # list of tensors + rank-local context
    memory.update(compensated, name, c, payload, ctx)    # e.g. e <- compensated - D(payload)
    pending     = communicator.start(payload, ctx, name, c, backend, average)
    g_sync      = pending()                              # waits, then aggregates

``payload`` is the only thing that leaves the rank; ``ctx`` never does. A compressor knows nothing
of Horovod or torch.distributed, a communicator knows a compressor only through its interface
(``decompress``/``aggregate``), and a backend moves tensors without knowing what they mean. This
package imports nothing else of grace_legacy, so every other layer can import it.
"""

from grace_legacy.core.backend import Backend, Pending
from grace_legacy.core.communicator import Communicator
from grace_legacy.core.compressor import Compressor, Payload
from grace_legacy.core.memory import Memory, NoMemory
from grace_legacy.core.parameter import ScheduledParameter

__all__ = ["Backend", "Communicator", "Compressor", "ScheduledParameter", "Memory", "NoMemory", "Payload", "Pending"]
