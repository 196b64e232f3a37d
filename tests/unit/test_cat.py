"""CAT (``compressors/cat.py``, Khirirat et al. 2021) against its independent reference
(``tests/reference_sparsifiers.py``), payload and decoded values bit for bit, in the four gradient
dtypes and on awkward contents; on large tensors its search of the largest entries only picks
the count a scan of every packet count picks; its arguments checked by name."""

from __future__ import annotations

import math

import pytest
import torch

from grace_legacy import CAT
from tests.reference_compressors import CONTENTS, DTYPES, assert_matches_reference
from tests.reference_sparsifiers import CATReference

SETTINGS = [(1.0, 60.0, 1460), (576.0, 64.0, 512), (1.0, 0.0, 64), (2.0, 5.0, 1)]


#: Every content and dtype at the defaults; the other settings on a few contents.
REFERENCE_CASES = [(SETTINGS[0], content, dtype) for content in CONTENTS for dtype in DTYPES] + [
    (setting, content, torch.float32) for setting in SETTINGS[1:] for content in ("normal", "ties", "zeros")]


@pytest.mark.parametrize(("setting", "content", "dtype"), REFERENCE_CASES, ids=str)
def test_payload_and_decoded_values_equal_the_reference(setting, content, dtype):
    assert_matches_reference(CAT(*setting), CATReference(*setting), content, dtype, f"CAT{setting}")


def every_packet_count(x: torch.Tensor, c0: float, c1: float, packet_bits: int) -> int:
    """T by the definition over every packet count, on the whole sorted tensor."""
    n = x.numel()
    tau = max(1, packet_bits // (8 * (x.element_size() + 4)))
    sums = torch.sort(x.abs(), descending=True).values.double().square().cumsum(0)
    packets = torch.arange(1, math.ceil(n / tau) + 1, dtype=torch.float64)
    ends = (packets.long() * tau).clamp(max=n) - 1
    return int(ends[torch.argmax(sums[ends] / (c0 * packets + c1))]) + 1


@pytest.mark.parametrize("setting", SETTINGS[:3:2], ids=str)
@pytest.mark.parametrize("spread", [0.5, 2.0, 6.0])
def test_searching_the_largest_entries_finds_what_scanning_every_packet_count_finds(setting, spread):
    # Heavier tails (spread) put the maximum at fewer packets; one setting has no per-message cost.
    g = torch.Generator().manual_seed(int(spread * 10))
    x = torch.randn(400_000, generator=g) * torch.exp(spread * torch.randn(400_000, generator=g))
    payload, _ = CAT(*setting).compress(x, "w")
    assert payload[0].numel() == every_packet_count(x, *setting)
    assert torch.equal(payload[0], x[payload[1].long()])


def test_it_sends_whole_packets_and_at_least_one():
    payload, _ = CAT(1.0, 60.0, 1460).compress(torch.randn(10_000), "w")
    assert payload[0].numel() % 22 == 0
    assert CAT().compress(torch.zeros(5), "w")[0][0].numel() == 5  # one packet holds all 5: ratio 0 everywhere
    assert CAT().traits.spans_step


@pytest.mark.parametrize(("arguments", "named"), [
    ({"c0": 0.0}, "c0"), ({"c0": -1.0}, "c0"), ({"c0": float("nan")}, "c0"), ({"c1": -0.5}, "c1"),
    ({"c1": float("inf")}, "c1"), ({"packet_bits": 0}, "packet_bits"), ({"packet_bits": 1.5}, "packet_bits"),
])
def test_bad_arguments_are_refused_by_name(arguments, named):
    with pytest.raises(ValueError, match=named):
        CAT(**arguments)


@pytest.mark.parametrize("value", ["1", None, True, torch.tensor(1.0)])
@pytest.mark.parametrize("argument", ["c0", "c1", "packet_bits"])
def test_wrong_types_are_a_type_error_by_name(argument, value):
    with pytest.raises(TypeError, match=argument):
        CAT(**{argument: value})
