"""The machinery the layers share: wire layout, byte-cost model, traffic accounting, buffer reuse,
stall detection, argument checks. It builds on :mod:`grace_legacy.core` and nothing above it."""
