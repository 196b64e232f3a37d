"""grace_legacy.fsdp in one process: the layout against torch's own chunking of FSDP's flat, FSDP's
reduce ops, the FSDP default bundle and its refusals, and the refusals that need a real unit (one
rank, Gloo: FSDP never reduce-scatters there, so only registration runs)."""

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import grace_legacy.fsdp as fsdp
from grace_legacy import (
    QSGD,
    Accordion,
    Allgather,
    EFSignSGD,
    EFSignSGDMemory,
    Grace,
    Legacy,
    LGreCo,
    NoMemory,
    PowerSGD,
    Residual,
    TopK,
)
from grace_legacy.fsdp.layout import dim0_shape, unit_pieces
from grace_legacy.fsdp.reduce_scatter import reduction_of


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_pieces_are_where_fsdps_chunk_cat_puts_each_gradient(world):
    shapes = [(21, 12), (21,), (9, 21), (3,), (1,), (2, 3, 4)]
    grads = [torch.randn(shape, generator=torch.Generator().manual_seed(i)) for i, shape in enumerate(shapes)]
    pieces, width = unit_pieces([(str(i), torch.Size(s)) for i, s in enumerate(shapes)], world)
    flat = torch.empty(world, width)
    torch._chunk_cat(grads, dim=0, num_chunks=world, out=flat)  # what foreach_reduce_scatter_copy_in runs
    for piece, grad in zip(pieces, grads, strict=True):
        rows = -(-grad.shape[0] // world)
        for owner in range(world):
            real = grad[owner * rows: (owner + 1) * rows]
            shape = piece.segment_shape(owner)
            assert shape == real.shape
            got = flat[owner, piece.offset: piece.offset + shape.numel()].view(shape)
            assert torch.equal(got, real)
            assert not flat[owner, piece.offset + shape.numel(): piece.offset + piece.width].any()  # padding
            start, stop = piece.span(owner)
            assert torch.equal(grad.reshape(-1)[start:stop], real.reshape(-1))


def test_a_gradient_sharded_on_another_dimension_is_stacked_along_the_first():
    assert dim0_shape((6, 8), 1, 4) == torch.Size([24, 2])
    assert dim0_shape((6, 8), 0, 4) == torch.Size([6, 8])
    with pytest.raises(ValueError, match="divide evenly"):
        dim0_shape((6, 9), 1, 4)


def test_fsdps_reduce_ops():
    assert reduction_of(dist.ReduceOp.AVG, 4) == (True, 1.0)
    assert reduction_of(dist.ReduceOp.SUM, 4) == (False, 1.0)
    assert reduction_of(dist.ReduceOp.PREMUL_SUM(0.4), 4) == (False, 0.4)
    with pytest.raises(ValueError, match="MAX"):
        reduction_of(dist.ReduceOp.MAX, 4)


def test_a_torch_without_the_seam_is_refused_naming_ddp():
    with pytest.raises(RuntimeError, match="grace_legacy.ddp"):
        fsdp.check_torch(type("OldFSDPModule", (), {}))
    with pytest.raises(RuntimeError, match="set_custom_reduce_scatter"):
        fsdp.check_torch(None)


def test_the_default_bundle_leaves_error_feedback_out_and_says_so():
    with pytest.warns(UserWarning, match=r"without error feedback.*Residual"):
        grace = fsdp.fsdp_bundle(TopK(0.01))
    assert isinstance(grace.memory, NoMemory)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert isinstance(fsdp.fsdp_bundle(QSGD(4)).memory, NoMemory)  # memory-free: nothing to say
        chosen = Grace(TopK(0.01), memory=Residual())
        assert fsdp.fsdp_bundle(chosen) is chosen
        # An algorithm whose memory is part of it keeps it.
        assert isinstance(fsdp.fsdp_bundle(EFSignSGD(0.1)).memory, EFSignSGDMemory)


@pytest.mark.parametrize(("compression", "names"), [
    (PowerSGD(2), "grace_legacy.ddp"),
    (Legacy(PowerSGD(), by="layer", values=[None, 2], splits=[100]), "allreduce rounds"),
    (Accordion(TopK(), low=0.5, high=0.1, interval=2), "Legacy or DGCWarmup"),
    (LGreCo(TopK(), [1.0, 0.1], reference=0.1, interval=2), "Legacy or DGCWarmup"),
    (Grace(TopK(0.1), communicator=Allgather()), "communicator"),
])
def test_what_cannot_travel_in_a_reduce_scatter_is_refused(compression, names):
    with pytest.raises(ValueError, match=names):
        fsdp.fsdp_bundle(compression)


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_registration_on_one_rank_and_the_refusals_that_need_a_unit(one_rank):
    mesh = init_device_mesh("cpu", (1,))
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    fully_shard(net[0], mesh=mesh)
    fully_shard(net, mesh=mesh)
    state = fsdp.register(net, QSGD(4))
    assert [unit.label for unit in state.units] == ["<root>", "0"]
    assert all(isinstance(unit.param_group()._reduce_scatter_comm, fsdp.CompressedReduceScatter)
               for unit in state.units)
    net(torch.randn(2, 4)).sum().backward()  # one rank: FSDP reduces nothing, the step is not counted
    assert state.steps == 0
    with pytest.raises(RuntimeError, match="set_reduce_scatter_unused_params"):
        state.units[1].pieces(2, 7)  # 15 + 3 elements fill 2 x 9, not 7
    report = state.memory_report()
    assert report["unsharded_gradient"] == 4 * (12 + 3 + 6 + 2) and report["state"] == 0
    with pytest.raises(TypeError, match="fully_shard"):
        fsdp.register(torch.nn.Linear(2, 2), QSGD(4))
    groups = net._get_fsdp_state()._fsdp_param_groups
    groups.append(groups[0])  # as a shard_placement_fn giving parameters two meshes leaves it
    try:
        with pytest.raises(ValueError, match="parameter groups"):
            fsdp.register(net, QSGD(4))
    finally:
        groups.pop()
    hsdp = torch.nn.Linear(2, 2)
    fully_shard(hsdp, mesh=init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard")))
    with pytest.raises(ValueError, match="1-D mesh"):
        fsdp.register(hsdp, QSGD(4))
