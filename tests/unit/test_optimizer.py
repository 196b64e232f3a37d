"""The Horovod integration (``grace_legacy/optimizer.py``): ``import grace_legacy`` rebinds only the
name users call, ``hvd.DistributedOptimizer``, and ``uninstall()`` gives it back; Horovod's own
module keeps Horovod's function, which is what its ``broadcast_optimizer_state`` compares
optimizers against; the rebound function takes Horovod's arguments with Horovod's defaults, and
GRACE's ``grace=`` beside them (refused together with ``compression=``)."""

import pytest
import torch

hvd = pytest.importorskip("horovod.torch")
import horovod.torch.optimizer  # noqa: E402

import grace_legacy  # noqa: E402
from grace_legacy import TopK, grace_from_params  # noqa: E402
from grace_legacy import optimizer as integration  # noqa: E402


def test_only_the_public_name_is_rebound():
    assert hvd.DistributedOptimizer is integration.DistributedOptimizer
    assert horovod.torch.optimizer.DistributedOptimizer.__module__ == "horovod.torch.optimizer"
    assert integration.installed()


def test_uninstall_restores_horovods_function_and_install_is_idempotent():
    try:
        integration.uninstall()
        assert hvd.DistributedOptimizer is horovod.torch.optimizer.DistributedOptimizer
        assert not integration.installed()
        integration.uninstall()
        assert hvd.DistributedOptimizer is horovod.torch.optimizer.DistributedOptimizer
    finally:
        integration.install()
        integration.install()
    assert hvd.DistributedOptimizer is integration.DistributedOptimizer


def test_the_rebound_function_takes_horovods_arguments_with_horovods_defaults():
    import inspect

    ours = inspect.signature(integration.DistributedOptimizer).parameters
    theirs = inspect.signature(horovod.torch.optimizer.DistributedOptimizer).parameters
    assert list(ours)[:len(theirs)] == list(theirs)  # GRACE's grace= comes after them
    for name, parameter in theirs.items():
        if name == "compression":  # a sentinel that stands for Compression.none (grace= needs to tell)
            assert repr(ours[name].default) == "Compression.none"
        else:
            assert ours[name].default == parameter.default, name


def test_distributed_optimizer_takes_grace_as_compression_and_refuses_both():
    hvd = pytest.importorskip("horovod.torch")
    assert grace_legacy.DistributedOptimizer is hvd.DistributedOptimizer
    model = torch.nn.Linear(3, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    grc = grace_from_params({"compressor": "topk", "communicator": "allgather"})
    for compression in (hvd.Compression.none, hvd.Compression.fp16, TopK(0.1)):
        with pytest.raises(ValueError, match="both grace=.* and compression="):
            hvd.DistributedOptimizer(sgd, grace=grc, compression=compression,
                                     named_parameters=model.named_parameters())
    with pytest.raises(TypeError, match="grace must be a grace_legacy Grace bundle or Compressor"):
        hvd.DistributedOptimizer(sgd, grace={"compressor": "topk"}, named_parameters=model.named_parameters())
