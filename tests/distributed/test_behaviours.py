"""What Horovod's own suite checks of its optimizer, with grace_legacy compression and with Horovod's
``Compression.none`` beside it, under real horovodrun (Gloo and MPI): a second synchronization
changes nothing, ``load_state_dict`` in mid-step drops the step without a trace (with compression), ``zero_grad`` and
extra backward passes raise Horovod's errors, branches used on one rank, ``requires_grad``
toggled, no ``named_parameters`` and ``broadcast_optimizer_state`` after training all leave every
rank's parameters bit-identical (see ``behaviours_worker.py``)."""

import pytest

from tests.distributed.launcher import CONTROLLERS, run_checks

pytestmark = pytest.mark.distributed

COMPRESSIONS = ["hvd.Compression.none", "TopK(0.1)+Residual", "PowerSGD(1)", "Legacy(TopK) by step"]
BEHAVIOURS = ["synchronize then step", "load_state_dict mid-step", "zero_grad with pending gradients",
              "too many backward passes", "branch on one rank", "requires_grad toggled", "no named_parameters",
              "broadcast_optimizer_state after training"]


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_horovods_optimizer_behaviours_hold_with_compression(controller, tmp_path):
    reports = run_checks("behaviours_worker.py", 2, controller, tmp_path, timeout=400)
    names = {check["name"] for check in reports[0]["checks"]}
    for behaviour in BEHAVIOURS:
        for compression in COMPRESSIONS:
            if (behaviour, compression) != ("load_state_dict mid-step", "hvd.Compression.none"):
                assert any(name.startswith(f"{behaviour}/{compression}") for name in names), (behaviour, compression)
