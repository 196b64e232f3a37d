"""The whole zoo along both paths a CPU tensor can take (:mod:`grace_legacy.runtime.paths`: the CPU's
compiled loops, and the tensor formulas a GPU runs), and on a GPU where there is one
(``tests/zoo_in_process.py``):

* every registered case (``tests/registry.py``) over two in-process ranks: the synchronized gradient
  equals the case's independent rule over the twins' decompressed payloads;
* every scatter-gather case (``tests/two_phase.py``) over three in-process ranks (uneven shards):
  bit for bit the independent two-phase reference's.
"""

import pytest
import torch

from grace_legacy.compressors.kernels import compiled
from grace_legacy.runtime import paths
from tests.registry import zoo_cases
from tests.two_phase import SETUPS
from tests.zoo_in_process import TENSORS, run_case, run_two_phase_case

CASES = zoo_cases()
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _path_applies(device: str, path: str) -> None:
    if device != "cpu" and path == "cpu":
        pytest.skip("only CPU tensors have a CPU path")


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[case.label for case in CASES])
@pytest.mark.parametrize("path", ["cpu", "device"])
@pytest.mark.parametrize("device", DEVICES)
def test_every_zoo_case_matches_its_rule(case, path, device):
    _path_applies(device, path)
    with paths.device_path(path == "device"):
        failures = run_case(case, world=2, device=device)
    assert not failures, "\n".join(failures[:10])


@pytest.mark.slow
@pytest.mark.parametrize("label", sorted(SETUPS))
@pytest.mark.parametrize("path", ["cpu", "device"])
@pytest.mark.parametrize("device", DEVICES)
def test_every_scatter_gather_case_matches_the_two_phase_reference(label, path, device):
    _path_applies(device, path)
    with paths.device_path(path == "device"):
        failures = run_two_phase_case(label, world=3, device=device)
    assert not failures, "\n".join(failures[:10])


def test_the_made_up_gradients_reach_the_multithreaded_passes():
    """The largest tensor is large enough for the compiled passes to go by blocks on two threads."""
    largest = max(torch.Size(shape).numel() for shape, _ in TENSORS.values())
    assert largest >= 2 * compiled.PER_THREAD and largest > compiled.BLOCK
