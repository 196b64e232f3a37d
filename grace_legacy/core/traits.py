"""What a compressor's payload allows, as one record per class: the routes, the memories and the
step's guards read it, and it is checked when the class is made, so a contradiction (two rounds
of a payload that cannot be summed) fails at import, not in the middle of a job."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Traits:
    """A compressor class declares its traits once: ``traits = Traits(additive=True)``; the
    defaults describe a lossy, gathered, one-round payload of any compressor."""

    #: ``D(sum_r p_r) == sum_r D(p_r)``, ctx alike on every rank: payloads are summed, not gathered
    additive: bool = False
    #: every rank's payload has the same shapes for a tensor and step (a gather needs no header)
    uniform_payload: bool = True
    #: ``D(C(x)) == x`` exactly: error feedback keeps nothing
    lossless: bool = False
    #: the payload carries the input's own entries at ``support``, unscaled (``x - D(C(x))`` is
    #: ``x`` with them zeroed)
    sends_entries: bool = False
    #: an inf or NaN given to compress is always sent, so every rank's aggregate shows it
    delivers_nonfinite: bool = False
    #: aggregate is the sum (mean) of the decoded payloads, so sending dense is its exact limit
    aggregates_by_mean: bool = True
    #: allreduces of an additive payload; ``next_round`` makes each next one (PowerSGD: P, Q)
    rounds: int = 1
    #: entry by entry and stateless: the payload is one part, ctx a function of the input's dtype
    #: alone, and compressing tensors back to back in one flat gives their payloads back to back
    #: (``decompress_flat`` decodes them at once), so a whole bucket can go as one tensor
    elementwise: bool = False
    #: one selection over every gradient of the step: the bundle holds a step's tensors and
    #: compresses their concatenation once (``GlobalTopK``, ``CAT``; communicators/fusion.py)
    spans_step: bool = False
    #: a part of a tensor may be compressed as a tensor of its own (a scatter-gather's segments);
    #: ``False`` where the compressor needs what it knows of the whole tensor (per-sample moments)
    shardable: bool = True

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            wanted = int if field.name == "rounds" else bool
            if type(value) is not wanted:
                raise TypeError(f"Traits: {field.name} must be {wanted.__name__}, got {value!r}")
        if self.rounds < 1:
            raise ValueError(f"Traits: rounds must be at least 1, got {self.rounds}")
        if self.rounds > 1 and not self.additive:
            raise ValueError("Traits: rounds > 1 needs additive=True (each round is an allreduce of a sum)")
        if self.elementwise and not (self.additive and self.uniform_payload):
            raise ValueError("Traits: elementwise needs additive=True and uniform_payload=True (a bucket goes "
                             "as one summed tensor)")
        if self.spans_step and (self.elementwise or self.rounds > 1):
            raise ValueError("Traits: spans_step excludes elementwise and rounds > 1")


#: The names of the traits, which a compressor class no longer sets one by one.
NAMES = tuple(field.name for field in fields(Traits))

#: What a class must define for a trait it declares (the checks at class creation).
NEEDS = {"sends_entries": "support", "elementwise": "decompress_flat", "rounds": "next_round"}
