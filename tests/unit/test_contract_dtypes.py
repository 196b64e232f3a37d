"""Every compressor of the registry, with every memory it accepts, takes float16 and bfloat16
gradients (those of a model trained in that dtype) exactly as its reference computes them in that
dtype, or refuses them with a ``TypeError`` naming the dtype (:data:`REFUSED` lists which; none
does today).

On two in-process ranks, over steps of gradients of every awkward size (values whose squares
overflow float16, magnitudes from 1e-6 to 300, a tensor of one element), each rank's synchronized
gradient must equal, bit for bit but for the sign of zeros, what the twins compute: each rank's
own compressor and memory built apart (the entry's independent reference where the registry has
one, ``Entry.reference``) compress its gradient; the payloads are summed part by part in rank
order in their own dtype and decoded (additive payloads, round after round), or decoded and
combined in rank order by the compressor's rule (a mean, or a majority vote); the memory turns
that into the gradient. Every tensor of each rank's memory state must equal its twin's after each
step. The dense fallback is off, so that every tensor is really compressed in the dtype."""

from __future__ import annotations

import pytest
import torch

from grace_legacy import Grace
from grace_legacy.grace import _DENSE
from tests.helpers import ThreadBackend, run_ranks
from tests.reference import majority_vote_rule, mean_rule, per_gradient, step_units
from tests.registry import ENTRIES, MEMORIES, OWN_MEMORY, case_bundle
from tests.unit.test_contract_undo import tensors_of

DTYPES = [torch.float16, torch.bfloat16]
RANKS = 2
#: (name, shape, scale) of the tensors of one step: 300 squared overflows float16's 65504.
TENSORS = [("weight", (12, 10), 1.0), ("large", (40,), 300.0), ("wide", (7, 6), None), ("one", (1,), 1.0)]
STEPS = 3
#: Set-ups (``"<entry label>+<memory>"``) that refuse a dtype, with the dtypes they refuse.
REFUSED: dict[str, set[torch.dtype]] = {}


def setups() -> list[tuple[str, object, object, object]]:
    """(label, compressor factory, twin factory, memory factory) of each entry with every memory it
    accepts; the twin is the entry's independent reference where it has one."""
    out = []
    for entry in ENTRIES:
        twin = entry.reference or entry.typical
        for m_label, make_memory in MEMORIES.items():
            owner = OWN_MEMORY.get(m_label)
            if owner is not None and entry.compressor is not owner:
                continue
            try:
                Grace(entry.typical(), memory=make_memory())
            except ValueError:
                continue
            out.append((f"{entry.label}+{m_label}", entry.typical, twin, make_memory))
    return out


SETUPS = setups()


def gradient(shape: tuple[int, ...], scale: float | None, step: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + len(shape))
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    if scale is None:  # magnitudes from 1e-6 to 100
        x *= torch.pow(10.0, torch.randint(-6, 3, shape, generator=g).double())
    else:
        x *= scale
    return x.to(dtype)


def library(make, make_memory, dtype: torch.dtype) -> list[list[dict]]:
    """Each rank's results per step: ``{"result": {name: tensor}, "memory": {key: tensor}}``."""
    bundles = [case_bundle(make(), make_memory(), dense_fallback=False) for _ in range(RANKS)]

    def body(backend: ThreadBackend) -> list[dict]:
        bundle, rank = bundles[backend.rank()], backend.rank()
        steps = []
        for step in range(STEPS):
            pending = {name: bundle.start(gradient(shape, scale, step, rank, dtype), name, backend, average=True)
                       for name, shape, scale in TENSORS}
            result = {name: finish() for name, finish in pending.items()}
            bundle.end_step(backend)
            steps.append({"result": result, "memory": tensors_of(bundle.memory.state_dict())})
        return steps

    return run_ranks(RANKS, body)


def reduced_in_rank_order(parts_per_rank: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Each part summed over the ranks in rank order in its own dtype, then divided by the ranks."""
    out = []
    for parts in zip(*parts_per_rank, strict=True):
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        total /= len(parts)
        out.append(total)
    return out


def twins(make_twin, make_memory, dtype: torch.dtype, spans_step: bool = False) -> list[list[dict]]:
    """What the twins compute, rank by rank, with the same results layout as :func:`library`
    (``spans_step``: the step's tensors compressed end to end, :func:`tests.reference.step_units`)."""
    compressors = [make_twin() for _ in range(RANKS)]
    memories = [make_memory() for _ in range(RANKS)]
    for rank, compressor in enumerate(compressors):
        compressor.set_rank(rank)
    out: list[list[dict]] = [[] for _ in range(RANKS)]
    for step in range(STEPS):
        results: list[dict] = [{} for _ in range(RANKS)]
        local = [{name: gradient(shape, scale, step, rank, dtype) for name, shape, scale in TENSORS}
                 for rank in range(RANKS)]
        units = [step_units(local[rank], spans_step) for rank in range(RANKS)]
        for index, (name, _, _) in enumerate(units[0]):
            grads = [units[rank][index][1] for rank in range(RANKS)]
            compensated = [memories[r].compensate(grads[r], name) for r in range(RANKS)]
            concrete = [compressors[r].compressor_for(compensated[r], name) for r in range(RANKS)]
            if concrete[0] is None:
                for r in range(RANKS):
                    memories[r].update(compensated[r], name, _DENSE, [compensated[r]], None)
                combined = mean_rule(compensated)
            elif concrete[0].traits.additive:
                sent = [concrete[r].compress(compensated[r], name) for r in range(RANKS)]
                reduced = reduced_in_rank_order([payload for payload, _ in sent])
                contexts = [ctx for _, ctx in sent]
                for _ in range(1, concrete[0].traits.rounds):
                    sent = [concrete[r].next_round(reduced, contexts[r]) for r in range(RANKS)]
                    contexts = [ctx for _, ctx in sent]
                    reduced = reduced_in_rank_order([payload for payload, _ in sent])
                for r in range(RANKS):
                    memories[r].update(compensated[r], name, concrete[r], sent[r][0], contexts[r])
                    if concrete[r].traits.rounds > 1:
                        concrete[r].end_exchange(reduced, contexts[r])
                combined = concrete[0].decompress(reduced, contexts[0])
            else:
                sent = [concrete[r].compress(compensated[r], name) for r in range(RANKS)]
                for r in range(RANKS):
                    memories[r].update(compensated[r], name, concrete[r], *sent[r])
                decoded = [concrete[r].decompress(*sent[r]) for r in range(RANKS)]
                rule = mean_rule if concrete[0].traits.aggregates_by_mean else majority_vote_rule
                combined = rule(decoded).to(dtype)
            for r in range(RANKS):
                aggregated = memories[r].aggregated(name, combined.clone())
                results[r].update(per_gradient(units[r][index], aggregated, local[r]))
        for r in range(RANKS):
            memories[r].end_step()
            compressors[r].end_step()
            out[r].append({"result": results[r], "memory": tensors_of(memories[r].state_dict())})
    return out


def assert_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=what)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("setup", SETUPS, ids=[label for label, *_ in SETUPS])
def test_takes_the_dtype_exactly_as_its_reference_or_refuses_it_by_name(setup, dtype):
    label, make, make_twin, make_memory = setup
    if dtype in REFUSED.get(label, set()):
        with pytest.raises(TypeError, match=str(dtype).removeprefix("torch.")):
            library(make, make_memory, dtype)
        return
    got, want = library(make, make_memory, dtype), twins(make_twin, make_memory, dtype, make().traits.spans_step)
    for rank in range(RANKS):
        for step in range(STEPS):
            for name, _, _ in TENSORS:
                assert_equal(got[rank][step]["result"][name], want[rank][step]["result"][name],
                             f"{label} rank {rank} step {step} {name}")
            kept, expected = got[rank][step]["memory"], want[rank][step]["memory"]
            assert kept.keys() == expected.keys(), label
            for key in expected:
                assert_equal(kept[key], expected[key], f"{label} rank {rank} step {step} memory {key}")


def test_every_refusal_names_a_registered_setup():
    assert set(REFUSED) <= {label for label, *_ in SETUPS}
