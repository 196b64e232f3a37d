"""Every zoo case (``tests/registry.py``) over four in-process ranks, along both paths a CPU
tensor can take (:mod:`grace_legacy.runtime.paths`: the CPU's compiled loops, and the tensor formulas
a GPU runs), and on a GPU where there is one: the synchronized gradient equals the case's
independent rule over the twins' decompressed payloads (``tests/zoo_in_process.py``)."""

import pytest
import torch

from grace_legacy.runtime import paths
from tests.registry import zoo_cases
from tests.zoo_in_process import TENSORS, run_case

CASES = zoo_cases()
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("case", CASES, ids=[case.label for case in CASES])
@pytest.mark.parametrize("path", ["cpu", "device"])
@pytest.mark.parametrize("device", DEVICES)
def test_every_zoo_case_matches_its_rule(case, path, device):
    if device != "cpu" and path == "cpu":
        pytest.skip("only CPU tensors have a CPU path")
    with paths.device_path(path == "device"):
        failures = run_case(case, world=4, device=device)
    assert not failures, "\n".join(failures[:10])


def test_the_made_up_gradients_reach_the_multithreaded_passes():
    """The largest tensor is large enough for the compiled passes to go by blocks on two threads."""
    from grace_legacy.compressors.kernels import compiled

    largest = max(torch.Size(shape).numel() for shape, _ in TENSORS.values())
    assert largest >= 2 * compiled.PER_THREAD and largest > compiled.BLOCK
