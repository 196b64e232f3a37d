"""The machinery the layers share: the wire layout, the byte-cost model, traffic accounting,
buffer reuse, stall detection and argument checks. It builds on :mod:`grace_legacy.core` and on
nothing above it."""
