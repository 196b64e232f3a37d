"""Elastic training in one process (ranks are threads, ``tests.helpers.run_ranks``): after the world
changes, every rank continues from rank 0's shared compression state while survivors keep their
own error-feedback residuals and newcomers start empty; world-wide memory state (EF21) starts
afresh; a bundle notices a new rank or size by itself; restoring goes back to the last commit;
Horovod's elastic handler registry matches our objects only; and a process set is refused."""

from __future__ import annotations

import copy

import horovod.torch as hvd
import pytest
import torch
from horovod.torch.elastic import state as hvd_state

from grace_legacy import EF21, Grace, Residual, TopK, elastic
from tests.helpers import run_ranks
from tests.unit.test_checkpoint import NAMES, SETUPS, differences, step

REJOINING = ["legacy-epoch-topk", "randomk-residual", "powersgd", "signum", "dgc", "topk-ef21", "accordion"]


def train(bundles: list[Grace], first: int, steps: int) -> list[list[dict[str, torch.Tensor]]]:
    """``steps`` synchronized steps of ``bundles[r]`` as rank ``r`` of a world of their number."""
    return run_ranks(len(bundles), lambda backend: [step(bundles[backend.rank()], backend, first + i)
                                                    for i in range(steps)])


def without_traffic(state: dict) -> dict:
    return {k: without_traffic(v) if isinstance(v, dict) else v for k, v in state.items() if k != "traffic"}


@pytest.mark.parametrize("setup", REJOINING)
def test_survivors_keep_their_residuals_and_everyone_takes_rank_zeros_shared_state(setup):
    bundles = [SETUPS[setup]() for _ in range(3)]
    train(bundles, 0, 3)
    # Rank 0 is lost; old ranks 1 and 2 become 0 and 1, and a newcomer joins as rank 2.
    survivors, newcomer = bundles[1:], SETUPS[setup]()
    before = [b.state_dict() for b in survivors]
    shared = elastic.shared_state(survivors[0])
    for bundle in [*survivors, newcomer]:
        elastic.rejoin(bundle, shared)
    for bundle, kept in zip(survivors, before, strict=True):
        if bundle.memory.survives_world_change:
            assert differences(bundle.memory.state_dict(), kept["memory"]) == []
        else:
            assert all(v == {} for k, v in bundle.memory.state_dict().items() if k != "config")
    assert all(v == {} for k, v in newcomer.memory.state_dict().items() if k != "config")
    for bundle in [*survivors, newcomer]:
        got, want = without_traffic(bundle.compressor.state_dict()), without_traffic(shared["compressor"])
        if setup == "signum":  # its momentum is of the rank's own gradients
            got.pop("momentum_buffers"), want.pop("momentum_buffers")
        assert differences(got, want) == []
    # Byte counts are what each process sent: a survivor's stay, a newcomer's start at zero.
    assert survivors[1].stats["bytes_sent"] > 0 and newcomer.stats["bytes_sent"] == 0
    # The new world agrees on every route and draw: each rank receives the same aggregate.
    results = train([*survivors, newcomer], 3, 2)
    for later in results[1:]:
        for mine, theirs in zip(results[0], later, strict=True):
            assert all(torch.equal(mine[n], theirs[n]) for n in NAMES)


def test_a_bundle_notices_a_new_rank_or_size_without_being_told():
    """Horovod skips synchronizing when ranks only left; the next step still sees the change."""
    kept, forgotten = [Grace(TopK(0.2), memory=Residual()) for _ in range(2)], [Grace(TopK(0.2), memory=EF21())
                                                                              for _ in range(2)]
    train(kept, 0, 2)
    train(forgotten, 0, 2)
    residual = kept[1].memory.state_dict()["residuals"]
    entered = run_ranks(1, lambda backend: [kept[1].join_world(backend), forgotten[1].join_world(backend),
                                            kept[1].join_world(backend)])
    assert entered == [[True, True, False]]
    assert differences(kept[1].memory.state_dict()["residuals"], residual) == []
    assert forgotten[1].memory.state_dict()["local"] == {} and forgotten[1].memory.state_dict()["estimates"] == {}
    assert [b.compressor.rank for b in (kept[1], forgotten[1])] == [0, 0]


def test_rejoining_from_another_configuration_is_refused():
    shared = elastic.shared_state(Grace(TopK(0.2)))
    with pytest.raises(ValueError, match=r"(?s)grace_legacy.elastic.rejoin: .*ratio=0.2.*ratio=0.1"):
        elastic.rejoin(Grace(TopK(0.1)), shared)


def test_restore_goes_back_to_the_last_commit():
    bundle = Grace(TopK(0.2), memory=Residual())
    train([bundle], 0, 2)
    handler = hvd_state._get_handler(bundle)
    assert isinstance(handler, elastic.CompressionStateHandler)
    handler.save()
    committed = bundle.state_dict()
    train([bundle], 2, 2)
    assert differences(bundle.state_dict(), committed) != []
    handler.restore()
    assert differences(bundle.state_dict(), {**committed, "placement": None}) == []


def test_the_registry_entry_matches_grace_legacy_objects_only():
    assert elastic.installed()
    assert isinstance(hvd_state._get_handler(Grace(TopK(0.1))), elastic.CompressionStateHandler)
    assert isinstance(hvd_state._get_handler(TopK(0.1)), elastic.CompressionStateHandler)
    assert isinstance(hvd_state._get_handler(torch.nn.Linear(2, 2)), hvd_state.ModelStateHandler)
    assert hvd_state._get_handler({"epoch": 3}) is None and hvd_state._get_handler(3) is None


def test_a_bare_compressor_outside_any_optimizer_is_named():
    handler = hvd_state._get_handler(TopK(0.1))
    with pytest.raises(ValueError, match=r"TopK\(ratio=0.1\) is not running in any optimizer yet"):
        handler.restore()


def test_uninstall_gives_horovod_its_registry_back_and_install_is_idempotent():
    try:
        elastic.uninstall()
        elastic.uninstall()
        assert [handler for _, handler in hvd_state.get_handler_registry()] == [
            hvd_state.ModelStateHandler, hvd_state.OptimizerStateHandler, hvd_state.SamplerStateHandler]
    finally:
        elastic.install()
        elastic.install()
    assert sum(handler is elastic.CompressionStateHandler for _, handler in hvd_state.get_handler_registry()) == 1


def test_a_process_set_is_refused_under_elastic_horovodrun(monkeypatch):
    """A reset renumbers the ranks, so a process set of fixed ranks would name other processes."""
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"process_set cannot be used .* under elastic horovodrun"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                 compression=TopK(0.1), process_set=hvd.ProcessSet([0]))


class CopyingOptimizerStateHandler(hvd_state.OptimizerStateHandler):
    """docs/HOROVOD_COMPATIBILITY.md#restore-twice: a restore that hands torch a copy."""

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self._saved_optimizer_state))


@pytest.mark.parametrize("make", [lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), torch.optim.Adam],
                         ids=["sgd-momentum", "adam"])
@pytest.mark.parametrize("handler_class", [hvd_state.OptimizerStateHandler, CopyingOptimizerStateHandler],
                         ids=["horovod", "copying"])
def test_a_second_restore_from_one_commit(make, handler_class):
    """Horovod's optimizer handler hands torch's load_state_dict the saved state, which torch keeps
    without copying: the next step writes over it, so a second restore from the same commit brings
    back the written-over state. The documented handler restores the commit both times. (When this
    fails for Horovod's handler, Horovod or torch changed and the note must go.)"""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = make(model.parameters())

    def optimizer_step() -> None:
        optimizer.zero_grad()
        model(torch.randn(5, 4)).pow(2).sum().backward()
        optimizer.step()

    def equals_commit() -> bool:
        now = optimizer.state_dict()["state"]
        return all(torch.equal(value, now[index][key]) for index, state in committed.items()
                   for key, value in state.items())

    optimizer_step()
    handler = handler_class(optimizer)
    handler.save()
    committed = copy.deepcopy(optimizer.state_dict()["state"])
    optimizer_step()
    handler.restore()
    assert equals_commit()
    optimizer_step()
    handler.restore()
    assert equals_commit() == (handler_class is CopyingOptimizerStateHandler)
