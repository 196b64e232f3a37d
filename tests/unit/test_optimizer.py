"""``import grace_legacy`` rebinds only the name users call, ``hvd.DistributedOptimizer``, and
``uninstall()`` gives it back; Horovod's own module keeps Horovod's function, which is what its
``broadcast_optimizer_state`` compares optimizers against."""

import pytest

hvd = pytest.importorskip("horovod.torch")
import horovod.torch.optimizer  # noqa: E402

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
